#include "harness/reference_run.h"

#include <stdlib.h>

#include <stdexcept>

namespace distoptim {
namespace testing {

CommandResult run_reference(const std::string& python, const std::string& script,
                            const std::string& variable, const std::string& extra_args) {
  char dir_template[] = "/tmp/distoptim-reference-XXXXXX";
  if (::mkdtemp(dir_template) == nullptr) {
    return {false, "cannot make a directory under /tmp for the reference's output"};
  }
  ::setenv(variable.c_str(), dir_template, 1);
  return run_command("timeout 150 " + shell_quote(python) + " " + shell_quote(script) + " --out " +
                     shell_quote(dir_template) + (extra_args.empty() ? "" : " " + extra_args));
}

std::filesystem::path reference_dir(const std::string& variable) {
  const char* dir = std::getenv(variable.c_str());
  if (dir == nullptr) throw std::runtime_error(variable + " is not set: the reference did not run");
  return dir;
}

void remove_reference(const std::string& variable) {
  const char* dir = std::getenv(variable.c_str());
  if (dir == nullptr) return;
  std::filesystem::remove_all(dir);
  ::unsetenv(variable.c_str());
}

}  // namespace testing
}  // namespace distoptim
