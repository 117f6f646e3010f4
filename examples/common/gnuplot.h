#pragma once

// Draws a PNG with gnuplot for the examples that plot their curves, and says honestly whether it
// did: a PNG is claimed only when gnuplot exited with 0 and the file is there, not empty.
// Header-only, as example_main.h.

#include <signal.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

#include <fmt/core.h>

namespace examples {

/// Runs gnuplot on `commands` (everything after the terminal and output lines, which this
/// writes) to draw `png`, 900 pixels wide and `height` high. Returns an empty string if `png` was
/// written, else why not.
inline std::string plot_png(const std::string& commands, const std::filesystem::path& png,
                            int height = 500) {
  namespace fs = std::filesystem;
  std::error_code ignored;
  fs::remove(png, ignored);  // a PNG from an earlier run must not pass for this one's
  const std::string script = fmt::format("set terminal png size 900,{}\nset output '{}'\n{}",
                                         height, png.string(), commands);
  // A gnuplot that exits before reading its input must not kill this process with SIGPIPE: its
  // exit status says what happened.
  struct sigaction ignore = {};
  struct sigaction previous = {};
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ignore, &previous);
  // The shell exits with 127 when gnuplot is not on PATH. gnuplot's own complaints go to our
  // standard error.
  FILE* gnuplot = ::popen("command -v gnuplot >/dev/null || exit 127; exec gnuplot", "w");
  int status = -1;
  std::string error;
  if (gnuplot == nullptr) {
    error = fmt::format("cannot start a shell for gnuplot: {}", std::strerror(errno));
  } else {
    std::fwrite(script.data(), 1, script.size(), gnuplot);
    status = ::pclose(gnuplot);
    if (status == -1) error = fmt::format("waiting for gnuplot failed: {}", std::strerror(errno));
  }
  ::sigaction(SIGPIPE, &previous, nullptr);
  if (!error.empty()) return error;
  if (WIFSIGNALED(status)) return fmt::format("gnuplot was killed by signal {}", WTERMSIG(status));
  if (WEXITSTATUS(status) == 127) return "gnuplot is not installed (not found on PATH)";
  if (WEXITSTATUS(status) != 0)
    return fmt::format("gnuplot exited with status {}", WEXITSTATUS(status));
  if (!fs::exists(png, ignored)) return "gnuplot exited with status 0 but wrote no file";
  if (fs::file_size(png, ignored) == 0)
    return "gnuplot exited with status 0 but left the file empty";
  return "";
}

/// Plots `png` (plot_png with `commands`) from `csv`, which the caller has written, and prints
/// one line that says what was written: "wrote CSV and PNG", or "wrote CSV; the plot PNG was not
/// written: why".
inline void plot_and_report(const std::string& commands, const std::filesystem::path& csv,
                            const std::filesystem::path& png, int height = 500) {
  namespace fs = std::filesystem;
  const std::string error = plot_png(commands, png, height);
  if (error.empty()) {
    fmt::print("wrote {} and {}\n", fs::absolute(csv).string(), fs::absolute(png).string());
  } else {
    fmt::print("wrote {}; the plot {} was not written: {}\n", fs::absolute(csv).string(),
               fs::absolute(png).string(), error);
  }
}

}  // namespace examples
