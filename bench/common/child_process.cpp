#include "child_process.h"

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>

#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <c10/util/Exception.h>

extern char** environ;

namespace distoptim {
namespace bench {

namespace {

constexpr int kForwardedSignals[] = {SIGINT, SIGTERM};
// How often the read loop looks for a signal: the handler may run on any thread (LibTorch's
// pools do not block signals), so the loop cannot count on its own read or poll being
// interrupted.
constexpr int kSignalPollMs = 100;

// The first SIGINT or SIGTERM received while a child runs, 0 if none. The handler only stores
// it; the read loop does the forwarding, outside signal context.
std::atomic<int> g_received_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free atomic");

extern "C" void record_signal(int signo) {
  int expected = 0;
  g_received_signal.compare_exchange_strong(expected, signo);
}

// Installs record_signal for SIGINT and SIGTERM (unless ignored) for its lifetime and restores
// the previous dispositions after.
class ForwardedSignals {
 public:
  ForwardedSignals() {
    g_received_signal = 0;
    for (size_t i = 0; i < std::size(kForwardedSignals); ++i) {
      struct sigaction current {};
      ::sigaction(kForwardedSignals[i], nullptr, &current);
      installed_[i] = current.sa_handler != SIG_IGN;
      if (!installed_[i]) continue;
      struct sigaction handler {};
      handler.sa_handler = record_signal;
      sigemptyset(&handler.sa_mask);
      handler.sa_flags = SA_RESTART;
      ::sigaction(kForwardedSignals[i], &handler, &previous_[i]);
    }
  }
  ~ForwardedSignals() {
    for (size_t i = 0; i < std::size(kForwardedSignals); ++i) {
      if (installed_[i]) ::sigaction(kForwardedSignals[i], &previous_[i], nullptr);
    }
  }
  ForwardedSignals(const ForwardedSignals&) = delete;
  ForwardedSignals& operator=(const ForwardedSignals&) = delete;

 private:
  bool installed_[std::size(kForwardedSignals)] = {};
  struct sigaction previous_[std::size(kForwardedSignals)] = {};
};

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// Writes all of `data`; false if the reader went away (EPIPE) or another error occurred.
bool write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

ChildResult run_child(const std::vector<std::string>& argv, const std::string& stdin_text) {
  TORCH_CHECK_VALUE(!argv.empty(), "run_child: argv is empty");
  int in_pipe[2] = {-1, -1};
  int out_pipe[2] = {-1, -1};
  TORCH_CHECK(::pipe2(in_pipe, O_CLOEXEC) == 0 && ::pipe2(out_pipe, O_CLOEXEC) == 0,
              "run_child: pipe failed: ", std::strerror(errno));

  // Installed before the child starts, so a signal that comes between its start and the read
  // loop is recorded, and forwarded once the loop runs.
  ForwardedSignals forwarded;

  // posix_spawn rather than fork: the parent runs LibTorch's thread pool, and spawn does not
  // copy its address space. The child's ends become stdin/stdout; the O_CLOEXEC originals close.
  // The child leads a new process group (pgid = its pid), made before it runs any code.
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in_pipe[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out_pipe[1], STDOUT_FILENO);
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attributes, 0);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, args[0], &actions, &attributes, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attributes);
  close_fd(in_pipe[0]);
  close_fd(out_pipe[1]);
  if (rc != 0) {
    close_fd(in_pipe[1]);
    close_fd(out_pipe[0]);
    TORCH_CHECK(false, "run_child: cannot start '", argv[0], "': ", std::strerror(rc));
  }

  // A child that exits without reading its input must not kill us with SIGPIPE.
  struct sigaction ignore {
  }, previous{};
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ignore, &previous);
  // The input is small (well under a pipe buffer), so writing it all before reading cannot
  // deadlock against a child that writes first.
  write_all(in_pipe[1], stdin_text);
  close_fd(in_pipe[1]);
  ::sigaction(SIGPIPE, &previous, nullptr);

  ChildResult result;
  char buffer[1 << 16];
  int forwarded_signal = 0;
  std::chrono::steady_clock::time_point kill_at;
  for (;;) {
    if (const int signo = g_received_signal.load(); signo != 0 && forwarded_signal == 0) {
      forwarded_signal = signo;
      ::kill(-pid, signo);
      kill_at = std::chrono::steady_clock::now() + std::chrono::seconds(kInterruptGraceSeconds);
    }
    if (forwarded_signal != 0 && std::chrono::steady_clock::now() >= kill_at) {
      // Its output no longer matters, and a straggler outside the group could hold the pipe
      // open: stop reading.
      ::kill(-pid, SIGKILL);
      break;
    }
    struct pollfd readable {
      out_pipe[0], POLLIN, 0
    };
    const int ready = ::poll(&readable, 1, kSignalPollMs);
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) continue;
    const ssize_t n = ::read(out_pipe[0], buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    result.stdout_text.append(buffer, static_cast<size_t>(n));
  }
  close_fd(out_pipe[0]);

  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    TORCH_CHECK(errno == EINTR, "run_child: waitpid failed: ", std::strerror(errno));
  }
  if (WIFEXITED(status)) {
    result.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    result.exit_code = 128 + WTERMSIG(status);
  } else {
    result.exit_code = -1;
  }

  const int signo = forwarded_signal != 0 ? forwarded_signal : g_received_signal.load();
  if (signo != 0) {
    // The child is reaped; members of its group that outlived it (they had closed their
    // output) go too. The group is empty once that fails with ESRCH.
    ::kill(-pid, SIGKILL);
    // Die of the signal, as this process would have without a child, so the shell and make
    // see an interrupted program.
    ::signal(signo, SIG_DFL);
    sigset_t unblock;
    sigemptyset(&unblock);
    sigaddset(&unblock, signo);
    ::pthread_sigmask(SIG_UNBLOCK, &unblock, nullptr);
    ::raise(signo);
  }
  return result;
}

}  // namespace bench
}  // namespace distoptim
