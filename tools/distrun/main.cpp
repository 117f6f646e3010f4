// distrun: see tools/distrun/launcher.h and `distrun --help`.

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "distrun/launcher.h"

int main(int argc, char** argv) {
  namespace launcher = distoptim::launcher;
  launcher::LaunchOptions options;
  try {
    options = launcher::parse_command_line(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const launcher::HelpRequested& help) {
    fmt::print("{}", help.what());
    return 0;
  } catch (const launcher::UsageError& e) {
    fmt::print(stderr, "distrun: {}\nRun 'distrun --help' for usage.\n", e.what());
    return launcher::kUsageExitCode;
  } catch (const std::exception& e) {
    // Not the command line's fault: its store module could not be loaded, say.
    fmt::print(stderr, "distrun: {}\n", e.what());
    return 1;
  }
  try {
    return launcher::run(options);
  } catch (const std::exception& e) {
    fmt::print(stderr, "distrun: {}\n", e.what());
    return 1;
  }
}
