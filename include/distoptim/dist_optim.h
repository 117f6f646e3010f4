#pragma once

// Layer 6 of distoptim: the DistributedOptimizer (torch.distributed.optim.DistributedOptimizer).
#include <distoptim/dist_optim/distributed_optimizer.h>
