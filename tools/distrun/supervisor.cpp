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
//             failed rank that has restarts left (--max-restarts per rank), other than rank 0
//             under --rdzv-backend static (it serves the store), is started again at once,
//             alone, with its own DISTRUN_RESTART_COUNT one higher and the same MASTER_PORT (or
//             etcd job), unless the job is already stopping: that is no failure of
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
//             (unless given on the command line; under etcd, the attempt's job is); across
//             nodes, the next round brings its own.
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
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "distrun/job_report.h"
#include "distrun/job_secret.h"
#include "distrun/node_coordination.h"
#include "distrun/output_relay.h"
#include "distrun/rank_process.h"
#include "distrun/restart_policy.h"
#include "distrun/signals_fds.h"

namespace distoptim {
namespace launcher {
namespace {

using Clock = std::chrono::steady_clock;

// Once every rank has exited, how long output held open by their children is still read.
constexpr auto kDrainTimeout = std::chrono::seconds(1);

// Runs the ranks of one node. See run() in supervisor.h for the behaviour. Single-threaded: one
// poll loop waits on the self-pipe and every rank's stdout and stderr pipe, with a timeout only
// while a deadline (SIGKILL after the grace period, end of draining) is pending; everything else
// is driven by the ranks' output and exits. The rooms it drives: rank_process.h (a rank's
// process), restart_policy.h (whether and how ranks start again), node_coordination.h (the
// rounds across nodes) and job_report.h (the summary at the end).
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
    // user gave one (--rpc-secret-file) or chose none (--rpc-insecure). Across nodes each node's
    // distrun would make its own: the user gives every node the same file (validate() insists).
    if (options_.nnodes == 1 && options_.rpc_secret_file.empty() && !options_.rpc_insecure) {
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
        coordinator_ = make_node_coordinator(options_);
      }
      run_rounds();
    } catch (const CoordinationError& e) {
      coordination_error_ = e.what();
    }
    // Also after a coordination error: the other nodes may still have to read theirs (options
    // that differ fail every node, each after reading every node's).
    if (coordinator_) coordinator_->leave();
    const int status = exit_status();
    if (status != 0 || restarted_alone()) {
      write_all(STDERR_FILENO, final_report(options_, job_end(status), summaries_, ranks_));
    }
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
    } else if (first_failure_.status != 0) {
      local = RoundOutcome::failed(options_.node_rank, first_failure_.rank, first_failure_.status);
    }
    round_outcome_ = coordinator_->finish_round(local, [this] {
      take_signals();
      return received_signal_;
    });
  }

  bool restart_wanted() const {
    // Across nodes, the round failed on some node; on one node, a local rank failed.
    const bool failed = coordinator_ ? round_outcome_->kind == RoundOutcome::Kind::kFailed
                                     : first_failure_.status != 0;
    return restart_all_wanted(options_, restart_count_, received_signal_, failed);
  }

  int exit_status() const {
    if (received_signal_ != 0) return 128 + received_signal_;
    if (!coordination_error_.empty()) return 1;
    if (coordinator_) return round_outcome_->status;
    return first_failure_.status;
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
  // give the new round its own rendezvous port (across nodes, it comes with the next round).
  void prepare_restart() {
    const int failed_first = first_failure_.rank;
    ranks_.clear();
    grace_deadline_.reset();
    killed_ = false;
    drain_deadline_.reset();
    first_failure_ = FirstFailure();
    ended_elsewhere_.reset();
    if (!coordinator_ && !port_given_ && options_.rdzv_backend == RdzvBackend::kStatic) {
      options_.master_port = fresh_port(options_.master_port);
    }
    write_all(STDERR_FILENO,
              restart_all_notice(options_, restart_count_, round_outcome_, failed_first));
  }

  void start_all() {
    for (int local_rank = 0; local_rank < options_.nproc_per_node; ++local_rank) {
      try {
        ranks_.push_back(start_rank(options_, local_rank, restart_count_, secret_file()));
      } catch (const std::exception& e) {
        write_all(STDERR_FILENO,
                  fmt::format("distrun: cannot start rank {}: {}\n",
                              options_.node_rank * options_.nproc_per_node + local_rank, e.what()));
        on_failure(1);
        return;
      }
    }
  }

  std::string secret_file() const { return secret_ ? secret_->path() : options_.rpc_secret_file; }

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
      if (!rank.running || !reap_if_exited(rank)) continue;
      if (rank.waited && rank.status == 0) continue;
      if (rank.waited && may_restart_alone(options_, rank.rank, rank.restart_count, stopping())) {
        write_all(STDERR_FILENO, failure_notice(rank));
        rank.replaced = true;
        to_restart.push_back(i);
        continue;
      }
      // Once another node ended the round, the local ranks' ends are its consequences.
      if (first_failure_.rank < 0 && !ended_elsewhere_) {
        first_failure_.rank = rank.rank;
        note_ranks_named_by(first_failure_, rank, ranks_, options_);
      }
      write_all(STDERR_FILENO, failure_notice(rank));
      if (!rank.waited) {
        on_failure(1);
      } else if (WIFSIGNALED(rank.status)) {
        on_failure(128 + WTERMSIG(rank.status));
      } else {
        on_failure(WEXITSTATUS(rank.status));
      }
    }
    for (size_t i : to_restart) restart_alone(i);
  }

  // The job is stopping: a signal, a failure that ends it, or the round ended on another node.
  bool stopping() const { return received_signal_ != 0 || grace_deadline_ || ended_elsewhere_; }

  // Starts the failed run ranks_[index] again, alone, with its restart count one higher and the
  // same MASTER_PORT (or etcd job); the other ranks run on.
  void restart_alone(size_t index) {
    if (grace_deadline_) {
      // Another rank reaped in the same pass ended the job: this failure is reported, not undone.
      ranks_[index].replaced = false;
      return;
    }
    const int rank = ranks_[index].rank;
    const int local_rank = ranks_[index].local_rank;
    const int restart_count = ranks_[index].restart_count + 1;
    write_all(STDERR_FILENO, restart_alone_notice(options_, rank, restart_count));
    try {
      ranks_.push_back(start_rank(options_, local_rank, restart_count, secret_file()));
    } catch (const std::exception& e) {
      write_all(STDERR_FILENO, fmt::format("distrun: cannot start rank {}: {}\n", rank, e.what()));
      if (first_failure_.rank < 0) first_failure_.rank = rank;
      on_failure(1);
    }
  }

  bool restarted_alone() const {
    return std::any_of(ranks_.begin(), ranks_.end(), [](const auto& r) { return r.replaced; });
  }

  // A rank failed (or could not be started): the first failure sets the exit status and stops
  // the other ranks.
  void on_failure(int status) {
    if (ended_elsewhere_) return;
    if (first_failure_.status == 0) {
      first_failure_.status = status;
      // Published before the ranks are stopped, so that the other nodes, whose ranks fail in
      // turn, learn that this failure came first.
      if (coordinator_) coordinator_->publish_failure(first_failure_.rank, status);
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

  void signal_running(int signo) {
    for (auto& rank : ranks_) signal_run(rank, signo);
  }

  // The attempt that has just ended, as its summary tells it.
  std::string summary() const {
    return attempt_summary(options_, restart_count_, round_outcome_, ranks_, first_failure_);
  }

  JobEnd job_end(int status) const {
    JobEnd end;
    end.restart_count = restart_count_;
    end.exit_status = status;
    end.received_signal = received_signal_;
    end.coordinated = coordinator_ != nullptr;
    end.round = round_outcome_;
    end.coordination_error = coordination_error_;
    end.first_failure_rank = first_failure_.rank;
    return end;
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
  std::vector<RankProcess> ranks_;      // the attempt's runs, in the order they were started
  std::optional<Clock::time_point> grace_deadline_;
  bool killed_ = false;
  std::optional<Clock::time_point> drain_deadline_;
  int received_signal_ = 0;
  FirstFailure first_failure_;  // of the attempt
};

}  // namespace

int run(const LaunchOptions& options) {
  validate(options);
  Supervisor supervisor(resolve_rendezvous(options), options.master_port != 0);
  return supervisor.run();
}

}  // namespace launcher
}  // namespace distoptim
