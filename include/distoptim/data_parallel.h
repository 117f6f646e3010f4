#pragma once

// Layer 3 of distoptim: data parallel training.
#include <distoptim/data_parallel/checkpoint.h>
#include <distoptim/data_parallel/comm_hooks.h>
#include <distoptim/data_parallel/distributed_data_parallel.h>
#include <distoptim/data_parallel/gradient_store.h>
#include <distoptim/data_parallel/join.h>
#include <distoptim/data_parallel/large_block_cache.h>
#include <distoptim/data_parallel/model_averaging.h>
#include <distoptim/data_parallel/post_local_sgd_hook.h>
#include <distoptim/data_parallel/post_local_sgd_optimizer.h>
#include <distoptim/data_parallel/power_sgd_hook.h>
#include <distoptim/data_parallel/zero_redundancy_optimizer.h>
