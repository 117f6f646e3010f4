#include "server_recovery.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <map>

#include <fmt/core.h>

#include "example_main.h"

namespace examples {

namespace dist_optim = distoptim::dist_optim;
using Clock = std::chrono::steady_clock;
// How long a trainer goes on recovering servers that die while being restored.
constexpr std::chrono::minutes kRecoveryDeadline{3};

std::unique_ptr<dist_optim::SnapshotSchedule> snapshot_schedule(
    const std::filesystem::path& directory, int64_t every_steps,
    dist_optim::DistributedOptimizer& optimizer,
    std::vector<const distoptim::rpc::ShardedEmbeddingBag*> tables, int64_t step,
    std::vector<const distoptim::rpc::ShardedIdEmbeddingBag*> id_tables) {
  dist_optim::SnapshotOptions schedule(directory.string());
  if (every_steps > 0) {
    schedule.every_steps(every_steps);
  } else {
    schedule.every(kDefaultSnapshotPeriod);
  }
  return std::make_unique<dist_optim::SnapshotSchedule>(schedule, optimizer, std::move(tables),
                                                        step, std::move(id_tables));
}

void take_snapshot_if_due(dist_optim::SnapshotSchedule& snapshots, const std::string& name,
                          int64_t step) {
  try {
    snapshots.step();
  } catch (const c10::Error& e) {
    fmt::print("{}: a snapshot begun before step {} was abandoned: {}\n", name, step,
               one_line(e.what_without_backtrace()));
    std::fflush(stdout);
  }
}

std::vector<dist_optim::RecoveredOwner> recover_servers(
    const std::string& name, int64_t step, const distoptim::PeerLostError& lost,
    const ServerHeld& held, const std::filesystem::path& snapshots,
    const std::function<void(const std::string& worker)>& restored) {
  const auto failed_at = Clock::now();
  fmt::print("{}: step {} failed: {}\n", name, step, one_line(lost.what_without_backtrace()));
  std::fflush(stdout);
  // A server that dies while being restored, or another one meanwhile, fails the recovery as
  // lost: it is recovered again, as long as the servers come back within the deadline.
  const auto deadline = failed_at + kRecoveryDeadline;
  std::vector<dist_optim::RecoveredOwner> recovered;
  for (;;) {
    try {
      recovered = dist_optim::recover_lost_owners(*held.optimizer, held.tables, held.modules,
                                                  dist_optim::RecoveryOptions(snapshots.string())
                                                      .backups(held.backups)
                                                      .hot_standby(held.hot_standby),
                                                  held.id_tables);
      break;
    } catch (const distoptim::PeerLostError& again) {
      if (Clock::now() > deadline) throw;
      fmt::print("{}: recovering after step {}, a server was lost again ({}); recovering anew\n",
                 name, step, one_line(again.what_without_backtrace()));
      std::fflush(stdout);
    }
  }
  if (recovered.empty()) throw lost;
  for (const auto& owner : recovered) {
    if (restored) restored(owner.worker);
    const auto since_failure =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - failed_at).count();
    if (owner.served_by != owner.worker) {
      // Hot standby: nothing lost, nothing waited for but the take-over itself.
      fmt::print(
          "{}: worker '{}' was lost; its backup '{}' took over what it held (every step that "
          "returned to a trainer), {} ({} ms); stepping again {} ms after the failed step\n",
          name, owner.worker, owner.served_by,
          owner.restored_here ? "made there by this trainer" : "made there by another trainer",
          owner.waited.count(), since_failure);
      continue;
    }
    // What the loss cost: the server's updates since the snapshot, of every trainer.
    const std::string from =
        !owner.backup.empty()
            ? fmt::format("its backup '{}' (every step that returned to a trainer)", owner.backup)
        : owner.snapshot_step
            ? fmt::format(
                  "the snapshot of step {} (the first trainer's step; this trainer is at "
                  "step {}: the server's updates since the snapshot are lost)",
                  *owner.snapshot_step, step)
            : std::string("no snapshot (its initial values)");
    fmt::print(
        "{}: worker '{}' is back; {} what it held from {}; stepping again {} ms after the "
        "failed step\n",
        name, owner.worker, owner.restored_here ? "restored" : "another trainer restored", from,
        since_failure);
  }
  std::fflush(stdout);
  return recovered;
}

dist_optim::ReplicaOptions::Backups backup_ring(const std::vector<std::string>& servers) {
  dist_optim::ReplicaOptions::Backups backups;
  for (size_t i = 0; i < servers.size(); ++i) {
    backups[servers[i]] = servers[(i + 1) % servers.size()];
  }
  return backups;
}

namespace {

// Each server's count of the optimizer's steps it applied: its state's step count, the largest
// over its parameters there.
std::map<std::string, int64_t> applied_steps(const dist_optim::DistributedOptimizer& optimizer) {
  std::map<std::string, int64_t> applied;
  for (const auto& owner : optimizer.state_dict().owners) {
    int64_t& steps = applied[owner.worker];
    for (const auto& [index, state] : owner.state.state) steps = std::max(steps, state.step);
  }
  return applied;
}

// Of a trainer's steps that returned, those server `worker` no longer counts (lost by restores).
int64_t lost_on(const std::map<std::string, int64_t>& lost, const std::string& worker) {
  const auto it = lost.find(worker);
  return it == lost.end() ? 0 : it->second;
}
int64_t lost_on(const StepCounts& counts, const std::string& worker) {
  return lost_on(counts.lost, worker);
}

}  // namespace

StepCounts adopted_step_counts(const dist_optim::DistributedOptimizer& optimizer) {
  const std::map<std::string, int64_t> applied = applied_steps(optimizer);
  StepCounts counts;
  if (applied.empty()) return counts;
  int64_t fewest = applied.begin()->second, most = fewest;
  for (const auto& [worker, steps] : applied) {
    fewest = std::min(fewest, steps);
    most = std::max(most, steps);
  }
  counts.returned = fewest;
  counts.failed = most - fewest;
  return counts;
}

void note_snapshot_begun(const dist_optim::SnapshotSchedule& snapshots, StepCounts& counts) {
  const std::optional<int64_t> writing = snapshots.writing();
  if (!writing || counts.at_snapshot.count(*writing) > 0) return;
  counts.at_snapshot[*writing] = {counts.returned, counts.failed, counts.lost};
  // A restore loads one of the newest few: the schedule keeps two complete ones.
  while (counts.at_snapshot.size() > 4) counts.at_snapshot.erase(counts.at_snapshot.begin());
}

void account_restores(const std::string& name, StepCounts& counts,
                      const dist_optim::DistributedOptimizer& optimizer,
                      const std::vector<dist_optim::RecoveredOwner>& recovered) {
  const std::map<std::string, int64_t> applied = applied_steps(optimizer);
  for (const auto& owner : recovered) {
    if (!owner.backup.empty() || owner.served_by != owner.worker) continue;
    const auto it = applied.find(owner.worker);
    const int64_t there = it == applied.end() ? 0 : it->second;
    // The steps this server counted of this trainer's before it died, and what it lost of them.
    const int64_t lost_before = lost_on(counts, owner.worker);
    const int64_t lost = counts.returned - lost_before - there;
    counts.lost[owner.worker] = counts.returned - there;
    if (!owner.snapshot_step || owner.state_step != owner.snapshot_step) {
      fmt::print(
          "{}: worker '{}': this trainer's optimizer state there starts anew (the snapshot "
          "holds another trainer's): its {} steps there no longer count\n",
          name, owner.worker, lost);
      continue;
    }
    const auto at = counts.at_snapshot.find(*owner.snapshot_step);
    TORCH_CHECK(at != counts.at_snapshot.end(), name, ": worker '", owner.worker,
                "' came back from this trainer's snapshot of step ", *owner.snapshot_step,
                ", which it did not take");
    const StepCounts::AtSnapshot& then = at->second;
    const int64_t held_then = then.returned - lost_on(then.lost, owner.worker);
    // A step that failed before the snapshot may have reached this server, and so be in it.
    TORCH_CHECK(there >= held_then && there <= held_then + then.failed, name, ": worker '",
                owner.worker, "' came back from the snapshot of step ", *owner.snapshot_step,
                " holding ", there, " of this trainer's steps; it held ", held_then,
                " of those that had returned (and at most ", then.failed,
                " that failed) when the snapshot began");
    fmt::print(
        "{}: worker '{}' lost {} of this trainer's steps that returned: those since the "
        "snapshot of step {} ({})\n",
        name, owner.worker, lost, *owner.snapshot_step, counts.returned - then.returned);
  }
  std::fflush(stdout);
}

void check_applied_steps(const std::string& name, const StepCounts& counts,
                         const dist_optim::DistributedOptimizer& optimizer) {
  const std::map<std::string, int64_t> applied = applied_steps(optimizer);
  // Per server, the steps that returned less those a restore from a snapshot lost.
  std::string by_server;
  for (const auto& [worker, steps] : applied) {
    by_server += fmt::format("{}{} {} of {}", by_server.empty() ? "" : ", ", worker, steps,
                             counts.returned - lost_on(counts, worker));
  }
  fmt::print(
      "{}: {} steps returned, {} failed; applied by server (of those that returned, less "
      "those a restore lost): {}\n",
      name, counts.returned, counts.failed, by_server);
  std::fflush(stdout);
  for (const auto& [worker, steps] : applied) {
    const int64_t lost = lost_on(counts, worker);
    const int64_t returned = counts.returned - lost;
    TORCH_CHECK(steps <= returned + counts.failed, name, ": server '", worker, "' applied ", steps,
                " of its steps, more than the ", returned, " that returned (", lost,
                " lost by a restore before) and ", counts.failed,
                " that failed: a step applied twice");
    TORCH_CHECK(steps >= returned, name, ": server '", worker, "' applied ", steps, " of its ",
                returned, " steps that returned (", lost,
                " lost by a restore before): ", returned - steps, " lost");
  }
}

}  // namespace examples
