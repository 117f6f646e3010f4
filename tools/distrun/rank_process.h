#pragma once

// One run of a local rank as a process: starting it (fork and exec of the command with the rank's
// environment, its stdout and stderr on pipes that OutputRelay reads), signalling it, reaping
// it, and saying how it ended. A rank restarted alone has several runs, one after the other.

#include <sys/types.h>

#include <string>
#include <vector>

#include "distrun/options.h"
#include "distrun/output_relay.h"

namespace distoptim {
namespace launcher {

/// One run of a rank. Not thread-safe; the supervisor's poll loop owns every run.
struct RankProcess {
  int rank = 0;
  int local_rank = 0;
  int restart_count = 0;  // its DISTRUN_RESTART_COUNT
  bool replaced = false;  // failed and was restarted alone: a later run of the rank follows
  pid_t pid = -1;
  bool running = false;
  int status = 0;                    // as waitpid gives it, once reaped
  bool waited = false;               // reaped with a status (not a failed waitpid)
  int wait_error = 0;                // errno of the failed waitpid, when not `waited`
  std::vector<int> signals_sent;     // by distrun while it ran, in order
  std::vector<OutputRelay> outputs;  // stdout, stderr (the last 4 KiB of stderr kept as its tail)
};

/// Starts local rank `local_rank` of `options` (resolved and valid) with DISTRUN_RESTART_COUNT
/// `restart_count` and, unless `secret_file` is empty, DISTOPTIM_RPC_SECRET_FILE: the rank's
/// program is found on PATH and gets distrun's environment plus rank_environment(). Returns the
/// run, running. Throws std::system_error if a pipe or the fork fails. A program that cannot be
/// executed is no error here: its run writes why on its stderr and exits with status 127. The
/// child dies with distrun (PR_SET_PDEATHSIG).
RankProcess start_rank(const LaunchOptions& options, int local_rank, int restart_count,
                       const std::string& secret_file);

/// Sends `signo` to `run` if it is still running (not reaped: a run that has exited but is not
/// reaped yet is a zombie, so its pid cannot have been reused), and notes it in signals_sent
/// unless it is the signal sent last.
void signal_run(RankProcess& run, int signo);

/// If `run` (running) has exited, or waitpid fails for it: reaps it (running false; status and
/// waited, or wait_error), reads what is left in its pipes before returning, so that a report of
/// its end follows its last words (bounded, as its own children may still be writing), and
/// returns true. Returns false, changing nothing, while it runs. Never blocks.
bool reap_if_exited(RankProcess& run);

/// Whether `run` is running and has not exited yet (asked without reaping it).
bool still_running(const RankProcess& run);

/// How a reaped run ended: "exited with status 3", "killed by signal SIGTERM", "could not be
/// waited for".
std::string how_ended(const RankProcess& run);

/// distrun's line on stderr for a reaped run that failed (exited non-zero, was killed, or could
/// not be waited for): "distrun: rank 1 (pid 42) exited with status 3\n", "... was killed by
/// signal SIGTERM\n", "... cannot be waited for: No child processes\n".
std::string failure_notice(const RankProcess& run);

}  // namespace launcher
}  // namespace distoptim
