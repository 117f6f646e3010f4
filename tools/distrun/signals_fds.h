#pragma once

// distrun's file descriptors and signals: owned descriptors and pipes, writing whole buffers,
// and the self-pipe that turns SIGINT, SIGTERM and SIGCHLD into bytes for the poll loop.

#include <signal.h>
#include <unistd.h>

#include <cstddef>
#include <iterator>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace distoptim {
namespace launcher {

// errno `err` as an exception saying what failed.
std::system_error errno_error(int err, const std::string& what);

// Owns a file descriptor; closes it on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

struct Pipe {
  Fd read;
  Fd write;
};

// Both ends close on exec (a rank gets its own write end as stdout or stderr through dup2, which
// clears the flag); the read end is non-blocking, for the poll loop.
Pipe make_pipe();

// Writes all of [data, data + size) to `fd`, waiting while a non-blocking `fd` is full. Gives up
// quietly when the reader is gone (EPIPE): the ranks are supervised all the same.
void write_all(int fd, const char* data, size_t size);
void write_all(int fd, const std::string& s);

// A child's setup must not depend on distrun's descriptors 0-2 being open: a closed one would be
// reused by pipe2 and then clobbered by dup2.
void ensure_standard_fds_open();

// "SIGTERM" for SIGTERM; the number for a signal without a name.
std::string signal_name(int signo);

// The signals SignalPipe handles.
constexpr int kHandledSignals[] = {SIGINT, SIGTERM, SIGCHLD};

// The self-pipe that turns SIGINT, SIGTERM and SIGCHLD into readable bytes for the poll loop.
// Installs the handlers (and ignores SIGPIPE, so a closed stdout cannot kill distrun while it
// supervises ranks) for its lifetime and restores the previous dispositions on destruction.
// One instance at a time (the handler reads a global).
class SignalPipe {
 public:
  SignalPipe();
  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;
  ~SignalPipe();

  int read_fd() const { return read_.get(); }

  // The signals received since the last call, in order.
  std::vector<int> take();

 private:
  Fd read_;
  Fd write_;
  struct sigaction previous_[std::size(kHandledSignals)]{};
  struct sigaction previous_sigpipe_ {};
};

// Resets in a forked child, before it execs, the dispositions distrun changed: a handled signal
// arriving before exec must not run distrun's handler (it would write to distrun's self-pipe),
// and an ignored SIGPIPE would survive exec.
void restore_default_signals();

}  // namespace launcher
}  // namespace distoptim
