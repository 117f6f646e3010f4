#include "distrun/rank_process.h"

#include "distrun/job_secret.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include <fmt/format.h>

#include "distrun/signals_fds.h"

extern char** environ;

namespace distoptim {
namespace launcher {
namespace {

// At a rank's exit, read what is left in its pipes before reporting it, so a failure report
// follows the rank's last words; bounded, as its own children may still be writing.
constexpr int kMaxReadsAtExit = 16;
constexpr int kExecFailedStatus = 127;

// How much of each rank's stderr is kept for reading the ranks its error names.
constexpr size_t kStderrTailBytes = 4096;

// Whether `pid`, a child not reaped yet, has exited (without reaping it).
bool has_exited(pid_t pid) {
  siginfo_t info{};
  int result;
  do {
    result = ::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT);
  } while (result < 0 && errno == EINTR);
  return result < 0 || info.si_pid != 0;
}

// What a forked child needs to exec, all prepared before fork.
struct ChildSetup {
  pid_t parent = -1;
  int stdout_fd = -1;
  int stderr_fd = -1;
  sigset_t mask{};
  char* const* argv = nullptr;
  char* const* envp = nullptr;
  std::string exec_error;
};

[[noreturn]] void exec_child(const ChildSetup& setup) {
  restore_default_signals();
  // Die with distrun. If distrun died before this took effect, the child has been reparented.
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != setup.parent) ::_exit(1);
  if (::dup2(setup.stdout_fd, STDOUT_FILENO) < 0 || ::dup2(setup.stderr_fd, STDERR_FILENO) < 0) {
    ::_exit(kExecFailedStatus);
  }
  ::sigprocmask(SIG_SETMASK, &setup.mask, nullptr);
  ::execvpe(setup.argv[0], setup.argv, setup.envp);
  const std::string message = setup.exec_error + std::strerror(errno) + "\n";
  write_all(STDERR_FILENO, message);
  ::_exit(kExecFailedStatus);
}

// distrun's environment without the variables distrun sets, without those saying where ranks
// meet (they would name another job's store), and without those of the RPC's security (distrun's
// options decide it: --rpc-secret-file, --rpc-insecure), then distrun's, as NAME=value.
std::vector<std::string> child_environment(
    const std::vector<std::pair<std::string, std::string>>& variables) {
  std::vector<std::string> env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string item = *entry;
    const std::string name = item.substr(0, item.find('='));
    if (is_rendezvous_variable(name) || name == kRpcSecretFileVariable ||
        name == "DISTOPTIM_RPC_INSECURE") {
      continue;
    }
    const bool overridden =
        std::any_of(variables.begin(), variables.end(), [&](const auto& variable) {
          return item.compare(0, variable.first.size() + 1, variable.first + "=") == 0;
        });
    if (!overridden) env.push_back(item);
  }
  for (const auto& [name, value] : variables) env.push_back(name + "=" + value);
  return env;
}

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  for (auto& s : strings) pointers.push_back(s.data());
  pointers.push_back(nullptr);
  return pointers;
}

}  // namespace

RankProcess start_rank(const LaunchOptions& options, int local_rank, int restart_count,
                       const std::string& secret_file) {
  const int rank = options.node_rank * options.nproc_per_node + local_rank;
  std::vector<std::string> args = options.command;
  std::vector<std::string> env =
      child_environment(rank_environment(options, local_rank, restart_count, secret_file));
  const std::vector<char*> argv = c_strings(args);
  const std::vector<char*> envp = c_strings(env);
  Pipe out = make_pipe();
  Pipe err = make_pipe();

  ChildSetup setup;
  setup.parent = ::getpid();
  setup.stdout_fd = out.write.get();
  setup.stderr_fd = err.write.get();
  setup.argv = argv.data();
  setup.envp = envp.data();
  setup.exec_error = fmt::format("distrun: cannot execute {}: ", single_quoted(args.front()));

  // Signals stay blocked across fork until the child has reset distrun's handlers.
  sigset_t all;
  sigfillset(&all);
  ::sigprocmask(SIG_SETMASK, &all, &setup.mask);
  const pid_t pid = ::fork();
  if (pid == 0) exec_child(setup);
  const int fork_errno = errno;
  ::sigprocmask(SIG_SETMASK, &setup.mask, nullptr);
  if (pid < 0) throw errno_error(fork_errno, "fork");

  RankProcess run;
  run.rank = rank;
  run.local_rank = local_rank;
  run.restart_count = restart_count;
  run.pid = pid;
  run.running = true;
  const std::string prefix = fmt::format("[rank {}] ", rank);
  run.outputs.emplace_back(std::move(out.read), prefix, STDOUT_FILENO);
  run.outputs.emplace_back(std::move(err.read), prefix, STDERR_FILENO);
  run.outputs.back().keep_tail(kStderrTailBytes);
  return run;
}

void signal_run(RankProcess& run, int signo) {
  if (!run.running) return;
  ::kill(run.pid, signo);
  if (run.signals_sent.empty() || run.signals_sent.back() != signo) {
    run.signals_sent.push_back(signo);
  }
}

bool reap_if_exited(RankProcess& run) {
  int status = 0;
  pid_t pid;
  do {
    pid = ::waitpid(run.pid, &status, WNOHANG);
  } while (pid < 0 && errno == EINTR);
  if (pid == 0) return false;
  run.wait_error = pid < 0 ? errno : 0;
  run.running = false;
  run.status = status;
  run.waited = pid > 0;
  for (auto& output : run.outputs) {
    if (output.open()) output.read_available(kMaxReadsAtExit);
  }
  return true;
}

bool still_running(const RankProcess& run) { return run.running && !has_exited(run.pid); }

std::string how_ended(const RankProcess& run) {
  if (!run.waited) return "could not be waited for";
  if (WIFSIGNALED(run.status)) return "killed by signal " + signal_name(WTERMSIG(run.status));
  return fmt::format("exited with status {}", WEXITSTATUS(run.status));
}

std::string failure_notice(const RankProcess& run) {
  const std::string ended =
      !run.waited ? "cannot be waited for: " + std::string(std::strerror(run.wait_error))
      : WIFSIGNALED(run.status) ? "was " + how_ended(run)
                                : how_ended(run);
  return fmt::format("distrun: rank {} (pid {}) {}\n", run.rank, run.pid, ended);
}

}  // namespace launcher
}  // namespace distoptim
