#include "multiprocess.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <distoptim/comm/process_group.h>

#include "rank_zygote.h"
#include "support/sanitizers.h"
#include "support/scoped_env.h"

extern char** environ;

namespace distoptim {
namespace testing {

namespace {

// Set in a rank's environment: the rank's own process runs the body instead of supervising.
constexpr const char* kChildVariable = kRankProcessVariable;
// The folder of a started rank's log, where it says it has started (start_together).
constexpr const char* kRanksDirVariable = "DISTOPTIM_TEST_RANKS_DIR";

struct Rank {
  pid_t pid = -1;
  std::string log_path;
  bool done = false;
  int status = 0;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return std::string("was killed by signal ") + strsignal(WTERMSIG(status));
  return "stopped";
}

// The variables a rank's process gets (besides kChildVariable), as "NAME=value".
std::vector<std::string> rank_variables(int rank, int world_size, int port) {
  return {"RANK=" + std::to_string(rank),
          "WORLD_SIZE=" + std::to_string(world_size),
          "LOCAL_RANK=" + std::to_string(rank),
          "LOCAL_WORLD_SIZE=" + std::to_string(world_size),
          "MASTER_ADDR=127.0.0.1",
          "MASTER_PORT=" + std::to_string(port)};
}

// The threads OpenBLAS starts when it is loaded (its pool less the calling thread), or 0 when
// LibTorch's BLAS is not OpenBLAS. OpenBLAS stops them before a fork (pthread_atfork) and starts
// them again when next needed, so they do not make a fork unsafe.
int openblas_pool_threads() {
  using GetNumThreads = int (*)();
  const auto get =
      reinterpret_cast<GetNumThreads>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return get == nullptr ? 0 : std::max(get() - 1, 0);
}

// Whether the ranks may be forked from this process rather than started afresh: a process whose
// only threads are the main one and OpenBLAS's forks into a sound copy (LibTorch loaded and
// initialized once, not once per rank); one with other threads would leave the copies with locks
// held by threads that do not exist there. DISTOPTIM_TEST_RANKS=exec starts every rank afresh.
//
// Under the sanitizers the test process is never forked: a forked rank copies, page by page as it
// writes them, the shadow pages its parent filled since it started, and where a page copy costs
// a TLB shootdown (virtual machines) that costs more than loading LibTorch again. Measured on a
// 2-core virtual machine, A/B alternated: five ZeRO tests under ASan took 50 s of CPU forked, 40
// s started afresh; the Rpc suite under ThreadSanitizer 285 s and 240 s. Ranks are forked from
// the rank zygote there instead (rank_zygote.h), which has touched next to nothing.
bool may_fork_ranks() {
  const char* mode = std::getenv("DISTOPTIM_TEST_RANKS");
  if (mode != nullptr && std::string(mode) == "exec") return false;
#if DISTOPTIM_UNDER_ASAN || DISTOPTIM_UNDER_TSAN
  return false;
#endif
  return thread_count() <= 1 + openblas_pool_threads();
}

// Forks a rank's process: it runs `body` with the rank's variables set and its output going to
// `log_path`, then exits with status 1 when `body` failed an assertion or threw, 0 otherwise.
pid_t fork_rank(int call, int rank, int world_size, int port, const std::string& log_path,
                const std::function<void(int, int)>& body) {
  const ::testing::TestResult* result =
      ::testing::UnitTest::GetInstance()->current_test_info()->result();
  const int parts_before = result->total_part_count();
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid != 0) return pid;

  const int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (log < 0) std::_Exit(125);
  ::dup2(log, STDOUT_FILENO);
  ::dup2(log, STDERR_FILENO);
  ::close(log);
  ::setenv(kChildVariable, std::to_string(call).c_str(), 1);
  for (const std::string& variable : rank_variables(rank, world_size, port)) {
    const size_t equals = variable.find('=');
    ::setenv(variable.substr(0, equals).c_str(), variable.substr(equals + 1).c_str(), 1);
  }
  bool failed = false;
  try {
    body(rank, world_size);
  } catch (const std::exception& e) {
    std::cout << "rank " << rank << ": C++ exception with description \"" << e.what()
              << "\" thrown in the rank's body." << std::endl;
    failed = true;
  } catch (...) {
    std::cout << "rank " << rank << ": unknown C++ exception thrown in the rank's body."
              << std::endl;
    failed = true;
  }
  for (int i = parts_before; i < result->total_part_count(); ++i) {
    if (result->GetTestPartResult(i).failed()) failed = true;
  }
  std::cout.flush();
  // exit, not _Exit: the process ends as a started rank's does (test_main.cpp's
  // end_rank_process: the binary's static destructors and exit handlers, and the LeakSanitizer's
  // check in sanitizer builds).
  std::exit(failed ? 1 : 0);
}

pid_t spawn_rank(int call, int rank, int world_size, int port, const std::string& filter,
                 const std::string& log_path) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    // The launcher's variables of an enclosing job must not leak into the ranks.
    const auto named = [&entry](const char* name) {
      return entry.rfind(std::string(name) + "=", 0) == 0;
    };
    bool ours = named(kChildVariable) || named(kRanksDirVariable);
    for (const char* name : kLauncherVariables) ours = ours || named(name);
    if (!ours) env_strings.push_back(entry);
  }
  env_strings.push_back(std::string(kChildVariable) + "=" + std::to_string(call));
  env_strings.push_back(std::string(kRanksDirVariable) + "=" +
                        std::filesystem::path(log_path).parent_path().string());
  for (std::string& variable : rank_variables(rank, world_size, port)) {
    env_strings.push_back(std::move(variable));
  }
  std::string exe = "/proc/self/exe";
  std::string filter_arg = "--gtest_filter=" + filter;
  const pid_t from_zygote = start_from_rank_zygote({exe, filter_arg}, env_strings, log_path);
  if (from_zygote > 0) return from_zygote;

  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<char*> argv = {exe.data(), filter_arg.data(), nullptr};

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid = -1;
  const int error = posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (error != 0) return -1;
  return pid;
}

// The file in which started rank `rank` says it has started.
std::string started_path(const std::string& dir, int rank) {
  return dir + "/started" + std::to_string(rank);
}

// In a started rank: says it has started, then waits (at most 120 s; the parent's deadline bounds
// the test) until every rank has, so that the bodies begin together as forked ones do. Processes
// started afresh take seconds to load LibTorch under the sanitizers, and unevenly on a busy
// machine: a test whose rendezvous timeout is a few seconds would otherwise see a rank missing.
void start_together(const std::string& dir, int rank, int world_size) {
  std::ofstream(started_path(dir, rank)).put('1');
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  for (int other = 0; other < world_size; ++other) {
    while (!std::filesystem::exists(started_path(dir, other)) &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
}

void kill_all(std::vector<Rank>& ranks) {
  for (auto& r : ranks) {
    if (!r.done && r.pid > 0) ::kill(r.pid, SIGKILL);
  }
  for (auto& r : ranks) {
    if (!r.done && r.pid > 0) {
      ::waitpid(r.pid, &r.status, 0);
      r.done = true;
    }
  }
}

// What at_end_of_rank0_here registered, after the harness's own: the default process group,
// destroyed last.
std::vector<std::function<void()>>& rank0_cleanups() {
  static std::vector<std::function<void()>> cleanups{[] {
    if (comm::is_initialized()) comm::destroy_process_group();
  }};
  return cleanups;
}

}  // namespace

bool in_rank_process() { return std::getenv(kChildVariable) != nullptr; }

void at_end_of_rank0_here(std::function<void()> cleanup) {
  rank0_cleanups().push_back(std::move(cleanup));
}

namespace {
// The number of the run_ranks call within the current test: a rank process runs the body of the
// call it was started for and skips the test's other calls.
int next_call_of_test(const std::string& test) {
  static std::string current;
  static int calls = 0;
  if (test != current) {
    current = test;
    calls = 0;
  }
  return calls++;
}
}  // namespace

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

char process_state(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return '?';
  // "pid (command) S ...": the command may hold spaces and parentheses, the state follows the last.
  const size_t close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() ? '?' : line[close + 2];
}

bool wait_for_process_state(int pid, const std::string& states, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (states.find(process_state(pid)) == std::string::npos) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

bool stop_process(int pid, std::chrono::milliseconds limit) {
  if (::kill(pid, SIGSTOP) != 0) return false;
  const auto until = std::chrono::steady_clock::now() + limit;
  // The signal stops the threads one by one: every one of them must show it.
  for (const auto& task :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task")) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now());
    if (!wait_for_process_state(std::stoi(task.path().filename().string()), "T",
                                std::max(left, std::chrono::milliseconds(0)))) {
      return false;
    }
  }
  return true;
}

namespace {

// What rank `r` printed, for a failure's message.
std::string output_of(const std::vector<Rank>& ranks, int r) {
  const std::string header = "---- output of rank " + std::to_string(r) + " ----\n";
  if (ranks[r].log_path.empty())
    return header + "(it ran in the test process: its output is above)\n";
  return header + read_file(ranks[r].log_path);
}

// Watches the ranks' processes until each has exited, one fails (it then kills the others) or the
// deadline passes; returns the failure, "" when none. `rank0_running`, when given, says whether
// rank 0, running in this process, has yet to finish: a deadline that passes names it too.
std::string supervise(std::vector<Rank>& ranks, const RunRanksOptions& options,
                      std::chrono::steady_clock::time_point deadline,
                      const std::atomic<bool>* rank0_running) {
  const int world_size = static_cast<int>(ranks.size());
  auto expected_status = [&](int r) {
    const auto it = options.expected_exit_codes.find(r);
    return it == options.expected_exit_codes.end() ? 0 : it->second;
  };
  int remaining = 0;
  for (const Rank& rank : ranks) remaining += rank.done ? 0 : 1;
  std::string failure;
  while (remaining > 0 && failure.empty()) {
    for (int r = 0; r < world_size; ++r) {
      if (ranks[r].done) continue;
      if (::waitpid(ranks[r].pid, &ranks[r].status, WNOHANG) != ranks[r].pid) continue;
      ranks[r].done = true;
      --remaining;
      const int status = ranks[r].status;
      const auto signal = options.expected_signals.find(r);
      const bool as_expected = signal != options.expected_signals.end()
                                   ? WIFSIGNALED(status) && WTERMSIG(status) == signal->second
                                   : WIFEXITED(status) && WEXITSTATUS(status) == expected_status(r);
      if (!as_expected) {
        // The failing rank's output first, then the others' up to now (they are killed next).
        const std::string expected = signal != options.expected_signals.end()
                                         ? std::string("signal ") + strsignal(signal->second)
                                         : "status " + std::to_string(expected_status(r));
        failure = "rank " + std::to_string(r) + " " + describe_status(status) + " (expected " +
                  expected + ")\n" + output_of(ranks, r);
        for (int other = 0; other < world_size; ++other) {
          if (other != r) failure += "\n" + output_of(ranks, other);
        }
      }
    }
    if (failure.empty() && remaining > 0 && std::chrono::steady_clock::now() >= deadline) {
      failure =
          "deadline of " + std::to_string(options.deadline.count()) + " s passed; still running:";
      if (rank0_running != nullptr && rank0_running->load()) failure += " rank 0 (this process)";
      for (int r = 0; r < world_size; ++r) {
        if (!ranks[r].done) failure += " rank " + std::to_string(r);
      }
      for (int r = 0; r < world_size; ++r) failure += "\n" + output_of(ranks, r);
    }
    if (failure.empty() && remaining > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  // A failure ends the others at once: a rank 0 running here then sees its peers lost.
  if (!failure.empty()) kill_all(ranks);
  return failure;
}

// Runs rank 0's body in this process while a thread supervises the other ranks' processes;
// returns the failure of either, "" when none. The variables are set before the supervisor starts
// (no thread of this test reads the environment meanwhile), and the whole environment is put back
// as it was after it ends (a body may set variables of its own).
std::string run_rank0_here(std::vector<Rank>& ranks, const RunRanksOptions& options,
                           std::chrono::steady_clock::time_point deadline, const std::string& dir,
                           int port, const std::function<void(int, int)>& body) {
  const int world_size = static_cast<int>(ranks.size());
  const SavedEnvironment environment;
  ScopedEnv variables(rank_variables(0, world_size, port));
  std::atomic<bool> running{true};
  std::string others_failure;
  std::thread supervisor([&] { others_failure = supervise(ranks, options, deadline, &running); });
  std::string own_failure;
  try {
    start_together(dir, 0, world_size);
    body(0, world_size);
  } catch (const std::exception& e) {
    own_failure = std::string("rank 0 (in the test process): C++ exception with description \"") +
                  e.what() + "\" thrown in the rank's body.";
  } catch (...) {
    own_failure = "rank 0 (in the test process): unknown C++ exception thrown in the rank's body.";
  }
  // What the process of a rank would have ended by exiting, before the next body runs here: the
  // registered cleanups, newest first.
  const auto& cleanups = rank0_cleanups();
  for (auto cleanup = cleanups.rbegin(); cleanup != cleanups.rend(); ++cleanup) {
    try {
      (*cleanup)();
    } catch (const std::exception& e) {
      own_failure += std::string(own_failure.empty() ? "" : "\n") +
                     "rank 0 (in the test process): cleaning up after the body failed: " + e.what();
    }
  }
  running = false;
  supervisor.join();
  if (own_failure.empty()) return others_failure;
  return others_failure.empty() ? own_failure : own_failure + "\n" + others_failure;
}

}  // namespace

void run_ranks(int world_size, const std::function<void(int, int)>& body,
               const RunRanksOptions& options) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string filter = std::string(info->test_suite_name()) + "." + info->name();
  const int call = next_call_of_test(filter);
  if (in_rank_process()) {
    if (std::atoi(std::getenv(kChildVariable)) == call) {
#if DISTOPTIM_UNDER_TSAN
      // ThreadSanitizer starts its background thread at the process's first new thread: have it
      // now, so that a body counting its threads counts them steadily.
      std::thread([] {}).join();
#endif
      const int rank = std::atoi(std::getenv("RANK"));
      const int world_size = std::atoi(std::getenv("WORLD_SIZE"));
      if (const char* dir = std::getenv(kRanksDirVariable)) start_together(dir, rank, world_size);
      body(rank, world_size);
    }
    return;
  }
  const int port = free_port();
  ASSERT_GT(port, 0) << "no free port on 127.0.0.1";

  std::vector<Rank> ranks(world_size);
  char dir_template[] = "/tmp/distoptim-ranks-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  const bool fork_ranks = may_fork_ranks();
  // Rank 0 here only where every rank is started afresh anyway: a process that has run a body
  // has threads, and could no longer fork its ranks.
  const char* rank0_mode = std::getenv("DISTOPTIM_TEST_RANK0");
  const bool rank0_own_process = rank0_mode != nullptr && std::string(rank0_mode) == "own-process";
  const bool rank0_here = options.rank0_in_test_process && !rank0_own_process && !fork_ranks &&
                          options.expected_exit_codes.count(0) == 0 &&
                          options.expected_signals.count(0) == 0;
  for (int r = 0; r < world_size; ++r) {
    if (r == 0 && rank0_here) {
      ranks[0].done = true;  // nothing for the supervisor to wait for
      continue;
    }
    ranks[r].log_path = dir + "/rank" + std::to_string(r) + ".log";
    ranks[r].pid = fork_ranks ? fork_rank(call, r, world_size, port, ranks[r].log_path, body)
                              : spawn_rank(call, r, world_size, port, filter, ranks[r].log_path);
    if (ranks[r].pid < 0) {
      kill_all(ranks);
      FAIL() << "could not start rank " << r;
    }
  }

  const auto deadline = std::chrono::steady_clock::now() + options.deadline;
  std::string failure;
  if (rank0_here) {
    failure = run_rank0_here(ranks, options, deadline, dir, port, body);
  } else {
    failure = supervise(ranks, options, deadline, nullptr);
  }
  kill_all(ranks);
  for (int r = 0; r < world_size; ++r) {
    if (!ranks[r].log_path.empty()) ::unlink(ranks[r].log_path.c_str());
    ::unlink(started_path(dir, r).c_str());
  }
  ::rmdir(dir.c_str());
  if (!failure.empty()) FAIL() << failure;
}

std::set<int> thread_ids() {
  std::set<int> ids;
  if (DIR* tasks = ::opendir("/proc/self/task")) {
    while (const dirent* entry = ::readdir(tasks)) {
      if (entry->d_name[0] != '.') ids.insert(std::atoi(entry->d_name));
    }
    ::closedir(tasks);
  }
  return ids;
}

int thread_count() { return static_cast<int>(thread_ids().size()); }

std::set<int> threads_started_since(const std::set<int>& before, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  for (;;) {
    std::set<int> started;
    for (const int id : thread_ids()) {
      if (before.count(id) == 0) started.insert(id);
    }
    if (started.empty() || std::chrono::steady_clock::now() >= until) return started;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace testing
}  // namespace distoptim
