#pragma once

// What distrun tells on stderr once a job has ended badly (or, under --restart-policy rank, after
// any restart): for each attempt, how every local rank ended, which ones distrun stopped and with
// which signals, and which ranks the first failure's error names; then why no further attempt
// followed. Pure text from what the supervisor passes in.

#include <optional>
#include <string>
#include <vector>

#include "distrun/node_coordination.h"
#include "distrun/options.h"
#include "distrun/rank_process.h"

namespace distoptim {
namespace launcher {

/// An attempt's first failure, and the ranks its error names: a rank whose collective failed
/// often exits first while the culprit it names still hangs.
struct FirstFailure {
  int rank = -1;   // the first rank to fail; -1 before, or when a rank could not be started
  int status = 0;  // the job's exit status from it; 0 before
  /// The ranks the first failure's stderr names: the local ones that had not exited when it
  /// failed, and the others.
  std::vector<int> named_running;
  std::vector<int> named_other;
};

/// Reads which ranks the last words (stderr) of `failed`, the first run to fail, name, into
/// first.named_running (local ranks whose current run in `runs` has not exited yet) and
/// first.named_other (the rest).
void note_ranks_named_by(FirstFailure& first, const RankProcess& failed,
                         const std::vector<RankProcess>& runs, const LaunchOptions& options);

/// The summary of the attempt that has just ended, one line per rank in order (with each earlier
/// run of a rank restarted alone below it), under a heading that says which attempt it was and,
/// across nodes (`round` given), how it ended on every node.
std::string attempt_summary(const LaunchOptions& options, int restart_count,
                            const std::optional<RoundOutcome>& round,
                            const std::vector<RankProcess>& runs, const FirstFailure& first);

/// How the job ended, as the final report reads it.
struct JobEnd {
  int restart_count = 0;  // the DISTRUN_RESTART_COUNT of the last attempt (or round)
  int exit_status = 0;
  int received_signal = 0;  // the SIGINT or SIGTERM distrun got, or 0
  bool coordinated = false;
  std::optional<RoundOutcome> round;  // coordinated: how the last round ended on every node
  std::string coordination_error;     // why the coordination failed; empty if it did not
  int first_failure_rank = -1;        // of the last attempt
};

/// The report: why there is no further attempt, then `summaries` (one per attempt, in order;
/// without restarts, or under kRank, only the last, as the one attempt). `runs`: the last
/// attempt's runs.
std::string final_report(const LaunchOptions& options, const JobEnd& end,
                         const std::vector<std::string>& summaries,
                         const std::vector<RankProcess>& runs);

}  // namespace launcher
}  // namespace distoptim
