#pragma once

// A rank process started afresh under the sanitizers spends about 2 s of CPU before the test's
// first line: mapping LibTorch's ~320 libraries, relocating them and running their static
// initializers under the sanitizer's allocator. The rank zygote pays that once per test binary.
// The test binary's main (test_main.cpp) forks it first thing, while the process has one thread
// and has done nothing but load. For each rank it forks again, and the copy runs the test binary's
// main afresh with the rank's arguments, environment and log, as an executed copy would; a fork
// of so small a process costs about a tenth of a second of CPU. A fork of the test process
// itself would copy everything it has touched since, page by page as either writes.
//
// Only where multiprocess.cpp would start ranks afresh (the sanitizer builds), and never with
// DISTOPTIM_TEST_RANKS=exec. A rank whose environment differs from the test binary's at start in
// anything but the harness's rank variables and DISTOPTIM_* is started afresh: the C library,
// the sanitizers, OpenMP and OpenBLAS read theirs once, at start.

#include <sys/types.h>

#include <string>
#include <vector>

namespace distoptim {
namespace testing {

/// Set in a rank's environment: the rank's own process runs the body (multiprocess.cpp).
inline constexpr const char* kRankProcessVariable = "DISTOPTIM_TEST_RANK_PROCESS";
/// The launcher's variables a rank is given (multiprocess.cpp), which it reads as it runs.
inline constexpr const char* kLauncherVariables[] = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"};

/// From main, before anything else: forks the zygote where it serves (see the file comment).
void start_rank_zygote();

/// Starts a rank process from the zygote: it runs the test binary's main with `argv`, in the
/// environment `env` ("NAME=value" entries), its output (stdout and stderr) to `log_path`. The
/// process is a child of this one (waitpid works). Returns -1 where the zygote does not serve
/// this rank (none runs, or `env` differs from the start's in a variable read at start): the
/// caller then starts it afresh.
pid_t start_from_rank_zygote(const std::vector<std::string>& argv,
                             const std::vector<std::string>& env, const std::string& log_path);

/// What the test binary's main runs: GoogleTest over `argv`; returns its exit status.
int run_all_tests(int argc, char** argv);

}  // namespace testing
}  // namespace distoptim
