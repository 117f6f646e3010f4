#pragma once

// Layer 4 of distoptim: the RPC framework (torch.distributed.rpc).
#include <distoptim/rpc/api.h>
#include <distoptim/rpc/errors.h>
#include <distoptim/rpc/futures.h>
#include <distoptim/rpc/id_embedding_bag.h>
#include <distoptim/rpc/interceptor.h>
#include <distoptim/rpc/registry.h>
#include <distoptim/rpc/remote_module.h>
#include <distoptim/rpc/row_guard.h>
#include <distoptim/rpc/rref.h>
#include <distoptim/rpc/sharded_embedding_bag.h>
#include <distoptim/rpc/values.h>
