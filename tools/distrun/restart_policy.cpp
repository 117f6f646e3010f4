#include "distrun/restart_policy.h"

#include <fmt/format.h>

namespace distoptim {
namespace launcher {

bool restart_all_wanted(const LaunchOptions& options, int restart_count, int received_signal,
                        bool failed) {
  if (options.restart_policy == RestartPolicy::kRank) return false;
  if (received_signal != 0 || restart_count == options.max_restarts) return false;
  return failed;
}

bool may_restart_alone(const LaunchOptions& options, int rank, int restart_count,
                       bool job_stopping) {
  // Under the static backend rank 0 serves the store the others met in: a new rank 0 would
  // serve an empty one, which nobody could rejoin. In etcd the store outlives every rank.
  const bool hosts_store = rank == 0 && options.rdzv_backend == RdzvBackend::kStatic;
  return options.restart_policy == RestartPolicy::kRank && !hosts_store &&
         restart_count < options.max_restarts && !job_stopping;
}

std::string restart_all_notice(const LaunchOptions& options, int restart_count,
                               const std::optional<RoundOutcome>& round, int first_failure_rank) {
  const std::string failure = round ? round->describe()
                              : first_failure_rank >= 0
                                  ? fmt::format("rank {} failed first", first_failure_rank)
                                  : std::string("a rank could not be started");
  if (round) {
    return fmt::format(
        "distrun: attempt {} failed ({}); every node restarts its ranks: restart {} of at most "
        "{}, DISTRUN_RESTART_COUNT={}\n",
        restart_count + 1, failure, restart_count + 1, options.max_restarts, restart_count + 1);
  }
  return fmt::format(
      "distrun: attempt {} failed ({}); restarting the {} local rank(s): restart {} of at most "
      "{}, DISTRUN_RESTART_COUNT={}, {}\n",
      restart_count + 1, failure, options.nproc_per_node, restart_count + 1, options.max_restarts,
      restart_count + 1, meeting_point(options, restart_count + 1));
}

std::string restart_alone_notice(const LaunchOptions& options, int rank, int restart_count) {
  return fmt::format(
      "distrun: restarting rank {} alone (--restart-policy rank): restart {} of at most {} for "
      "this rank, DISTRUN_RESTART_COUNT={}, {}; the other ranks keep running\n",
      rank, restart_count, options.max_restarts, restart_count,
      meeting_point(options, restart_count));
}

}  // namespace launcher
}  // namespace distoptim
