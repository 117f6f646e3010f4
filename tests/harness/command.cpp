#include "command.h"

#include <sys/wait.h>

#include <cstdio>

namespace distoptim {
namespace testing {

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char ch : s) {
    if (ch == '\'') {
      out += "'\\''";
    } else {
      out += ch;
    }
  }
  return out + "'";
}

CommandResult run_command(const std::string& command) {
  CommandResult result;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) {
    result.output = "popen failed for: " + command;
    return result;
  }
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) result.output.append(buffer, n);
  const int status = pclose(pipe);
  result.ok = status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (!result.ok) {
    result.output =
        "command failed (status " + std::to_string(status) + "): " + command + "\n" + result.output;
  }
  return result;
}

}  // namespace testing
}  // namespace distoptim
