#pragma once

// The parameter-server examples' --elastic mode, servers' side of it: the first trainer snapshots
// the servers' state on a schedule, and a trainer whose step failed because a server was lost
// binds its model and optimizer to the server started again in its place and gives it back what
// it held from the latest snapshot, or from its backup's copies (dist_optim::recover_lost_owners),
// saying what the loss cost; and the trainer's check, at its end, that no step that returned was
// lost and none applied twice.

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <distoptim/comm/errors.h>
#include <distoptim/dist_optim/distributed_optimizer.h>
#include <distoptim/dist_optim/recovery.h>
#include <distoptim/dist_optim/replicas.h>
#include <distoptim/dist_optim/snapshot.h>

namespace examples {

/// A snapshot every 30 s by default. Its cost is writing the servers' parameters and their
/// optimizer state once (256 MB for the click-through model's default table with Adagrad), by
/// the servers, in the background at low priority: every 30 s bounds that to a few MB/s and what
/// a server's death loses to its last 30 s of updates.
constexpr std::chrono::seconds kDefaultSnapshotPeriod{30};

/// The first trainer's snapshots of `optimizer`'s parameters into `directory`: every
/// `every_steps` steps (0: every kDefaultSnapshotPeriod), counted from `step`. `tables` and
/// `id_tables`: the model's sharded tables, fixed and collisionless.
std::unique_ptr<distoptim::dist_optim::SnapshotSchedule> snapshot_schedule(
    const std::filesystem::path& directory, int64_t every_steps,
    distoptim::dist_optim::DistributedOptimizer& optimizer,
    std::vector<const distoptim::rpc::ShardedEmbeddingBag*> tables, int64_t step,
    std::vector<const distoptim::rpc::ShardedIdEmbeddingBag*> id_tables = {});

/// Counts a step in `snapshots`. A snapshot that failed (one written while a server died, say)
/// is abandoned, said (by worker `name`), and training goes on: the next one is taken when due.
void take_snapshot_if_due(distoptim::dist_optim::SnapshotSchedule& snapshots,
                          const std::string& name, int64_t step);

/// What a trainer's model and optimizer hold on the servers, for recover_servers.
struct ServerHeld {
  distoptim::dist_optim::DistributedOptimizer* optimizer;
  std::vector<distoptim::rpc::ShardedEmbeddingBag*> tables;
  std::vector<distoptim::rpc::RemoteModuleBase*> modules;
  /// Each server's backup when the optimizer's steps are replicated (replicate_steps): a lost
  /// server comes back from its backup's copies rather than from the snapshot.
  distoptim::dist_optim::ReplicaOptions::Backups backups = {};
  /// With backups: a lost server's backup serves what it held at once, without waiting for the
  /// server to come back (RecoveryOptions::hot_standby).
  bool hot_standby = false;
  /// The collisionless tables (from snapshots only: not with backups).
  std::vector<distoptim::rpc::ShardedIdEmbeddingBag*> id_tables = {};
};

/// Each of `servers` backed up by the next, the last by the first: {{"ps0", "ps1"}, {"ps1",
/// "ps0"}} for two.
distoptim::dist_optim::ReplicaOptions::Backups backup_ring(const std::vector<std::string>& servers);

/// A trainer's account of its own steps: those whose optimizer.step returned, those that failed.
struct StepCounts {
  int64_t returned = 0;
  int64_t failed = 0;
  /// Per server restored from a snapshot: this trainer's steps that had returned and its
  /// optimizer state there no longer counts (returned minus its step count there, just after
  /// the restore): the trainer's steps since the snapshot, or all of them when its state there
  /// started anew.
  std::map<std::string, int64_t> lost;
  /// The counts when each of this trainer's snapshots began (by the schedule's step): a server
  /// restored from one holds exactly the steps that had returned then, less those an earlier
  /// restore had lost.
  struct AtSnapshot {
    int64_t returned = 0;
    int64_t failed = 0;
    std::map<std::string, int64_t> lost;
  };
  std::map<int64_t, AtSnapshot> at_snapshot;
};

/// After `snapshots.step()`: notes `counts` as they stand for a snapshot begun just now.
void note_snapshot_begun(const distoptim::dist_optim::SnapshotSchedule& snapshots,
                         StepCounts& counts);

/// After recover_servers without replicas: for each server restored from a snapshot, how many
/// of worker `name`'s steps that returned it lost (noted in counts.lost, printed). When the
/// snapshot holds this trainer's optimizer state (it wrote it), they must be exactly those since
/// that snapshot: throws c10::Error naming the server and the snapshot otherwise.
void account_restores(const std::string& name, StepCounts& counts,
                      const distoptim::dist_optim::DistributedOptimizer& optimizer,
                      const std::vector<distoptim::dist_optim::RecoveredOwner>& recovered);

/// After take_over_replicated_state: the counts the predecessor's state brings, as
/// check_applied_steps reads them (each server's step count): the fewest as returned, the rest as
/// failed, so that its checks hold for the slot's steps from then on.
StepCounts adopted_step_counts(const distoptim::dist_optim::DistributedOptimizer& optimizer);

/// What the servers hold of worker `name`'s steps against `counts`: each server's count of the
/// steps of `optimizer` it applied (its optimizer state's step count, the largest over its
/// parameters there). Prints them; throws c10::Error naming the server when one holds more than
/// returned + failed (a step applied twice) or fewer than returned (a step that returned was
/// lost), less on a server restored from a snapshot what its restore lost (counts.lost). A
/// server that no gradient of some step reached counts fewer: the examples' batches reach every
/// server.
void check_applied_steps(const std::string& name, const StepCounts& counts,
                         const distoptim::dist_optim::DistributedOptimizer& optimizer);

/// After worker `name`'s step `step` failed with `lost`: binds `held` to every lost server once
/// it is back (waiting for it) and gives it back what it held from the latest snapshot in
/// `snapshots`; prints what the loss cost. A server lost again meanwhile is recovered again, for
/// up to 3 minutes. `restored(worker)` runs for each server bound again, whoever restored it (to
/// hand out the model's references as they now are, say: every trainer does, so that the last to
/// do so names each server's newest objects). Rethrows `lost` when no server was lost.
/// Returns what each recovery did.
std::vector<distoptim::dist_optim::RecoveredOwner> recover_servers(
    const std::string& name, int64_t step, const distoptim::PeerLostError& lost,
    const ServerHeld& held, const std::filesystem::path& snapshots,
    const std::function<void(const std::string& worker)>& restored = {});

}  // namespace examples
