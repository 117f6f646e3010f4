#pragma once

// Layer 6 of distoptim: the DistributedOptimizer (torch.distributed.optim.DistributedOptimizer).
#include <distoptim/dist_optim/distributed_optimizer.h>
#include <distoptim/dist_optim/recovery.h>
#include <distoptim/dist_optim/replicas.h>
#include <distoptim/dist_optim/sharded_table_checkpoint.h>
