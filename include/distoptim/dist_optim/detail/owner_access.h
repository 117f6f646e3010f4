#pragma once

// Internal: the DistributedOptimizer's friend (distributed_optimizer.h), through which the
// library's own code beside it (checkpoints, snapshots) reaches its owners' optimizers; defined in
// src/dist_optim/owner_calls.h. Not part of the public API; names may change.

namespace distoptim {
namespace dist_optim {
namespace detail {

struct OwnerAccess;

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
