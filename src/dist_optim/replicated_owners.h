#pragma once

// The trainer's side of replicas (replicas.h) that recovery uses too: the keys of a replicated
// owner's parameters, and the load of an owner made anew from its backup's copies.

#include <string>
#include <vector>

#include <distoptim/dist_optim/distributed_optimizer.h>
#include <distoptim/dist_optim/replicas.h>
#include <distoptim/rpc/remote_module.h>
#include <distoptim/rpc/sharded_embedding_bag.h>

#include "owner_calls.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

/// An owner of the optimizer's parameters and the key of each of their copies, in the order of
/// its optimizer's parameters.
struct ReplicatedOwner {
  OwnerOptimizer owner;
  std::vector<std::string> keys;
};

/// The owners named in `workers` (every one must own some of the optimizer's parameters, each a
/// shard of `tables` or a parameter of `modules`: c10::ValueError naming it otherwise), with
/// their keys; `what` names the caller in the errors.
std::vector<ReplicatedOwner> replicated_owners(const DistributedOptimizer& optimizer,
                                               const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                                               const std::vector<rpc::RemoteModuleBase*>& modules,
                                               const std::vector<std::string>& workers,
                                               const char* what);

/// replicate_steps; `restored_from_them`: the owners were just loaded from their backups' copies
/// (load_from_backup), which are then taken as current rather than sent again.
void set_backups(DistributedOptimizer& optimizer,
                 const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                 const std::vector<rpc::RemoteModuleBase*>& modules, const ReplicaOptions& options,
                 bool restored_from_them);

/// Loads worker `worker`'s parameters (when `with_value`) and the optimizer state of them that
/// trainer `state_owner` had (this trainer's own, or a dead one's whose place it takes) from
/// worker `backup`'s copies, into `optimizer` (bound to `worker`, or its new incarnation).
/// Errors: c10::ValueError naming a copy the backup does not hold; the owner's and the backup's
/// refusals (RemoteError, PeerLostError naming them). Nothing is loaded unless all was read.
void load_from_backup(DistributedOptimizer& optimizer,
                      const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                      const std::vector<rpc::RemoteModuleBase*>& modules, const std::string& worker,
                      const std::string& backup, bool with_value, const std::string& state_owner);

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
