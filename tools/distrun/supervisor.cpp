// The supervisor's state machine (Supervisor below; one poll loop, single-threaded). An attempt
// runs the local ranks once:
//
//   joining   only across nodes with restarts (--nnodes > 1, --max-restarts > 0): this node's
//             distrun joins round k (= DISTRUN_RESTART_COUNT) in node 0's store
//             (node_coordination.h) and waits, within --rdzv-timeout, until every node has;
//             node 0 picks the round's MASTER_PORT. A signal, here or on another node, ends
//             the job without an attempt.
//   starting  start_all() forks and execs every local rank in order, each with its stdout and
//             stderr on pipes; a rank that cannot be started counts as a failure with status 1
//             (the ranks already started are stopped as below).
//   running   the loop relays output and reaps ranks as they exit. Exit status 0 changes
//             nothing; a non-zero status or a signal is a failure. With --restart-policy rank, a
//             failed rank other than rank 0 that has restarts left (--max-restarts per rank) is
//             started again at once, alone, with its own DISTRUN_RESTART_COUNT one higher and
//             the same MASTER_PORT, unless the job is already stopping: that is no failure of
//             the job, and the other ranks run on. Across nodes, the loop also
//             asks the store every 100 ms whether another node's failure, or a signal to another
//             node's distrun, ended the round: then the local ranks are stopped as below (their
//             ends count as its consequences, not as failures of this node).
//   stopping  entered on the first failure, or when distrun gets SIGINT/SIGTERM: the first
//             failure's status is kept (across nodes, published as the round's failure first,
//             unless another node's came first; a signal is published as the job's stop);
//             every rank still running is sent SIGTERM (or the signal distrun got, which is also
//             passed on each time it comes again) and the grace period starts. Later failures
//             are reported but change neither. The first failure's last 4 KiB of stderr are
//             read for the ranks its error names (distoptim's formats); those still running
//             are pointed at in the summary (a rank whose collective failed exits first while
//             the rank it names hangs).
//   killing   at the end of the grace period, SIGKILL to every rank still running.
//   draining  once no rank runs: output still held open by the ranks' own children is relayed
//             for at most kDrainTimeout, then closed. The attempt ends.
//   ending    only across nodes: the round's outcome, the same on every node, from the store: a
//             node whose ranks all exited 0 waits (within --rdzv-timeout) until every node's
//             did, or one failed; a node cut off from the store keeps trying to reach it. A
//             signal needs no answer.
//   restarting  (--restart-policy all) after an attempt that failed (across nodes: a round that
//             failed on any node),
//             when distrun got no SIGINT/SIGTERM (during it or before this point) and fewer than
//             --max-restarts restarts were made: every rank of the attempt has been reaped, so
//             no process of the old round is left; on one node, the master port is renewed
//             (unless given on the command line); across nodes, the next round brings its own.
//             The next attempt starts with DISTRUN_RESTART_COUNT one higher.
//   done      exit status: 128 + the signal distrun got, if any; across nodes, the round's: 0,
//             the status of the failure that ended it, or 128 + the signal another node's
//             distrun got; 1 if the coordination failed; on one node, the last attempt's first
//             failure's status (128 + signal for a rank killed by one), else 0. When it is not
//             0, a summary on stderr gives, for every attempt, how every local rank ended and
//             which ones distrun stopped, with which signals, and across nodes which node's
//             failure (or signal) ended the round. With --restart-policy rank, the summary also
//             comes after a success when a rank was restarted, with each earlier run of a rank.
//             Node 0's distrun, which serves the store, waits up to 5 s for the other nodes to have
//             read how the job ended.

#include "distrun/supervisor.h"

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "distrun/job_secret.h"
#include "distrun/named_ranks.h"
#include "distrun/node_coordination.h"
#include "distrun/output_relay.h"
#include "distrun/signals_fds.h"

extern char** environ;

namespace distoptim {
namespace launcher {
namespace {

using Clock = std::chrono::steady_clock;

// At a rank's exit, read what is left in its pipes before reporting it, so a failure report
// follows the rank's last words; bounded, as its own children may still be writing.
constexpr int kMaxReadsAtExit = 16;
// Once every rank has exited, how long output held open by their children is still read.
constexpr auto kDrainTimeout = std::chrono::seconds(1);
constexpr int kExecFailedStatus = 127;

// How much of each rank's stderr is kept for reading the ranks its error names.
constexpr size_t kStderrTailBytes = 4096;

struct RankProcess {
  int rank = 0;
  int local_rank = 0;
  int restart_count = 0;  // its DISTRUN_RESTART_COUNT
  bool replaced = false;  // failed and was restarted alone: a later run of the rank follows
  pid_t pid = -1;
  bool running = false;
  int status = 0;                    // as waitpid gives it, once reaped
  bool waited = false;               // reaped with a status (not a failed waitpid)
  std::vector<int> signals_sent;     // by distrun while it ran, in order
  std::vector<OutputRelay> outputs;  // stdout, stderr
};

// Whether `pid`, a child not reaped yet, has exited (without reaping it).
bool has_exited(pid_t pid) {
  siginfo_t info{};
  int result;
  do {
    result = ::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT);
  } while (result < 0 && errno == EINTR);
  return result < 0 || info.si_pid != 0;
}

// How a reaped rank ended: "exited with status 3", "killed by signal SIGTERM".
std::string how_ended(const RankProcess& rank) {
  if (!rank.waited) return "could not be waited for";
  if (WIFSIGNALED(rank.status)) return "killed by signal " + signal_name(WTERMSIG(rank.status));
  return fmt::format("exited with status {}", WEXITSTATUS(rank.status));
}

std::string rank_list(const std::vector<int>& ranks) {
  return fmt::format("rank{} {}", ranks.size() > 1 ? "s" : "", fmt::join(ranks, ", "));
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

// distrun's environment without the variables distrun sets, then those, as NAME=value.
std::vector<std::string> child_environment(
    const std::vector<std::pair<std::string, std::string>>& variables) {
  std::vector<std::string> env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string item = *entry;
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

// Runs the ranks of one node. See run() in supervisor.h for the behaviour. Single-threaded: one
// poll loop waits on the self-pipe and every rank's stdout and stderr pipe, with a timeout only
// while a deadline (SIGKILL after the grace period, end of draining) is pending; everything else
// is driven by the ranks' output and exits.
class Supervisor {
 public:
  // `port_given`: the master port came from the command line and is kept across restarts.
  Supervisor(LaunchOptions options, bool port_given)
      : options_(std::move(options)), port_given_(port_given) {}
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  // Only on an error path are ranks still running here: kill and reap them.
  ~Supervisor() {
    signal_running(SIGKILL);
    for (auto& rank : ranks_) {
      if (rank.running) ::waitpid(rank.pid, nullptr, 0);
    }
  }

  int run() {
    ensure_standard_fds_open();
    // On one node, the job's ranks authenticate each other with a secret made here, unless the
    // user gave one. Across nodes each node's distrun would make its own: the user gives every
    // node the same file (DISTOPTIM_RPC_SECRET_FILE), or the job runs without, as by hand.
    const char* given = std::getenv(kRpcSecretFileVariable);
    if (options_.nnodes == 1 && (given == nullptr || *given == '\0')) {
      try {
        secret_.emplace();
      } catch (const std::exception& e) {
        write_all(STDERR_FILENO, fmt::format("distrun: {}\n", e.what()));
        return 1;
      }
    }
    try {
      // Across nodes, a restart is a new round for every node: their distruns coordinate.
      if (options_.nnodes > 1 && options_.max_restarts > 0) {
        coordinator_ = std::make_unique<NodeCoordinator>(options_);
      }
      run_rounds();
    } catch (const CoordinationError& e) {
      coordination_error_ = e.what();
    }
    // Also after a coordination error: the other nodes may still have to read theirs (options
    // that differ fail every node, each after reading every node's).
    if (coordinator_) coordinator_->leave();
    const int status = exit_status();
    if (status != 0 || restarted_alone()) write_all(STDERR_FILENO, final_report());
    return status;
  }

 private:
  void run_rounds() {
    for (restart_count_ = 0;; ++restart_count_) {
      if (coordinator_ && !join_round()) return;
      run_attempt();
      // A signal that came after the last rank was reaped still forbids a restart.
      take_signals();
      if (coordinator_) {
        try {
          end_round();
        } catch (const CoordinationError&) {
          summaries_.push_back(summary());
          throw;
        }
      }
      summaries_.push_back(summary());
      if (!restart_wanted()) return;
      prepare_restart();
    }
  }

  // Every node joins the round; node 0 picks the ranks' port. False when a distrun (this one,
  // or another node's) stopped the job meanwhile.
  bool join_round() {
    round_outcome_.reset();
    const auto joined = coordinator_->join_round(restart_count_, [this] {
      take_signals();
      return received_signal_;
    });
    if (joined.stopped) {
      round_outcome_ = joined.stopped;
      return false;
    }
    options_.master_port = joined.master_port;
    if (restart_count_ > 0) {
      write_all(STDERR_FILENO,
                fmt::format("distrun: all {} nodes joined round {}; the ranks meet on "
                            "MASTER_PORT={}\n",
                            options_.nnodes, restart_count_, options_.master_port));
    }
    return true;
  }

  // Once the local ranks of the round have ended: how the round ended on every node.
  void end_round() {
    RoundOutcome local = RoundOutcome::succeeded(options_.node_rank);
    if (received_signal_ != 0) {
      local = RoundOutcome::stopped(options_.node_rank, received_signal_);
    } else if (first_failure_status_ != 0) {
      local = RoundOutcome::failed(options_.node_rank, first_failure_rank_, first_failure_status_);
    }
    round_outcome_ = coordinator_->finish_round(local, [this] {
      take_signals();
      return received_signal_;
    });
  }

  bool restart_wanted() const {
    if (options_.restart_policy == RestartPolicy::kRank) return false;  // done within the attempt
    if (received_signal_ != 0 || restart_count_ == options_.max_restarts) return false;
    if (coordinator_) return round_outcome_->kind == RoundOutcome::Kind::kFailed;
    return first_failure_status_ != 0;
  }

  int exit_status() const {
    if (received_signal_ != 0) return 128 + received_signal_;
    if (!coordination_error_.empty()) return 1;
    if (coordinator_) return round_outcome_->status;
    return first_failure_status_;
  }

  // One attempt: from starting to the end of draining (see the top of this file).
  void run_attempt() {
    start_all();
    while (any_running() || any_output_open()) {
      poll_once();
      take_signals();
      reap();
      watch_other_nodes();
      enforce_deadlines();
    }
  }

  void take_signals() {
    for (int signo : signals_.take()) {
      if (signo == SIGINT || signo == SIGTERM) on_signal_received(signo);
    }
  }

  // Another node's failure, or a signal to another node's distrun, ends this round here too.
  // Meanwhile, the other nodes are told this distrun is alive.
  void watch_other_nodes() {
    if (coordinator_) coordinator_->beat();
    if (!coordinator_ || ended_elsewhere_ || !any_running()) return;
    const auto outcome = coordinator_->poll_round();
    if (!outcome || outcome->node == options_.node_rank) return;
    ended_elsewhere_ = outcome;
    if (grace_deadline_) return;
    write_all(STDERR_FILENO,
              fmt::format("distrun: attempt {} ended on another node ({}); stopping the local "
                          "rank(s)\n",
                          restart_count_ + 1, outcome->describe()));
    start_grace_period();
    signal_running(SIGTERM);
  }

  // Between attempts: every rank is reaped and every pipe closed; reset the attempt's state and
  // give the new round its own rendezvous port.
  void prepare_restart() {
    const std::string failure = coordinator_ ? round_outcome_->describe()
                                : first_failure_rank_ >= 0
                                    ? fmt::format("rank {} failed first", first_failure_rank_)
                                    : std::string("a rank could not be started");
    ranks_.clear();
    grace_deadline_.reset();
    killed_ = false;
    drain_deadline_.reset();
    first_failure_status_ = 0;
    first_failure_rank_ = -1;
    named_running_.clear();
    named_other_.clear();
    ended_elsewhere_.reset();
    if (coordinator_) {
      // The port comes with the next round (join_round).
      write_all(STDERR_FILENO,
                fmt::format("distrun: attempt {} failed ({}); every node restarts its ranks: "
                            "restart {} of at most {}, DISTRUN_RESTART_COUNT={}\n",
                            restart_count_ + 1, failure, restart_count_ + 1, options_.max_restarts,
                            restart_count_ + 1));
      return;
    }
    if (!port_given_) options_.master_port = fresh_port(options_.master_port);
    write_all(STDERR_FILENO,
              fmt::format("distrun: attempt {} failed ({}); restarting the {} local rank(s): "
                          "restart {} of at most {}, DISTRUN_RESTART_COUNT={}, MASTER_PORT={}\n",
                          restart_count_ + 1, failure, options_.nproc_per_node, restart_count_ + 1,
                          options_.max_restarts, restart_count_ + 1, options_.master_port));
  }

  void start_all() {
    for (int local_rank = 0; local_rank < options_.nproc_per_node; ++local_rank) {
      const int rank = options_.node_rank * options_.nproc_per_node + local_rank;
      try {
        start_rank(local_rank, rank, restart_count_);
      } catch (const std::exception& e) {
        write_all(STDERR_FILENO,
                  fmt::format("distrun: cannot start rank {}: {}\n", rank, e.what()));
        on_failure(1);
        return;
      }
    }
  }

  void start_rank(int local_rank, int rank, int restart_count) {
    std::vector<std::string> args = options_.command;
    std::vector<std::string> env = child_environment(rank_environment(
        options_, local_rank, restart_count, secret_ ? secret_->path() : std::string()));
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

    RankProcess process;
    process.rank = rank;
    process.local_rank = local_rank;
    process.restart_count = restart_count;
    process.pid = pid;
    process.running = true;
    const std::string prefix = fmt::format("[rank {}] ", rank);
    process.outputs.emplace_back(std::move(out.read), prefix, STDOUT_FILENO);
    process.outputs.emplace_back(std::move(err.read), prefix, STDERR_FILENO);
    process.outputs.back().keep_tail(kStderrTailBytes);
    ranks_.push_back(std::move(process));
  }

  bool any_running() const {
    return std::any_of(ranks_.begin(), ranks_.end(), [](const auto& r) { return r.running; });
  }

  bool any_output_open() const {
    return std::any_of(ranks_.begin(), ranks_.end(), [](const auto& r) {
      return std::any_of(r.outputs.begin(), r.outputs.end(),
                         [](const auto& o) { return o.open(); });
    });
  }

  // Waits for output, a signal or the next deadline, and relays what output there is.
  void poll_once() {
    std::vector<pollfd> fds{{signals_.read_fd(), POLLIN, 0}};
    std::vector<OutputRelay*> relays{nullptr};
    for (auto& rank : ranks_) {
      for (auto& output : rank.outputs) {
        if (!output.open()) continue;
        fds.push_back({output.fd(), POLLIN, 0});
        relays.push_back(&output);
      }
    }
    if (::poll(fds.data(), fds.size(), poll_timeout_ms()) < 0) {
      if (errno == EINTR) return;
      throw errno_error(errno, "poll");
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents != 0) relays[i]->read_available(1);
    }
  }

  std::optional<Clock::time_point> next_deadline() const {
    if (drain_deadline_) return drain_deadline_;
    if (grace_deadline_ && !killed_) return grace_deadline_;
    return std::nullopt;
  }

  int poll_timeout_ms() const {
    auto deadline = next_deadline();
    // While ranks run, the store is asked every kRetryInterval whether the round ended elsewhere
    // (and told that this distrun is alive, also while the ranks are stopped).
    if (coordinator_ && any_running()) {
      const auto watch = Clock::now() + NodeCoordinator::kRetryInterval;
      deadline = deadline ? std::min(*deadline, watch) : watch;
    }
    if (!deadline) return -1;
    const auto left = *deadline - Clock::now();
    if (left <= Clock::duration::zero()) return 0;
    // Rounded up, so the loop does not spin through the last fraction of a millisecond.
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
    return static_cast<int>(std::min<int64_t>(ms, INT_MAX));
  }

  void reap() {
    std::vector<size_t> to_restart;
    for (size_t i = 0; i < ranks_.size(); ++i) {
      RankProcess& rank = ranks_[i];
      if (!rank.running) continue;
      int status = 0;
      pid_t pid;
      do {
        pid = ::waitpid(rank.pid, &status, WNOHANG);
      } while (pid < 0 && errno == EINTR);
      if (pid == 0) continue;
      const int wait_errno = errno;
      rank.running = false;
      rank.status = status;
      rank.waited = pid > 0;
      for (auto& output : rank.outputs) {
        if (output.open()) output.read_available(kMaxReadsAtExit);
      }
      if (pid > 0 && status != 0 && may_restart_alone(rank)) {
        write_all(STDERR_FILENO,
                  fmt::format("distrun: rank {} (pid {}) {}\n", rank.rank, rank.pid,
                              WIFSIGNALED(status) ? "was " + how_ended(rank) : how_ended(rank)));
        rank.replaced = true;
        to_restart.push_back(i);
        continue;
      }
      // Once another node ended the round, the local ranks' ends are its consequences.
      if (first_failure_rank_ < 0 && !ended_elsewhere_ && (pid < 0 || status != 0)) {
        first_failure_rank_ = rank.rank;
        note_ranks_named_by(rank);
      }
      if (pid < 0) {
        write_all(STDERR_FILENO, fmt::format("distrun: rank {} (pid {}) cannot be waited for: {}\n",
                                             rank.rank, rank.pid, std::strerror(wait_errno)));
        on_failure(1);
      } else if (WIFSIGNALED(status)) {
        write_all(STDERR_FILENO, fmt::format("distrun: rank {} (pid {}) was killed by signal {}\n",
                                             rank.rank, rank.pid, signal_name(WTERMSIG(status))));
        on_failure(128 + WTERMSIG(status));
      } else if (WEXITSTATUS(status) != 0) {
        write_all(STDERR_FILENO, fmt::format("distrun: rank {} (pid {}) exited with status {}\n",
                                             rank.rank, rank.pid, WEXITSTATUS(status)));
        on_failure(WEXITSTATUS(status));
      }
    }
    for (size_t i : to_restart) restart_alone(i);
  }

  // --restart-policy rank: whether a failure of `rank` restarts it alone. Not rank 0 (it serves
  // the store the others would rejoin), not once the job is stopping (a signal, or a failure
  // that ends it: later failures are its consequences), and at most --max-restarts times a rank.
  bool may_restart_alone(const RankProcess& rank) const {
    return options_.restart_policy == RestartPolicy::kRank && rank.rank != 0 &&
           rank.restart_count < options_.max_restarts && received_signal_ == 0 &&
           !grace_deadline_ && !ended_elsewhere_;
  }

  // Starts the failed run ranks_[index] again, alone, with its restart count one higher and the
  // same MASTER_PORT; the other ranks run on.
  void restart_alone(size_t index) {
    if (grace_deadline_) {
      // Another rank reaped in the same pass ended the job: this failure is reported, not undone.
      ranks_[index].replaced = false;
      return;
    }
    const int rank = ranks_[index].rank;
    const int local_rank = ranks_[index].local_rank;
    const int restart_count = ranks_[index].restart_count + 1;
    write_all(STDERR_FILENO,
              fmt::format("distrun: restarting rank {} alone (--restart-policy rank): restart {} "
                          "of at most {} for this rank, DISTRUN_RESTART_COUNT={}, MASTER_PORT={}; "
                          "the other ranks keep running\n",
                          rank, restart_count, options_.max_restarts, restart_count,
                          options_.master_port));
    try {
      start_rank(local_rank, rank, restart_count);
    } catch (const std::exception& e) {
      write_all(STDERR_FILENO, fmt::format("distrun: cannot start rank {}: {}\n", rank, e.what()));
      if (first_failure_rank_ < 0) first_failure_rank_ = rank;
      on_failure(1);
    }
  }

  bool restarted_alone() const {
    return std::any_of(ranks_.begin(), ranks_.end(), [](const auto& r) { return r.replaced; });
  }

  // The first rank to fail: which ranks its last words (stderr) name, and which of those had not
  // exited then. A rank whose collective failed often exits first while the culprit it names
  // still hangs.
  void note_ranks_named_by(const RankProcess& failed) {
    named_running_.clear();
    named_other_.clear();
    const int first_local = options_.node_rank * options_.nproc_per_node;
    for (int named : ranks_named_in(failed.outputs[1].tail())) {
      if (named == failed.rank) continue;
      const auto run = std::find_if(ranks_.begin(), ranks_.end(), [&](const RankProcess& r) {
        return r.rank == named && !r.replaced;
      });
      const bool local = named >= first_local && named < first_local + options_.nproc_per_node;
      if (local && run != ranks_.end() && run->running && !has_exited(run->pid)) {
        named_running_.push_back(named);
      } else {
        named_other_.push_back(named);
      }
    }
  }

  // A rank failed (or could not be started): the first failure sets the exit status and stops
  // the other ranks.
  void on_failure(int status) {
    if (ended_elsewhere_) return;
    if (first_failure_status_ == 0) {
      first_failure_status_ = status;
      // Published before the ranks are stopped, so that the other nodes, whose ranks fail in
      // turn, learn that this failure came first.
      if (coordinator_) coordinator_->publish_failure(first_failure_rank_, status);
    }
    if (!grace_deadline_) {
      start_grace_period();
      signal_running(SIGTERM);
    }
  }

  // distrun got SIGINT or SIGTERM: every one is passed on; the first starts the grace period.
  void on_signal_received(int signo) {
    if (received_signal_ == 0) {
      received_signal_ = signo;
      if (coordinator_) coordinator_->publish_stop(signo);
    }
    signal_running(signo);
    if (!grace_deadline_) start_grace_period();
  }

  void start_grace_period() {
    grace_deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                         std::chrono::duration<double>(options_.grace_seconds));
  }

  void enforce_deadlines() {
    const auto now = Clock::now();
    if (grace_deadline_ && !killed_ && now >= *grace_deadline_) {
      killed_ = true;
      std::string running;
      for (const auto& rank : ranks_) {
        if (rank.running) running += fmt::format(" {}", rank.rank);
      }
      if (!running.empty()) {
        write_all(STDERR_FILENO,
                  fmt::format("distrun: grace period of {} s over; sending SIGKILL to rank(s){}\n",
                              options_.grace_seconds, running));
        signal_running(SIGKILL);
      }
    }
    if (!drain_deadline_ && !any_running()) drain_deadline_ = now + kDrainTimeout;
    if (drain_deadline_ && now >= *drain_deadline_) {
      for (auto& rank : ranks_) {
        for (auto& output : rank.outputs) {
          if (output.open()) output.close();
        }
      }
    }
  }

  // A rank that has exited but is not reaped yet is a zombie: its pid cannot have been reused.
  void signal_running(int signo) {
    for (auto& rank : ranks_) {
      if (!rank.running) continue;
      ::kill(rank.pid, signo);
      if (rank.signals_sent.empty() || rank.signals_sent.back() != signo) {
        rank.signals_sent.push_back(signo);
      }
    }
  }

  // The whole picture of a failed job, one line per rank in order: how it ended, and whether
  // distrun stopped it while it still ran (the first rank to fail is often not the culprit: a
  // rank whose collective failed exits first while the rank it waited for still hangs).
  std::string summary() const {
    std::string text;
    if (options_.max_restarts == 0) {
      text = "distrun: how each rank ended:\n";
    } else if (options_.restart_policy == RestartPolicy::kRank) {
      text =
          "distrun: how each rank ended (--restart-policy rank; a restarted rank's earlier runs "
          "below it):\n";
    } else if (coordinator_ && round_outcome_) {
      text = fmt::format(
          "distrun: attempt {} (DISTRUN_RESTART_COUNT={}) ended on every node as {}; how each "
          "rank of node {} ended:\n",
          restart_count_ + 1, restart_count_, round_outcome_->describe(), options_.node_rank);
    } else {
      text = fmt::format("distrun: attempt {} (DISTRUN_RESTART_COUNT={}), how each rank ended:\n",
                         restart_count_ + 1, restart_count_);
    }
    // By rank; a rank's runs (more than one only when restarted alone) in the order they ran.
    std::vector<const RankProcess*> runs;
    for (const auto& rank : ranks_) runs.push_back(&rank);
    std::stable_sort(runs.begin(), runs.end(),
                     [](const auto* a, const auto* b) { return a->rank < b->rank; });
    for (size_t first = 0; first < runs.size();) {
      size_t last = first;
      while (last + 1 < runs.size() && runs[last + 1]->rank == runs[first]->rank) ++last;
      text += rank_line(*runs[last]);
      if (last > first) {
        text += fmt::format("; restarted alone {} time(s), its earlier runs:", last - first);
      }
      text += "\n";
      for (size_t run = first; run < last; ++run) {
        text += fmt::format("distrun:     run {} (pid {}, DISTRUN_RESTART_COUNT={}): {}\n",
                            run - first + 1, runs[run]->pid, runs[run]->restart_count,
                            how_ended(*runs[run]));
      }
      first = last + 1;
    }
    return text;
  }

  // The summary's line for the last run of a rank, without its newline.
  std::string rank_line(const RankProcess& rank) const {
    std::string ended = how_ended(rank);
    if (rank.rank == first_failure_rank_) ended += first_failure_note();
    if (!rank.signals_sent.empty()) {
      std::vector<std::string> names;
      for (int signo : rank.signals_sent) names.push_back(signal_name(signo));
      ended += fmt::format("; it was still running and distrun stopped it with {}",
                           fmt::join(names, ", then "));
    }
    if (std::find(named_running_.begin(), named_running_.end(), rank.rank) !=
        named_running_.end()) {
      ended +=
          fmt::format("; named by the error of rank {}, the first to fail", first_failure_rank_);
    }
    return fmt::format("distrun:   rank {} (pid {}): {}", rank.rank, rank.pid, ended);
  }

  // " (the first failure)", and the ranks its error names: those still running then first.
  std::string first_failure_note() const {
    std::string others;
    if (!named_other_.empty()) {
      const int first_local = options_.node_rank * options_.nproc_per_node;
      std::vector<std::string> items;
      for (int named : named_other_) {
        const bool local = named >= first_local && named < first_local + options_.nproc_per_node;
        items.push_back(fmt::format("{}{}", named, local ? "" : " (not on this node)"));
      }
      others = fmt::format("rank{} {}", items.size() > 1 ? "s" : "", fmt::join(items, ", "));
    }
    if (named_running_.empty()) {
      return others.empty() ? " (the first failure)"
                            : " (the first failure; its error names " + others + ")";
    }
    const bool stopped = std::all_of(named_running_.begin(), named_running_.end(), [&](int named) {
      return std::any_of(ranks_.begin(), ranks_.end(), [&](const RankProcess& r) {
        return r.rank == named && !r.replaced && !r.signals_sent.empty();
      });
    });
    return fmt::format(
        " (the first to fail, but its error names {}, which {} still running{}: look there "
        "first{})",
        rank_list(named_running_), named_running_.size() > 1 ? "were" : "was",
        stopped ? " (stopped by distrun)" : "", others.empty() ? "" : "; it also names " + others);
  }

  // With restarts: why there is no further attempt, then every attempt's summary.
  std::string final_report() const {
    if (options_.max_restarts == 0) return summaries_.back();
    if (options_.restart_policy == RestartPolicy::kRank) return rank_policy_report();
    // The round may have been stopped before its attempt started (while the nodes joined).
    const std::string when =
        fmt::format("{} attempt {}",
                    summaries_.size() > static_cast<size_t>(restart_count_) ? "during" : "before",
                    restart_count_ + 1);
    std::string text;
    if (!coordination_error_.empty()) {
      text = fmt::format("distrun: {}\n", coordination_error_);
    } else if (received_signal_ != 0) {
      text = fmt::format("distrun: got {} {}; no restart after a signal{}\n",
                         signal_name(received_signal_), when,
                         coordinator_ ? " (the other nodes are told to stop)" : "");
    } else if (coordinator_ && round_outcome_->kind == RoundOutcome::Kind::kStopped) {
      text = fmt::format("distrun: {} {}, so every node stops; no restart after a signal\n",
                         round_outcome_->describe(), when);
    } else {
      text = fmt::format(
          "distrun: attempt {} failed{} and no restart is left (--max-restarts {}); exit status "
          "{}\n",
          restart_count_ + 1, coordinator_ ? " (" + round_outcome_->describe() + ")" : "",
          options_.max_restarts, exit_status());
    }
    for (const auto& summary : summaries_) text += summary;
    return text;
  }

  // --restart-policy rank: how the job ended, which ranks were restarted alone, then the summary.
  std::string rank_policy_report() const {
    std::string text;
    if (received_signal_ != 0) {
      text = fmt::format("distrun: got {}; no restart after a signal\n",
                         signal_name(received_signal_));
    } else if (first_failure_rank_ == 0) {
      text = fmt::format(
          "distrun: rank 0 failed; under --restart-policy rank it is never restarted (it serves "
          "the rendezvous store the other ranks meet in), so the job ends; exit status {}\n",
          exit_status());
    } else if (first_failure_rank_ > 0) {
      const int restarts = runs_of(first_failure_rank_) - 1;
      text = fmt::format(
          "distrun: rank {} failed {}and no restart is left for it (--max-restarts {}, per "
          "rank); exit status {}\n",
          first_failure_rank_, restarts > 0 ? fmt::format("after {} restart(s) ", restarts) : "",
          options_.max_restarts, exit_status());
    } else if (exit_status() != 0) {
      text = fmt::format("distrun: a rank could not be started; exit status {}\n", exit_status());
    } else {
      text = "distrun: every rank exited with status 0\n";
    }
    std::vector<std::string> restarted;
    for (int local = 0; local < options_.nproc_per_node; ++local) {
      const int rank = options_.node_rank * options_.nproc_per_node + local;
      const int restarts = runs_of(rank) - 1;
      if (restarts > 0) restarted.push_back(fmt::format("rank {} {} time(s)", rank, restarts));
    }
    if (!restarted.empty()) {
      text += fmt::format("distrun: restarted alone (--restart-policy rank): {}\n",
                          fmt::join(restarted, ", "));
    }
    return text + summaries_.back();
  }

  // How many runs of `rank` were started.
  int runs_of(int rank) const {
    return static_cast<int>(std::count_if(ranks_.begin(), ranks_.end(),
                                          [rank](const RankProcess& r) { return r.rank == rank; }));
  }

  LaunchOptions options_;
  const bool port_given_;
  // The job's RPC secret, made by run() for a job on one node (see there); kept for every attempt.
  std::optional<JobSecret> secret_;
  SignalPipe signals_;
  // With --nnodes > 1 and --max-restarts > 0; null otherwise.
  std::unique_ptr<NodeCoordinator> coordinator_;
  // Coordinated: how the current (or last) round ended on every node, once known; whether
  // another node ended it while the local ranks ran; why the coordination failed.
  std::optional<RoundOutcome> round_outcome_;
  std::optional<RoundOutcome> ended_elsewhere_;
  std::string coordination_error_;
  int restart_count_ = 0;
  std::vector<std::string> summaries_;  // one per attempt, in order
  std::vector<RankProcess> ranks_;
  std::optional<Clock::time_point> grace_deadline_;
  bool killed_ = false;
  std::optional<Clock::time_point> drain_deadline_;
  int received_signal_ = 0;
  int first_failure_status_ = 0;
  int first_failure_rank_ = -1;
  // The ranks the first failure's stderr names: those that had not exited when it failed (local
  // ones), and the others.
  std::vector<int> named_running_;
  std::vector<int> named_other_;
};

}  // namespace

int run(const LaunchOptions& options) {
  validate(options);
  Supervisor supervisor(resolve_master(options), options.master_port != 0);
  return supervisor.run();
}

}  // namespace launcher
}  // namespace distoptim
