#pragma once

// What every example's main() does around its work: parses the command line with CLI11 and turns
// anything that goes wrong, a bad argument or an exception while it runs, into one line on
// standard error that says what went wrong and how to run the example:
//
//   zero_memory: --layers: must be a number above 0, got '0'; run it as: /path/to/build/tools/
//   distrun/distrun --nproc-per-node 2 ./zero_memory --layers 20 --size 2000 --batch 20 (--help
//   lists every option)
//
// (one line; the launcher's path is this build tree's, the example's as it was started).
// `--help` prints the usage, with the same "run it as" line, on standard output and exits 0.
// Header-only, so each example stays one program over the public headers.

#include <cmath>
#include <cstdlib>
#include <functional>
#include <string>

#include <c10/util/Exception.h>
#include <fmt/core.h>
#include <CLI/CLI.hpp>

namespace examples {

/// The launcher's path in this build tree (set by examples/CMakeLists.txt), else its name.
inline std::string distrun() {
#ifdef DISTOPTIM_EXAMPLES_DISTRUN
  return DISTOPTIM_EXAMPLES_DISTRUN;
#else
  return "distrun";
#endif
}

/// `text` on one line: line breaks (LibTorch's messages have some) become spaces, and spaces at
/// either end go.
inline std::string one_line(std::string text) {
  for (char& c : text) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  const auto first = text.find_first_not_of(' ');
  const auto last = text.find_last_not_of(' ');
  return first == std::string::npos ? "" : text.substr(first, last - first + 1);
}

/// Validators whose errors say what is wanted ("--steps: must be a number above 0, got '-3'";
/// CLI11 2.1's PositiveNumber would print its upper bound, 1.8e308, in full). Each checks that
/// the argument is a finite number in the range.
inline CLI::Validator number_in(double low, bool low_included, double high, std::string wanted) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        char* end = nullptr;
        const double value = std::strtod(text.c_str(), &end);
        const bool number = end != text.c_str() && *end == '\0' && std::isfinite(value);
        if (number && (low_included ? value >= low : value > low) && value <= high) return "";
        return fmt::format("must be {}, got '{}'", wanted, text);
      },
      wanted);
}
inline CLI::Validator above(double low) {
  return number_in(low, false, HUGE_VAL, fmt::format("a number above {}", low));
}
inline CLI::Validator at_least(double low) {
  return number_in(low, true, HUGE_VAL, fmt::format("a number of at least {}", low));
}
inline CLI::Validator between(double low, double high) {
  return number_in(low, true, high, fmt::format("a number from {} to {}", low, high));
}

/// The example's main(): parses `argv` with `app`, then returns `body()`. `how_to_run` is the
/// command line that runs the example (with the launcher where it needs one); --help shows it.
/// A bad argument prints one line naming it and returns 2; an exception from `body` prints one
/// line with its message and returns 1. Either line ends with how to run the example.
inline int run(CLI::App& app, int argc, char** argv, const std::string& how_to_run,
               const std::function<int()>& body) {
  const std::string name = app.get_name();
  app.footer("Run it as: " + how_to_run);
  auto fail = [&](const std::string& what, int status) {
    fmt::print(stderr, "{}: {}; run it as: {} (--help lists every option)\n", name, one_line(what),
               how_to_run);
    return status;
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& help) {
    return app.exit(help);  // the usage on standard output, status 0
  } catch (const CLI::ParseError& error) {
    return fail(error.what(), 2);
  }
  try {
    return body();
  } catch (const c10::Error& error) {
    return fail(error.what_without_backtrace(), 1);
  } catch (const std::exception& error) {
    return fail(error.what(), 1);
  }
}

}  // namespace examples
