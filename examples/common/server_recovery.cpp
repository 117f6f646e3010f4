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
    std::vector<const distoptim::rpc::ShardedEmbeddingBag*> tables, int64_t step) {
  dist_optim::SnapshotOptions schedule(directory.string());
  if (every_steps > 0) {
    schedule.every_steps(every_steps);
  } else {
    schedule.every(kDefaultSnapshotPeriod);
  }
  return std::make_unique<dist_optim::SnapshotSchedule>(schedule, optimizer, std::move(tables),
                                                        step);
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
                                                      .hot_standby(held.hot_standby));
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

void check_applied_steps(const std::string& name, const StepCounts& counts,
                         const dist_optim::DistributedOptimizer& optimizer, bool replicated) {
  const std::map<std::string, int64_t> applied = applied_steps(optimizer);
  std::string by_server;
  for (const auto& [worker, steps] : applied) {
    by_server += fmt::format("{}{} {}", by_server.empty() ? "" : ", ", worker, steps);
  }
  fmt::print("{}: {} steps returned, {} failed; applied by server: {}\n", name, counts.returned,
             counts.failed, by_server);
  std::fflush(stdout);
  for (const auto& [worker, steps] : applied) {
    if (counts.inherited.count(worker) > 0) continue;
    TORCH_CHECK(steps <= counts.returned + counts.failed, name, ": server '", worker, "' applied ",
                steps, " of its steps, more than the ", counts.returned, " that returned and ",
                counts.failed, " that failed: a step applied twice");
    TORCH_CHECK(!replicated || steps >= counts.returned, name, ": server '", worker, "' applied ",
                steps, " of its ", counts.returned,
                " steps that returned, though replicated: ", counts.returned - steps, " lost");
  }
}

}  // namespace examples
