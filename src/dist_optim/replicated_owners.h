#pragma once

// The trainer's side of replicas (replicas.h) that recovery uses too: the keys of a replicated
// owner's parameters, and the load of an owner made anew from its backup's copies.

#include <set>
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

/// The primaries of options.backups() to replicate: all (checked not to be their own backups),
/// but with continue_without_backup those that own none of the optimizer's parameters now.
std::vector<std::string> primaries(const DistributedOptimizer& optimizer,
                                   const ReplicaOptions& options);

/// replicate_steps; `restored_from_them`: the owners were just loaded from their backups' copies
/// (load_from_backup), which are then taken as current rather than sent again.
void set_backups(DistributedOptimizer& optimizer,
                 const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                 const std::vector<rpc::RemoteModuleBase*>& modules, const ReplicaOptions& options,
                 bool restored_from_them);

/// What load_from_backup loads.
struct BackupLoad {
  /// The owner whose optimizer takes it (the lost owner's new incarnation, or the backup that
  /// took over its parameters).
  std::string worker;
  /// Whose copies are read, and the worker whose copies they are (the lost owner: empty, or
  /// `worker`, when it is the new incarnation).
  std::string backup, primary;
  /// The keys of the parameters loaded (those the lost owner held); empty: all of `worker`'s.
  std::set<std::string> keys;
  /// The parameters' values too, or the optimizer state alone.
  bool with_value = false;
  /// The trainer whose state is loaded (this one, or a dead one whose place it takes).
  std::string state_owner;
};

/// Loads the parameters `load` names (when with_value) and the optimizer state of them that
/// its state_owner had from the backup's copies, into `optimizer` on load.worker. Errors:
/// c10::ValueError naming a copy the backup does not hold; the owner's and the backup's
/// refusals (RemoteError, PeerLostError naming them). Nothing is loaded unless all was read.
void load_from_backup(DistributedOptimizer& optimizer,
                      const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                      const std::vector<rpc::RemoteModuleBase*>& modules, const BackupLoad& load);

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
