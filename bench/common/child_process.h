#pragma once

#include <string>
#include <vector>

namespace distoptim {
namespace bench {

/// What a finished child process left: its exit code (128 + signal number if a signal ended it)
/// and everything it wrote to standard output.
struct ChildResult {
  int exit_code = 0;
  std::string stdout_text;
};

/// Runs `argv[0]` (a path; PATH is not searched) with arguments `argv`, writes `stdin_text` to its
/// standard input and closes it, and collects its standard output until it exits. Standard error
/// is inherited, so the child's messages reach the terminal. Blocks until the child exits.
/// Throws c10::Error naming the program if it cannot be started.
///
/// The child leads a process group of its own, which its descendants share unless they leave it
/// (distrun's ranks and Python's spawned workers stay; timeout(1) leads it as it would anyway).
/// While the child runs, SIGINT and SIGTERM sent to this process (Ctrl-C reaches only the
/// terminal's foreground group, which the child is not in) are forwarded to that whole group;
/// whatever of the group is still there kInterruptGraceSeconds later gets SIGKILL. Once the child
/// has been reaped, this process then dies of the signal it got, as it would have without a
/// child. A signal whose disposition was SIG_IGN when run_child began (a job started with `&` by
/// a shell without job control) stays ignored. One run_child at a time per process.
ChildResult run_child(const std::vector<std::string>& argv, const std::string& stdin_text);

/// How long an interrupted child's process group has between the forwarded signal and SIGKILL.
constexpr int kInterruptGraceSeconds = 5;

}  // namespace bench
}  // namespace distoptim
