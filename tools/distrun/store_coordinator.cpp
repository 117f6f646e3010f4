// distrun's store module: the parts of the launcher that use LibTorch's c10d through the comm
// layer, loaded by store_module.cpp only when a job needs them. Here the coordination of the
// nodes' distruns across restarts (StoreCoordinator, node_coordination.h says how), the check of
// an etcd endpoint as the ranks' store makes it, and the module's two entry points.

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include <c10/util/Logging.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <distoptim/comm/etcd_store.h>
#include <distoptim/comm/rendezvous.h>
#include <distoptim/comm/store_round.h>
#include <distoptim/comm/store_server.h>
#include <distoptim/comm/store_wait.h>

#include "distrun/node_coordination.h"
#include "distrun/options.h"
#include "distrun/signals_fds.h"

namespace distoptim {
namespace launcher {

using Clock = std::chrono::steady_clock;

namespace {

// How long one try to connect to node 0's store may take, so that the waits still see signals
// and their deadline while node 0 is unreachable.
constexpr auto kConnectTimeout = std::chrono::milliseconds(2000);
// The receive timeout of a store connection: an operation DeadlineStore abandoned at its
// deadline ends on its thread by then, even if the answer never comes.
constexpr auto kSocketTimeout = std::chrono::milliseconds(5000);
constexpr const char* kStopKey = "stop";

std::vector<uint8_t> to_bytes(const std::string& text) { return {text.begin(), text.end()}; }

std::string from_bytes(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }

std::string seconds_text(double seconds) { return fmt::format("{:g} s", seconds); }

// A record of whole numbers separated by spaces ("1 3 143"), as the keys hold them.
std::vector<int64_t> parse_numbers(const std::string& text, size_t count, const std::string& key) {
  std::istringstream in(text);
  std::vector<int64_t> numbers(count);
  for (auto& n : numbers) in >> n;
  if (in.fail() || !(in >> std::ws).eof()) {
    throw CoordinationError(
        fmt::format("the launchers' store holds '{}' under '{}'; expected {} "
                    "numbers (is another program using the port?)",
                    text, key, count));
  }
  return numbers;
}

std::string round_key(int round, const std::string& what) {
  return fmt::format("round/{}/{}", round, what);
}

std::string node_list(const std::vector<int>& nodes) {
  return fmt::format("{}", fmt::join(nodes, ", "));
}

class StoreCoordinator final : public NodeCoordinator {
 public:
  explicit StoreCoordinator(const LaunchOptions& options)
      : options_(options),
        address_(fmt::format("{}:{}",
                             options.master_addr.find(':') == std::string::npos
                                 ? options.master_addr
                                 : "[" + options.master_addr + "]",
                             options.master_port)),
        timeout_(std::chrono::duration_cast<Clock::duration>(
            std::chrono::duration<double>(options.rdzv_timeout_seconds))) {
    // c10d logs every failed try to connect (through glog): a node waiting for node 0, or whose
    // link is down, would print ten lines a second. distrun says itself what went wrong.
    FLAGS_minloglevel = google::GLOG_FATAL;
    if (options_.node_rank != 0) return;
    // The server listens on every address of node 0; its own client stays on loopback, which no
    // link going down can cut. It is ours, not LibTorch's: LibTorch's stops for every client
    // while one client's query is half-way (a node whose link went down between two writes).
    comm::StoreServerOptions server_options;
    server_options.port = options_.master_port;
    try {
      server_ = std::make_unique<comm::StoreServer>(server_options);
    } catch (const std::exception& e) {
      throw CoordinationError(
          fmt::format("node 0 cannot serve the launchers' store on port {} (--master-port): {}",
                      options_.master_port, what_of(e)));
    }
  }

  Joined join_round(int round, const SignalCheck& signal_check) override {
    round_ = round;
    lost_in_round_ = false;
    seen_.reset();
    beats_.clear();
    local_published_ = false;
    const auto deadline = Clock::now() + timeout_;
    const std::string mine =
        fmt::format("{} {} {}", options_.nnodes, options_.nproc_per_node, options_.max_restarts);
    // Node 0 picks the round's port once, so a retried publication cannot change it.
    const int port = options_.node_rank == 0 ? fresh_port(last_port_, true) : 0;
    bool joined = false;
    std::vector<int> missing;
    while (true) {
      if (const int signo = signal_check()) {
        publish_stop(signo);
        return {0, RoundOutcome::stopped(options_.node_rank, signo)};
      }
      if (connected(deadline)) {
        try {
          if (!joined) {
            if (round == 0) claim_node_rank();
            if (options_.node_rank == 0) {
              store_->set(round_key(round, "port"), to_bytes(std::to_string(port)));
            }
            store_->set(round_key(round, "node/" + std::to_string(options_.node_rank)),
                        to_bytes(mine));
            joined = true;
          }
          if (auto stop = published_stop()) return {0, stop};
          beat_now();
          missing = nodes_without(round_key(round, "node/"));
          if (round > 0) watch_beats(missing);
          if (missing.empty() && store_->check({round_key(round, "port")})) {
            check_options_agree(round);
            const std::string port_key = round_key(round, "port");
            last_port_ =
                static_cast<int>(parse_numbers(from_bytes(store_->get(port_key)), 1, port_key)[0]);
            return {last_port_, std::nullopt};
          }
        } catch (const c10::Error& e) {
          drop_connection(e);
        }
      }
      if (Clock::now() >= deadline) {
        if (!store_ || !joined) throw unreachable("join round " + std::to_string(round));
        if (round > 0) {
          // Every node took part in the previous round (it started only once all had joined).
          throw CoordinationError(fmt::format(
              "round {}: waited {} (--rdzv-timeout) for the nodes of round {} to join it; {}{}",
              round, seconds_text(options_.rdzv_timeout_seconds), round - 1,
              never_arrived_text(missing), liveness(missing)));
        }
        throw CoordinationError(fmt::format(
            "round {}: waited {} (--rdzv-timeout) for every node to join; {}; every node's "
            "distrun must be started with the same --nnodes, --master-addr and --master-port",
            round, seconds_text(options_.rdzv_timeout_seconds), never_arrived_text(missing)));
      }
      std::this_thread::sleep_for(kRetryInterval);
    }
  }

  std::optional<RoundOutcome> poll_round() override {
    if (seen_) return seen_;
    if (lost_in_round_ || !store_) return std::nullopt;
    const auto now = Clock::now();
    if (now < next_poll_) return std::nullopt;
    next_poll_ = now + kRetryInterval;
    try {
      if (auto stop = published_stop()) {
        seen_ = stop;
      } else if (store_->check({round_key(round_, "failure")})) {
        seen_ = published_failure();
      }
    } catch (const std::exception& e) {
      lost_in_round_ = true;
      drop_connection(e);
    }
    return seen_;
  }

  void publish_failure(int rank, int status) override {
    if (local_published_ || lost_in_round_ || !store_) return;
    try {
      seen_ = publish_local_failure(rank, status);
    } catch (const std::exception& e) {
      lost_in_round_ = true;
      drop_connection(e);
    }
  }

  void publish_stop(int signo) override {
    if (stop_published_) return;
    stop_published_ = true;
    if (!connected(Clock::now())) return;
    try {
      store_->compareSet(kStopKey, {}, to_bytes(fmt::format("{} {}", options_.node_rank, signo)));
    } catch (const std::exception& e) {
      drop_connection(e);
    }
  }

  RoundOutcome finish_round(const RoundOutcome& local, const SignalCheck& signal_check) override {
    if (local.kind == RoundOutcome::Kind::kStopped) {
      publish_stop(local.signal);
      return local;
    }
    if (seen_) return *seen_;
    beats_.clear();
    const auto deadline = Clock::now() + timeout_;
    std::vector<int> missing;
    while (true) {
      if (const int signo = signal_check()) {
        publish_stop(signo);
        return RoundOutcome::stopped(options_.node_rank, signo);
      }
      if (connected(deadline)) {
        try {
          if (local.kind == RoundOutcome::Kind::kFailed && !local_published_) {
            return publish_local_failure(local.rank, local.status);
          }
          if (local.kind == RoundOutcome::Kind::kSucceeded && !local_published_) {
            store_->set(round_key(round_, "done/" + std::to_string(options_.node_rank)),
                        to_bytes("1"));
            local_published_ = true;
          }
          if (auto stop = published_stop()) return *stop;
          if (store_->check({round_key(round_, "failure")})) return published_failure();
          beat_now();
          missing = nodes_without(round_key(round_, "done/"));
          watch_beats(missing);
          if (missing.empty()) return RoundOutcome::succeeded(options_.node_rank);
        } catch (const c10::Error& e) {
          drop_connection(e);
        }
      }
      if (Clock::now() >= deadline) {
        if (!store_) throw unreachable("report the end of round " + std::to_string(round_));
        throw CoordinationError(fmt::format(
            "round {}: the ranks of this node ({}) ended with status 0, then it waited {} "
            "(--rdzv-timeout) for every node to finish or fail; {}{}",
            round_, options_.node_rank, seconds_text(options_.rdzv_timeout_seconds),
            never_arrived_text(missing), liveness(missing)));
      }
      std::this_thread::sleep_for(kRetryInterval);
    }
  }

  void beat() override {
    if (lost_in_round_ || !store_) return;
    try {
      beat_now();
    } catch (const std::exception& e) {
      lost_in_round_ = true;
      drop_connection(e);
    }
  }

  void leave() override {
    if (options_.node_rank != 0) {
      if (!connected(Clock::now())) return;
      try {
        job_round().leave(Clock::now() + kAnswerTimeout);
      } catch (const c10::Error& e) {
        drop_connection(e);
      }
      return;
    }
    const auto deadline = Clock::now() + kLeaveTimeout;
    while (Clock::now() < deadline && connected(deadline)) {
      try {
        // Only nodes that ever came (claimed their node rank): one that never joined will not
        // read anything.
        auto waiting = job_round().ranks_not_left(Clock::now() + kAnswerTimeout);
        waiting.erase(std::remove_if(waiting.begin(), waiting.end(),
                                     [this](int node) { return lost_nodes_.count(node) > 0; }),
                      waiting.end());
        if (waiting.empty()) return;
      } catch (const c10::Error& e) {
        drop_connection(e);
      }
      std::this_thread::sleep_for(kRetryInterval);
    }
  }

 private:
  static std::string what_of(const std::exception& e) {
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    return error != nullptr ? error->what_without_backtrace() : e.what();
  }

  // Whether there is a connection to the store, making one if needed (node 0 connects to its
  // own server over loopback). One try, bounded by kConnectTimeout and by `deadline` (but at
  // least 1 s), so a caller that loops sees signals and its deadline in between.
  bool connected(Clock::time_point deadline) {
    if (store_) return true;
    const std::string host = options_.node_rank == 0 ? "127.0.0.1" : options_.master_addr;
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<uint16_t>(options_.master_port);
    store_options.isServer = false;
    store_options.waitWorkers = false;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    // LibTorch 1.13's client times out at once when given less than a second.
    store_options.timeout = std::clamp(left, std::chrono::milliseconds(1000), kConnectTimeout);
    try {
      auto tcp = c10::make_intrusive<c10d::TCPStore>(host, store_options);
      auto store =
          c10::make_intrusive<comm::DeadlineStore>(std::move(tcp), address_, kAnswerTimeout);
      // TCPStore keeps the receive timeout of its last wait: after this one (for no keys,
      // answered at once) no receive blocks longer than kSocketTimeout.
      store->wait({}, kSocketTimeout);
      store_ = std::move(store);
    } catch (const std::exception& e) {
      last_error_ = what_of(e);
      return false;
    }
    if (lost_) {
      lost_ = false;
      write_all(STDERR_FILENO,
                fmt::format("distrun: node {} reached the launchers' store at {} again\n",
                            options_.node_rank, address_));
    }
    return true;
  }

  // The store failed to answer: forget the connection (an operation still waiting on it keeps it
  // until its receive times out) and say so once until it is reached again.
  void drop_connection(const std::exception& e) {
    store_.reset();
    last_error_ = what_of(e);
    if (lost_) return;
    lost_ = true;
    write_all(STDERR_FILENO,
              fmt::format("distrun: node {} lost the launchers' store at {} in round {} ({}); it "
                          "keeps trying to reach it for up to {} (--rdzv-timeout) while it waits "
                          "for the other nodes\n",
                          options_.node_rank, address_, round_, last_error_,
                          seconds_text(options_.rdzv_timeout_seconds)));
  }

  CoordinationError unreachable(const std::string& what) const {
    return CoordinationError(fmt::format(
        "node {} could not reach the launchers' store at {} (served by node 0's distrun) to {} "
        "within {} (--rdzv-timeout): {}",
        options_.node_rank, address_, what, seconds_text(options_.rdzv_timeout_seconds),
        last_error_.empty() ? "no answer" : last_error_));
  }

  // Raises this node's beat counter, at most every kBeatInterval. Throws as the store does.
  void beat_now() {
    const auto now = Clock::now();
    if (now < next_beat_) return;
    next_beat_ = now + kBeatInterval;
    store_->add("beat/" + std::to_string(options_.node_rank), 1);
  }

  // Within a wait: reads the beat counter of each node in `nodes`, at most every kBeatInterval,
  // noting whether it moved since the wait began (its first reading). Throws as the store does.
  void watch_beats(const std::vector<int>& nodes) {
    const auto now = Clock::now();
    if (!beats_.empty() && now < next_watch_) return;
    next_watch_ = now + kBeatInterval;
    for (int node : nodes) {
      const int64_t value = store_->add("beat/" + std::to_string(node), 0);
      const auto [it, first] = beats_.try_emplace(node, Beat{value, false});
      if (!first && it->second.value != value) it->second = Beat{value, true};
    }
  }

  // "node 1", "nodes 1, 2".
  static std::string nodes_text(const std::vector<int>& nodes) {
    return fmt::format("node{} {}", nodes.size() > 1 ? "s" : "", node_list(nodes));
  }

  // At the end of a wait for `missing`: which of them are lost (their beat never moved during
  // the wait: the distrun died, or is cut off from the store) and which still answer. Remembers
  // the lost ones, so that leave() does not wait for them.
  std::string liveness(const std::vector<int>& missing) {
    std::vector<int> lost;
    std::vector<int> alive;
    for (int node : missing) {
      const auto it = beats_.find(node);
      if (it != beats_.end() && it->second.moved) {
        alive.push_back(node);
      } else {
        lost.push_back(node);
        lost_nodes_.insert(node);
      }
    }
    beats_.clear();
    // "its distrun is" for the one node waited for; "the distruns of nodes 1, 2 are" otherwise.
    const auto whose = [&](const std::vector<int>& nodes) {
      if (missing.size() == 1) return std::string("its distrun");
      return fmt::format("the distrun{} of {}", nodes.size() > 1 ? "s" : "", nodes_text(nodes));
    };
    std::string text;
    if (!lost.empty()) {
      text += fmt::format(": {} {} lost (died or cut off: no sign of life during the wait)",
                          whose(lost), lost.size() > 1 ? "are" : "is");
    }
    if (!alive.empty()) {
      text += fmt::format("{}{} still answer{}", text.empty() ? ": " : "; ", whose(alive),
                          alive.size() > 1 ? "" : "s");
    }
    return text;
  }

  // Node ranks are claimed once per job with a token of this process: a second distrun giving
  // the same --node-rank is refused (a retried claim finds its own token).
  void claim_node_rank() {
    const std::string key = "claim/" + std::to_string(options_.node_rank);
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    const std::string token = fmt::format("{} pid {}", host, ::getpid());
    const std::string holder = from_bytes(store_->compareSet(key, {}, to_bytes(token)));
    if (holder != token) {
      throw CoordinationError(fmt::format(
          "--node-rank {} is taken by another distrun ({}); each node's distrun needs its own",
          options_.node_rank, holder));
    }
  }

  // The nodes n for which `prefix + n` is not set: a phase of the job's round. The waits poll
  // it in loops of their own, as they outlive a connection to node 0's store and watch signals
  // and beats between polls.
  std::vector<int> nodes_without(const std::string& prefix) {
    return job_round().not_arrived(Clock::now() + kAnswerTimeout, prefix);
  }

  // The nodes missing from a wait, in the one wording of comm's rounds.
  static std::string never_arrived_text(const std::vector<int>& nodes) {
    return comm::never_arrived_text(nodes, [](int node) { return "node " + std::to_string(node); });
  }

  // The job as one round of the nodes: a node arrives when it claims its node rank, and leaves
  // once it knows how the job ended. Round failures are any node's (`round/K/failure`), so
  // node 0 publishes none through it.
  comm::StoreRound job_round() {
    return comm::StoreRound(*store_, comm::StoreRound::Keys{"claim/", "", "left/"},
                            options_.node_rank, options_.nnodes);
  }

  // Every node compares every node's options with node 0's, so all report the same node.
  void check_options_agree(int round) {
    const auto options_of = [&](int node) {
      const std::string key = round_key(round, "node/" + std::to_string(node));
      return parse_numbers(from_bytes(store_->get(key)), 3, key);
    };
    const auto text = [](const std::vector<int64_t>& o) {
      return fmt::format("--nnodes {} --nproc-per-node {} --max-restarts {}", o[0], o[1], o[2]);
    };
    const auto reference = options_of(0);
    for (int node = 1; node < options_.nnodes; ++node) {
      const auto other = options_of(node);
      if (other != reference) {
        throw CoordinationError(
            fmt::format("round {}: node {} has {}, node 0 has {}; every node must give the same",
                        round, node, text(other), text(reference)));
      }
    }
  }

  RoundOutcome publish_local_failure(int rank, int status) {
    const std::string key = round_key(round_, "failure");
    store_->compareSet(key, {},
                       to_bytes(fmt::format("{} {} {}", options_.node_rank, rank, status)));
    local_published_ = true;
    return published_failure();
  }

  RoundOutcome published_failure() {
    const std::string key = round_key(round_, "failure");
    const auto n = parse_numbers(from_bytes(store_->get(key)), 3, key);
    return RoundOutcome::failed(static_cast<int>(n[0]), static_cast<int>(n[1]),
                                static_cast<int>(n[2]));
  }

  std::optional<RoundOutcome> published_stop() {
    if (!store_->check({kStopKey})) return std::nullopt;
    const auto n = parse_numbers(from_bytes(store_->get(kStopKey)), 2, kStopKey);
    return RoundOutcome::stopped(static_cast<int>(n[0]), static_cast<int>(n[1]));
  }

  const LaunchOptions options_;
  const std::string address_;
  const Clock::duration timeout_;
  std::unique_ptr<comm::StoreServer> server_;      // node 0 only
  c10::intrusive_ptr<comm::DeadlineStore> store_;  // null while not connected
  bool lost_ = false;       // the store failed and has not been reached since
  std::string last_error_;  // the last failure to reach it or of an operation
  int round_ = 0;
  int last_port_ = 0;                 // node 0: the previous round's port
  bool lost_in_round_ = false;        // poll_round and publish_failure stopped asking this round
  std::optional<RoundOutcome> seen_;  // how this round ended, once known
  bool local_published_ = false;      // this node's failure or success of the round
  bool stop_published_ = false;
  Clock::time_point next_poll_{};
  Clock::time_point next_beat_{};
  Clock::time_point next_watch_{};
  // Within a wait: each missing node's beat counter at its first reading, and whether it moved.
  struct Beat {
    int64_t value = 0;
    bool moved = false;
  };
  std::map<int, Beat> beats_;
  std::set<int> lost_nodes_;  // found lost at the end of a wait
};

// The variable the launcher sets is the one the ranks' rendezvous reads.
static_assert(std::string_view(kRdzvInitMethodVariable) == comm::LaunchEnv::kInitMethodVariable);

}  // namespace

}  // namespace launcher
}  // namespace distoptim

// The module's entry points, which store_module.cpp calls: C names, so the loader finds them
// with dlsym; no exception leaves them.
using distoptim::launcher::LaunchOptions;
using distoptim::launcher::NodeCoordinator;
using distoptim::launcher::StoreCoordinator;

extern "C" NodeCoordinator* distrun_store_module_coordinator(const LaunchOptions* options,
                                                             std::string* error) {
  try {
    return new StoreCoordinator(*options);
  } catch (const c10::Error& e) {
    *error = e.what_without_backtrace();
    return nullptr;
  } catch (const std::exception& e) {
    *error = e.what();
    return nullptr;
  }
}

extern "C" void distrun_store_module_check_etcd_endpoint(const std::string* endpoint,
                                                         std::string* error) {
  try {
    // As the ranks' store checks it, without contacting etcd.
    distoptim::comm::EtcdStore store(distoptim::comm::EtcdStoreOptions(*endpoint, "distrun"));
  } catch (const c10::Error& e) {
    *error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    *error = e.what();
  }
}
