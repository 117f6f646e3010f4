#pragma once

// Layer 2 of distoptim: rendezvous and Gloo process groups.
#include <distoptim/comm/errors.h>
#include <distoptim/comm/etcd_store.h>
#include <distoptim/comm/process_group.h>
#include <distoptim/comm/rendezvous.h>
#include <distoptim/comm/store_round.h>
#include <distoptim/comm/store_server.h>
#include <distoptim/comm/store_wait.h>
