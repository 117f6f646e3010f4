#include "distrun/signals_fds.h"

#include <fcntl.h>
#include <poll.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace distoptim {
namespace launcher {
namespace {

// The self-pipe's write end, for the signal handler; set while a SignalPipe exists.
int signal_pipe_write_fd = -1;

extern "C" void write_signal_to_pipe(int signo) {
  // Async-signal-safe only: one write. A full pipe drops the byte, which is harmless: the loop
  // already has a byte to wake up for, and SIGCHLD is handled by polling every child anyway.
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(signo);
  if (::write(signal_pipe_write_fd, &byte, 1) < 0) {
  }
  errno = saved_errno;
}

}  // namespace

std::system_error errno_error(int err, const std::string& what) {
  return std::system_error(err, std::generic_category(), what);
}

Pipe make_pipe() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw errno_error(errno, "pipe2");
  Pipe pipe{Fd(fds[0]), Fd(fds[1])};
  if (::fcntl(pipe.read.get(), F_SETFL, ::fcntl(pipe.read.get(), F_GETFL) | O_NONBLOCK) != 0) {
    throw errno_error(errno, "fcntl(O_NONBLOCK)");
  }
  return pipe;
}

void write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n >= 0) {
      data += n;
      size -= static_cast<size_t>(n);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, -1);
    } else if (errno != EINTR) {
      return;
    }
  }
}

void write_all(int fd, const std::string& s) { write_all(fd, s.data(), s.size()); }

void ensure_standard_fds_open() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) < 0 && errno == EBADF) {
      const int null_fd = ::open("/dev/null", O_RDWR);  // the lowest free descriptor: `fd`
      if (null_fd >= 0 && null_fd != fd) ::close(null_fd);
    }
  }
}

std::string signal_name(int signo) {
  const char* abbrev = ::sigabbrev_np(signo);
  return abbrev != nullptr ? fmt::format("SIG{}", abbrev) : std::to_string(signo);
}

SignalPipe::SignalPipe() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) throw errno_error(errno, "pipe2");
  read_ = Fd(fds[0]);
  write_ = Fd(fds[1]);
  signal_pipe_write_fd = write_.get();
  struct sigaction action {};
  action.sa_handler = write_signal_to_pipe;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  for (size_t i = 0; i < std::size(kHandledSignals); ++i) {
    ::sigaction(kHandledSignals[i], &action, &previous_[i]);
  }
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ::sigaction(SIGPIPE, &ignore, &previous_sigpipe_);
}

SignalPipe::~SignalPipe() {
  for (size_t i = 0; i < std::size(kHandledSignals); ++i) {
    ::sigaction(kHandledSignals[i], &previous_[i], nullptr);
  }
  ::sigaction(SIGPIPE, &previous_sigpipe_, nullptr);
  signal_pipe_write_fd = -1;
}

std::vector<int> SignalPipe::take() {
  std::vector<int> signals;
  unsigned char bytes[64];
  ssize_t n;
  while ((n = ::read(read_.get(), bytes, sizeof bytes)) > 0 || (n < 0 && errno == EINTR)) {
    for (ssize_t i = 0; i < n; ++i) signals.push_back(bytes[i]);
  }
  return signals;
}

void restore_default_signals() {
  struct sigaction action {};
  action.sa_handler = SIG_DFL;
  sigemptyset(&action.sa_mask);
  for (int signo : kHandledSignals) ::sigaction(signo, &action, nullptr);
  ::sigaction(SIGPIPE, &action, nullptr);
}

}  // namespace launcher
}  // namespace distoptim
