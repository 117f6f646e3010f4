#include "rank_zygote.h"
#include "support/sanitizers.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>

#include <gtest/gtest.h>

extern char** environ;

namespace distoptim {
namespace testing {
namespace {

// The test process's end of the socket to the zygote; -1 when none runs.
int zygote_socket = -1;
// The environment at start, as the zygote has it.
std::map<std::string, std::string> start_environment;
std::mutex zygote_mutex;

std::map<std::string, std::string> parse_environment(const std::vector<std::string>& entries) {
  std::map<std::string, std::string> variables;
  for (const std::string& entry : entries) {
    const size_t equals = entry.find('=');
    if (equals != std::string::npos) variables[entry.substr(0, equals)] = entry.substr(equals + 1);
  }
  return variables;
}

// Variables a process reads as it runs, not only at start: a rank may differ in them from the
// zygote. The harness's own, the launcher's a rank is given, and the library's.
bool read_while_running(const std::string& name) {
  for (const char* launcher : kLauncherVariables) {
    if (name == launcher) return true;
  }
  return name.rfind("DISTOPTIM_", 0) == 0;
}

// Writes to a socket (whose closed peer raises no SIGPIPE here) or a pipe.
bool write_all(int fd, const void* data, size_t size) {
  const char* bytes = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t written = ::send(fd, bytes, size, MSG_NOSIGNAL);
    if (written < 0 && errno == ENOTSOCK) written = ::write(fd, bytes, size);
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) return false;
    bytes += written;
    size -= static_cast<size_t>(written);
  }
  return true;
}

bool read_all(int fd, void* data, size_t size) {
  char* bytes = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t got = ::read(fd, bytes, size);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    bytes += got;
    size -= static_cast<size_t>(got);
  }
  return true;
}

// A request is a count of strings, then each as its length and bytes.
bool write_strings(int fd, const std::vector<std::string>& strings) {
  std::string frame;
  const auto put = [&frame](uint32_t value) {
    frame.append(reinterpret_cast<const char*>(&value), sizeof(value));
  };
  put(static_cast<uint32_t>(strings.size()));
  for (const std::string& s : strings) {
    put(static_cast<uint32_t>(s.size()));
    frame += s;
  }
  return write_all(fd, frame.data(), frame.size());
}

bool read_strings(int fd, std::vector<std::string>& strings) {
  uint32_t count = 0;
  if (!read_all(fd, &count, sizeof(count))) return false;
  strings.assign(count, std::string());
  for (std::string& s : strings) {
    uint32_t size = 0;
    if (!read_all(fd, &size, sizeof(size))) return false;
    s.resize(size);
    if (size > 0 && !read_all(fd, s.data(), size)) return false;
  }
  return true;
}

// In the zygote's copy: becomes the rank the request describes (cwd, log, argv count, argv...,
// environment...) and runs the test binary's main. Never returns.
[[noreturn]] void become_rank(std::vector<std::string>& request) {
  if (::chdir(request[0].c_str()) != 0) std::_Exit(125);
  const int log = ::open(request[1].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (log < 0) std::_Exit(125);
  ::dup2(log, STDOUT_FILENO);
  ::dup2(log, STDERR_FILENO);
  ::close(log);
  const size_t argc = std::stoul(request[2]);
  std::vector<char*> argv;
  for (size_t i = 0; i < argc; ++i) argv.push_back(request[3 + i].data());
  argv.push_back(nullptr);
  ::clearenv();
  for (size_t i = 3 + argc; i < request.size(); ++i) ::putenv(request[i].data());
  int count = static_cast<int>(argc);
  std::exit(run_all_tests(count, argv.data()));
}

// The zygote: for each request, a copy of itself that becomes the rank. The copy is made through
// a middle process that exits at once, so that the rank becomes a child of the test process,
// which is a subreaper meanwhile (start_from_rank_zygote). Ends when the test process does.
[[noreturn]] void serve(int socket, pid_t test_process) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != test_process) std::_Exit(0);
  for (;;) {
    std::vector<std::string> request;
    if (!read_strings(socket, request) || request.size() < 3) std::_Exit(0);
    int pid_pipe[2];
    pid_t rank = -1;
    if (::pipe(pid_pipe) == 0) {
      const pid_t middle = ::fork();
      if (middle == 0) {
        ::prctl(PR_SET_PDEATHSIG, 0);
        const pid_t child = ::fork();
        if (child == 0) {
          ::close(pid_pipe[0]);
          ::close(pid_pipe[1]);
          ::close(socket);
          become_rank(request);
        }
        write_all(pid_pipe[1], &child, sizeof(child));
        std::_Exit(0);
      }
      ::close(pid_pipe[1]);
      if (middle < 0 || !read_all(pid_pipe[0], &rank, sizeof(rank))) rank = -1;
      ::close(pid_pipe[0]);
      if (middle > 0) ::waitpid(middle, nullptr, 0);
    }
    if (!write_all(socket, &rank, sizeof(rank))) std::_Exit(0);
  }
}

}  // namespace

void start_rank_zygote() {
#if DISTOPTIM_UNDER_ASAN || DISTOPTIM_UNDER_TSAN
  const char* mode = std::getenv("DISTOPTIM_TEST_RANKS");
  if (mode != nullptr && std::string(mode) == "exec") return;
  // A rank's own process starts no zygote: it starts no ranks.
  if (std::getenv(kRankProcessVariable) != nullptr) return;
  int sockets[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sockets) != 0) return;
  std::vector<std::string> entries;
  for (char** e = environ; *e != nullptr; ++e) entries.emplace_back(*e);
  start_environment = parse_environment(entries);
  const pid_t test_process = ::getpid();
  const pid_t zygote = ::fork();
  if (zygote == 0) {
    ::close(sockets[0]);
    serve(sockets[1], test_process);
  }
  ::close(sockets[1]);
  if (zygote < 0) {
    ::close(sockets[0]);
    return;
  }
  zygote_socket = sockets[0];
#endif
}

pid_t start_from_rank_zygote(const std::vector<std::string>& argv,
                             const std::vector<std::string>& env, const std::string& log_path) {
  std::lock_guard<std::mutex> lock(zygote_mutex);
  if (zygote_socket < 0) return -1;
  // Every variable read at start must be as the zygote has it.
  const auto wanted = parse_environment(env);
  const auto all_in = [](const std::map<std::string, std::string>& these,
                         const std::map<std::string, std::string>& those) {
    for (const auto& [name, value] : these) {
      if (read_while_running(name)) continue;
      const auto found = those.find(name);
      if (found == those.end() || found->second != value) return false;
    }
    return true;
  };
  if (!all_in(wanted, start_environment) || !all_in(start_environment, wanted)) return -1;
  std::vector<std::string> request{std::filesystem::current_path().string(), log_path,
                                   std::to_string(argv.size())};
  request.insert(request.end(), argv.begin(), argv.end());
  request.insert(request.end(), env.begin(), env.end());
  // The rank is the zygote's grandchild until its middle process exits; as a subreaper meanwhile
  // this process becomes its parent then.
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  pid_t rank = -1;
  pollfd ready{zygote_socket, POLLIN, 0};
  if (!write_strings(zygote_socket, request) || ::poll(&ready, 1, 60000) != 1 ||
      !read_all(zygote_socket, &rank, sizeof(rank))) {
    ::close(zygote_socket);
    zygote_socket = -1;
    rank = -1;
  }
  ::prctl(PR_SET_CHILD_SUBREAPER, 0);
  return rank;
}

int run_all_tests(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

}  // namespace testing
}  // namespace distoptim
