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
ChildResult run_child(const std::vector<std::string>& argv, const std::string& stdin_text);

}  // namespace bench
}  // namespace distoptim
