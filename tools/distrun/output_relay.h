#pragma once

// Relaying a rank's output to distrun's own, line by line, with the rank's prefix.

#include <string>
#include <utility>

#include "distrun/signals_fds.h"

namespace distoptim {
namespace launcher {

// One output stream of one rank: reads its pipe and writes each line to `out_fd` as
// `prefix + line + "\n"`. All the lines of one read go out in one write_all, and distrun is
// single-threaded, so a line of one rank is never split by another's. A line longer than
// 64 KiB (kMaxLineBytes) goes out in pieces of that size (each a line of its own), which bounds the
// buffer; a partial line at end of file goes out with a newline added.
class OutputRelay {
 public:
  OutputRelay(Fd pipe, std::string prefix, int out_fd)
      : pipe_(std::move(pipe)), prefix_(std::move(prefix)), out_fd_(out_fd) {}

  int fd() const { return pipe_.get(); }
  bool open() const { return pipe_.valid(); }

  // Reads at most `max_reads` times, stopping early when the pipe is empty, and writes out the
  // complete lines. Closes the pipe at end of file (or on a read error).
  void read_available(int max_reads);

  // Writes out everything buffered, a partial line too, and closes the pipe.
  void close();

  // From now on, keep the last `bytes` (about) of what was written out, without the prefix: the
  // supervisor reads a failed rank's last words for the ranks its error names.
  void keep_tail(size_t bytes) { tail_limit_ = bytes; }
  const std::string& tail() const { return tail_; }

 private:
  void flush(bool at_eof);

  Fd pipe_;
  std::string prefix_;
  int out_fd_;
  std::string pending_;
  size_t tail_limit_ = 0;
  std::string tail_;
};

}  // namespace launcher
}  // namespace distoptim
