#pragma once

// A parameter server that died and was started again under its name (a new incarnation, e.g.
// by `distrun --restart-policy rank` in a dynamic group): the trainers' handles bind to it again
// without the user's code re-creating them, and it gets back what the latest snapshot holds, or
// what its backup's copies hold; or, with hot standby, its backup serves what it held at once.
// PyTorch has no equivalent (a lost owner ends its RPC job).
//
//   dist_optim::SnapshotSchedule snapshots(dist_optim::SnapshotOptions(dir).every_steps(100),
//                                          optimizer, {&table});
//   for (int64_t step = 1; step <= steps; ++step) {
//     try {
//       ...  // forward, dist_autograd::backward, optimizer.step(context)
//       snapshots.step();
//     } catch (const PeerLostError&) {
//       dist_optim::recover_lost_owners(optimizer, {&table}, dist_optim::RecoveryOptions(dir));
//       // this batch's step may have reached the living owners: go on with the next batch
//     }
//   }
//
// What a recovery does, for each owner of the optimizer's parameters that is lost (its calls
// fail as lost, or its name is gone from the group or taken by another process): it waits for a
// worker of that name to be a member again, then one trainer (the first to ask the new worker)
// makes the lost table shards and RemoteModules there anew, binds its handles and its optimizer
// to them and loads the owner's part of the newest snapshot in `snapshot_directory` (its rows and
// module parameters); only then does the new worker hand the same shards and modules to the
// other trainers that ask. A snapshot holds the optimizer state of the trainer whose
// SnapshotSchedule wrote it (its manifest names it): that trainer's optimizer takes it, whether it
// restored or bound, so that its state and the parameters are one cut. Every other trainer's
// optimizer starts without state there (as a new trainer's would: another trainer's Adagrad sums
// or step counts are not its own), or takes it from its own snapshots
// (RecoveryOptions::state_directory). A trainer started in a dead one's place is another trainer
// here: its name is new. The cost: every update the owner took since that snapshot (its step is
// returned), none on the other owners; with no snapshot the shards and modules start from their
// initial values.
//
// Hot standby (RecoveryOptions::hot_standby, with replicas): a lost owner that has a backup is
// not waited for. One trainer (the first to claim it on the backup) makes the lost owner's
// shards and modules on the backup and loads them from the backup's own copies (no bytes cross
// the network: every step that returned is in them); the other trainers bind to what it made.
// Each trainer's optimizer on the backup then holds the backup's own parameters and the lost
// owner's, with this trainer's state of both (DistributedOptimizer::rebind), and its steps go to
// the backup's own backup (replicate_steps's map), stepping on without it while it is away
// (ReplicaOptions::continue_without_backup): with two servers backing each other up, the lost
// server's next incarnation becomes the backup of both parts and takes them whole. The handles
// follow: ShardedEmbeddingBag::shard_owner and RemoteModule::remote_device name the backup. The
// cost: the time the take-over takes (RecoveredOwner::waited); a second death before the backup's
// own backup is back loses the steps since (they were on one worker).
//
// Decided: what a lost owner held is made anew from the trainers' handles alone: a
// ShardedEmbeddingBag's shards, a ShardedIdEmbeddingBag's (from snapshots only: a backup's copies
// are rows without their ids), and RemoteModules whose constructor's arguments the handle knows
// (RemoteModule::make_anew_with). An owner holding other parameters of the optimizer is
// refused (c10::ValueError naming it). Each shard and module is known to every handle by a key,
// its first reference's id (ShardedEmbeddingBag::shard_key, RemoteModule::module_key), kept when
// the handle is bound again: hand out the keys with the references
// (ShardedEmbeddingBag(options, shards, keys), RemoteModule::init_from_module_rref(device, rref,
// key)), so that a handle built after a recovery binds after the next one too. If the trainer
// that restores dies before the new worker hands out what it made, the next trainer that asks
// restores instead.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <torch/arg.h>

#include <distoptim/dist_optim/distributed_optimizer.h>
#include <distoptim/dist_optim/replicas.h>
#include <distoptim/rpc/id_embedding_bag.h>
#include <distoptim/rpc/remote_module.h>
#include <distoptim/rpc/sharded_embedding_bag.h>

namespace distoptim {
namespace dist_optim {

struct RecoveryOptions {
  /* implicit */ RecoveryOptions(std::string snapshot_directory = {})
      : snapshot_directory_(std::move(snapshot_directory)) {}
  /// Where a SnapshotSchedule writes (its newest complete snapshot is loaded); empty: none.
  TORCH_ARG(std::string, snapshot_directory);
  /// Where this trainer's own SnapshotSchedule writes, when snapshot_directory is another
  /// trainer's: once bound to a recovered owner, this trainer's optimizer takes its state there
  /// from the newest snapshot in it (the owner's parameters stay as the restorer loaded them).
  /// Empty (or snapshot_directory): this trainer's state comes from snapshot_directory's snapshot
  /// if this trainer wrote it, else it starts without state there.
  TORCH_ARG(std::string, state_directory);
  /// Each replicated owner's backup (replicas.h: as given to replicate_steps). A lost owner that
  /// has one is restored from the backup's copies, not from a snapshot: its parameters as the
  /// last step that reached the backup left them (every step that returned to a trainer), and
  /// each trainer's optimizer state there from its own copies; its steps go to the backup again
  /// from then on.
  TORCH_ARG(ReplicaOptions::Backups, backups);
  /// Hot standby: a lost owner that has a backup (backups) is not waited for; its parts (table
  /// shards, RemoteModules, each trainer's optimizer state of them) are made on the backup from
  /// the backup's copies, with every step that returned, and the backup serves them from then
  /// on, beside its own (see the top of this file). Give replicate_steps
  /// ReplicaOptions::continue_without_backup too, so that the backup steps on while its own
  /// backup, often the lost owner, is away. Default false: wait for the owner's new incarnation.
  TORCH_ARG(bool, hot_standby) = false;
  /// How long to wait for a lost owner to come back, and for another trainer's restore of it.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
};

/// What one recovery of one owner did.
struct RecoveredOwner {
  std::string worker;
  /// The step of the snapshot its parameters were loaded from; nullopt: none (initial rows).
  std::optional<int64_t> snapshot_step;
  /// Whether this trainer made the owner's shards anew and loaded the snapshot (else another did
  /// and this one bound to them).
  bool restored_here = false;
  /// The step of this trainer's own snapshot its optimizer's state there was loaded from (the
  /// snapshot_step one, when this trainer wrote it, or state_directory's newest); nullopt: none.
  std::optional<int64_t> state_step;
  /// The backup whose copies its parameters and this trainer's state were loaded from (then
  /// snapshot_step and state_step are nullopt); empty: none.
  std::string backup;
  /// The worker that holds the owner's parts now: its new incarnation (`worker`), or with
  /// hot_standby its backup.
  std::string served_by;
  /// From the call to the owner's shards being bound again here.
  std::chrono::milliseconds waited{0};
};

/// Binds `optimizer`, `tables`, `modules` and `id_tables` to every lost owner of the optimizer's
/// parameters once it is back (see the top of this file); returns one entry per owner
/// recovered, none when no owner was lost. `tables`: every ShardedEmbeddingBag whose shards are
/// among the optimizer's parameters (as remote_parameters() gave them). `modules`: the
/// RemoteModules whose parameters the optimizer holds; a lost owner's parameters that are no
/// table's shard must be, in the optimizer's order, those of its modules in the order of
/// `modules`. `id_tables`: every ShardedIdEmbeddingBag whose shards the optimizer holds (the
/// snapshots' id_tables). A lost shard of one is made anew empty and gets the ids the snapshot
/// holds on it, with their rows; with their state rows in the optimizer of the trainer that wrote
/// the snapshot, and from a new state in every other trainer's (another trainer's state of ids
/// is not its own, and its own snapshot's ids need not hold those rows: state_directory does
/// not apply to them). Such tables come back from snapshots only (not from backups). Not while
/// another call uses these handles. Errors: TimeoutError naming the owner that did not come
/// back, or the trainer whose restore did not finish, within `timeout`; c10::ValueError naming
/// an owner holding parameters that are neither a table's shard nor a module's, a module that
/// cannot be made anew (make_anew's errors), or a collisionless table's owner given a backup;
/// the failures of loading the snapshot (load_snapshot's, for that owner).
std::vector<RecoveredOwner> recover_lost_owners(
    DistributedOptimizer& optimizer, const std::vector<rpc::ShardedEmbeddingBag*>& tables,
    const std::vector<rpc::RemoteModuleBase*>& modules, const RecoveryOptions& options = {},
    const std::vector<rpc::ShardedIdEmbeddingBag*>& id_tables = {});
/// The same without modules.
std::vector<RecoveredOwner> recover_lost_owners(
    DistributedOptimizer& optimizer, const std::vector<rpc::ShardedEmbeddingBag*>& tables,
    const RecoveryOptions& options = {});

}  // namespace dist_optim
}  // namespace distoptim
