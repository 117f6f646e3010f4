#pragma once

// Multi-rank tests as real processes (the pattern of Gloo's multiproc tests).
//
//   TEST(Comm, Allreduce) {
//     distoptim::testing::run_ranks(3, [](int rank, int world_size) { ... gtest assertions ... });
//   }
//
// The test process starts one process per rank, with RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT set, which runs the body and
// exits (status 1 when an assertion failed or the body threw). In a build without sanitizers,
// while the test process has a single thread (besides OpenBLAS's), it forks the ranks (LibTorch is
// then loaded and initialized once per test, not once per rank); otherwise (multiprocess.cpp says
// why), or with DISTOPTIM_TEST_RANKS=exec, it re-runs its own executable per rank, filtered to
// the current test (under the sanitizers, as a fork of the rank zygote: rank_zygote.h), where
// run_ranks calls the body (and the rest of the test body runs too: code after run_ranks that
// only the test process should run checks in_rank_process()). The parent
// supervises the ranks: the first rank to fail (non-zero exit, signal) makes it kill the others
// and fail the test at once with that rank's output, and ranks still running at the deadline are
// killed and named. Nothing hangs. Where the ranks would be started afresh, rank 0's body runs in
// the test process itself (RunRanksOptions::rank0_in_test_process).

#include <chrono>
#include <functional>
#include <map>
#include <set>
#include <string>

namespace distoptim {
namespace testing {

struct RunRanksOptions {
  std::chrono::seconds deadline{60};
  /// Exit statuses expected of some ranks (a rank that kills itself on purpose, say), by rank.
  /// Every other rank must exit 0.
  std::map<int, int> expected_exit_codes;
  /// Ranks that end killed by a signal on purpose (one that sends itself SIGKILL, say), by rank:
  /// the signal expected.
  std::map<int, int> expected_signals;
  /// Rank 0's body runs in the test process itself (its variables set meanwhile) while a thread
  /// supervises the others, where the ranks are started afresh (the sanitizer builds): one
  /// process start fewer per call, ~2 s of CPU under the sanitizers. What the exit of its own
  /// process would have ended is ended after the body (at_end_of_rank0_here), and the environment
  /// is put back as it was. Set false for a rank 0 that changes its process for good (its user,
  /// a limit, malloc's settings) or measures it (resident memory, threads); a rank 0 with an
  /// expected exit code or signal is started as the others are anyway, and so is every rank 0
  /// with DISTOPTIM_TEST_RANK0=own-process.
  bool rank0_in_test_process = true;
};

/// Runs `body(rank, world_size)` in `world_size` processes; see the file comment.
void run_ranks(int world_size, const std::function<void(int rank, int world_size)>& body,
               const RunRanksOptions& options = {});

/// Registers `cleanup` to run in the test process after each body of rank 0 run there
/// (RunRanksOptions::rank0_in_test_process), whether it passed or not: what a rank's process
/// would have ended by exiting. The harness itself destroys the default process group
/// (comm::destroy_process_group) after the last of them; harness/rpc_cleanup.h stops a running
/// rpc agent. They run in the reverse order of registration, as atexit's; what one throws fails
/// the test. Register before the test runs (from a static initializer).
void at_end_of_rank0_here(std::function<void()> cleanup);

/// True inside a rank's process.
bool in_rank_process();

/// A TCP port on 127.0.0.1 that was free a moment ago.
int free_port();

/// The state letter of process `pid` in /proc/<pid>/stat ('T' stopped, 'Z' zombie, ...), or '?'
/// when there is no such process.
char process_state(int pid);

/// Polls (every 10 ms, at most `limit`) until process `pid` is in one of `states` (letters as
/// process_state's); false when it never was.
bool wait_for_process_state(int pid, const std::string& states, std::chrono::milliseconds limit);

/// Sends SIGSTOP to process `pid` and waits (at most `limit`) until every thread of it is
/// stopped, so that nothing it was about to do runs after this returns; false when one never was.
bool stop_process(int pid, std::chrono::milliseconds limit = std::chrono::seconds(10));

/// The ids of this process's threads (/proc/self/task).
std::set<int> thread_ids();

/// The number of this process's threads.
int thread_count();

/// Polls (every 10 ms, at most `limit`) until every thread of this process is one of `before`
/// (thread_ids() taken earlier) and returns the ids of those that are not: empty once every
/// thread started since has ended. Threads of `before` that ended meanwhile do not count, so a
/// thread someone else left running while it exits cannot make the answer wrong.
std::set<int> threads_started_since(const std::set<int>& before,
                                    std::chrono::milliseconds limit = std::chrono::seconds(5));

}  // namespace testing
}  // namespace distoptim
