#pragma once

// Running a command from a test, most often the reference (PyTorch under the system Python).

#include <string>

namespace distoptim {
namespace testing {

/// `s` as one word for /bin/sh.
std::string shell_quote(const std::string& s);

struct CommandResult {
  /// True when the command exited with status 0.
  bool ok = false;
  /// Its stdout and stderr, interleaved; when !ok, preceded by the command and its status.
  std::string output;
};

/// Runs `command` through /bin/sh and waits for it, capturing stdout and stderr together.
CommandResult run_command(const std::string& command);

}  // namespace testing
}  // namespace distoptim
