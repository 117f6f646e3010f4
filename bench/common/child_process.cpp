#include "child_process.h"

#include <cerrno>
#include <csignal>
#include <cstring>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <c10/util/Exception.h>

extern char** environ;

namespace distoptim {
namespace bench {

namespace {

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

  // posix_spawn rather than fork: the parent runs LibTorch's thread pool, and spawn does not
  // copy its address space. The child's ends become stdin/stdout; the O_CLOEXEC originals close.
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in_pipe[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out_pipe[1], STDOUT_FILENO);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
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
  for (;;) {
    ssize_t n = ::read(out_pipe[0], buffer, sizeof(buffer));
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
  return result;
}

}  // namespace bench
}  // namespace distoptim
