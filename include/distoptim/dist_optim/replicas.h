#pragma once

// Replicas of parameter servers' state (PyTorch has none): each step of a DistributedOptimizer on
// a replicated owner (the primary) sends what it changed to another worker (its backup) before
// the step's reply returns, so that a step that returned to its trainer is on two workers.
//
//   dist_optim::replicate_steps(optimizer, {&table}, {&mlp},
//                               dist_optim::ReplicaOptions().backups({{"ps0", "ps1"},
//                                                                     {"ps1", "ps0"}}));
//   ... steps as before ...
//
// What the backup holds, per primary: a copy of each replicated parameter (a table shard's rows,
// a RemoteModule's parameters), shared by every trainer's optimizer that steps it, and each
// trainer's optimizer state of it. replicate_steps sends every parameter and its state whole
// (under an rpc::InPlaceUpdateGuard on the primary, so they are of one moment); then each step
// sends the rows a sparse step changed (of the parameter and of this trainer's state), or the
// whole parameter and state after a dense step. A sparse step sends its rows while it holds them
// (rpc::InPlaceRowUpdateGuard), so two trainers' updates of a row reach the copy in the order
// they reached the parameter. The copies live in the backup's memory (its primaries' parameters
// again, and the state of every trainer there).
//
// The keys of the copies: a table shard's is its shard_key(); parameter j of a RemoteModule's
// owner_parameters() is module_key() + "/" + j; a trainer's state buffer NAME of a parameter is
// the parameter's key + "/state/" + TRAINER + "/" + NAME, its step count ... + "/step" (TRAINER:
// the trainer's worker name).
//
// Errors of a step: a backup that cannot take the changes fails the step, applied on the primary
// (a RemoteError that says so; when the backup is itself an owner of the optimizer, lost, the
// step's error is the PeerLostError naming it, whatever the order of the replies). The primary's
// next step first sends everything whole again, as it does whenever the backup is a new incarnation
// (it died and was started again): a step fails, not applied, while its backup is lost, unless
// ReplicaOptions::continue_without_backup lets it go on there alone.
//
// A lost primary comes back from its backup's copies with recover_lost_owners
// (RecoveryOptions::backups, recovery.h): every step that returned to a trainer is in them; with
// RecoveryOptions::hot_standby the backup itself serves them at once.

#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <distoptim/dist_optim/distributed_optimizer.h>
#include <distoptim/rpc/remote_module.h>
#include <distoptim/rpc/sharded_embedding_bag.h>

namespace distoptim {
namespace dist_optim {

struct ReplicaOptions {
  using Backups = std::map<std::string, std::string>;
  /// Each primary's backup, by worker name: {{"ps0", "ps1"}, {"ps1", "ps0"}}.
  TORCH_ARG(Backups, backups);
  /// While a primary's backup is lost (its process died; no new incarnation of its name has
  /// joined yet), the primary's steps go on, applied there alone, rather than fail; the backup's
  /// next incarnation gets everything whole before the next step. What hot standby
  /// (recovery.h's RecoveryOptions::hot_standby) needs: a backup that took over a lost primary's
  /// shards has that primary, lost, as its own backup. The price: a step that returns while the
  /// backup is lost is on one worker only, so a second death before the backup's next
  /// incarnation took everything loses it. Default false: such a step fails.
  TORCH_ARG(bool, continue_without_backup) = false;
};

/// From the next step on, each step of `optimizer` on an owner that options.backups() names
/// sends its changes to that owner's backup before it returns (see the top of this file).
/// `tables` and `modules`: those whose shards and parameters the optimizer holds on the
/// replicated owners (they give the copies their keys, so that a recovery finds them). Blocks until
/// every replicated owner has taken it. Errors, before anything is sent: c10::ValueError naming a
/// backup named for a worker that owns none of the optimizer's parameters (skipped instead with
/// continue_without_backup: under hot standby a server's parts move), a worker that is its own
/// backup, or a replicated owner whose parameters that are no given table's shard are not, in the
/// optimizer's order, those of the given modules on it in their order (as recovery.h requires);
/// the owners' refusals (RemoteError, PeerLostError naming them) after all have answered.
void replicate_steps(DistributedOptimizer& optimizer,
                     const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                     const std::vector<rpc::RemoteModuleBase*>& modules,
                     const ReplicaOptions& options);

/// For a trainer that takes the place of one that died (its slot's replacement): loads, on every
/// owner options.backups() names, the optimizer state that trainer `predecessor` (its worker
/// name) had there, from the backup's copies (every step of it that returned is in them), into
/// `optimizer`'s state there, leaving the parameters as they are; then replicates this trainer's
/// steps as replicate_steps does (call it instead). So the replacement goes on with its
/// predecessor's Adagrad sums or Adam moments rather than afresh. A backup that holds no state of
/// `predecessor` for a parameter (a backup started again since, whose copies the predecessor's
/// steps never reached) leaves that parameter without state. `tables`, `modules` and errors as
/// replicate_steps's, and c10::ValueError naming a copy of a parameter the backup does not hold,
/// or a predecessor that is this trainer; nothing is loaded on an owner unless all of its state
/// was read. Then the predecessor's copies of its state are dropped from the backups.
void take_over_replicated_state(DistributedOptimizer& optimizer,
                                const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                                const std::vector<rpc::RemoteModuleBase*>& modules,
                                const ReplicaOptions& options, const std::string& predecessor);

/// The keys of the copies worker `backup` holds for worker `primary` (sorted), and one of them
/// (an undefined tensor when it holds none under `key`): what a recovery, or a check, reads.
std::vector<std::string> replica_keys(const std::string& backup, const std::string& primary);
at::Tensor replica_copy(const std::string& backup, const std::string& primary,
                        const std::string& key);

}  // namespace dist_optim
}  // namespace distoptim
