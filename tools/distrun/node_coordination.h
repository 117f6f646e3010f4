#pragma once

// Restarts across nodes: the distruns of a job with --nnodes > 1 and --max-restarts > 0 meet in
// a store that node 0's distrun serves, and go through each round (attempt) of the job together.
// The coordinator's implementation (store_coordinator.cpp) lives in distrun's store module, with
// LibTorch's c10d; make_node_coordinator loads it (store_module.h).

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "distrun/options.h"

namespace distoptim {
namespace launcher {

/// A failure of the coordination between the nodes' distruns: a node that never joined a round,
/// or never reported the end of one, nodes that disagree on their options, a store that could
/// not be served or reached in time. The message names the nodes and the store.
class CoordinationError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// How a round ended, on one node or, once published, for every node alike.
struct RoundOutcome {
  enum class Kind { kSucceeded, kFailed, kStopped };
  Kind kind = Kind::kSucceeded;
  /// kFailed: the node whose failure ended the round. kStopped: the node whose distrun got
  /// SIGINT or SIGTERM.
  int node = -1;
  /// kFailed: that node's first failing rank (-1: a rank could not be started) and its exit
  /// status (128 + the signal that killed it).
  int rank = -1;
  int status = 0;
  /// kStopped: the signal.
  int signal = 0;

  static RoundOutcome succeeded(int node);
  static RoundOutcome failed(int node, int rank, int status);
  static RoundOutcome stopped(int node, int signal);
  /// "node 1's rank 3 failed with status 3", "node 0's distrun got SIGTERM", ...
  std::string describe() const;
};

/// One node's side of the coordination; the supervisor of that node drives it round by round.
///
/// The store: a comm::StoreServer that node 0's distrun serves on --master-port (on every
/// address of node 0; a node whose link goes down in the middle of a query stops no other node's
/// queries), reached at --master-addr with c10d's TCPStore client; every operation goes through
/// comm::DeadlineStore, so none waits longer than kAnswerTimeout for an answer. The ranks never
/// use it: each round gets a MASTER_PORT of its own, which node 0 picks free on node 0 and
/// publishes.
///
/// Keys: `claim/N` (node N's distrun, once per job), `round/K/node/N` (node N joined round K,
/// with its options), `round/K/port`, `round/K/failure` (the first failure published in round K:
/// node, rank, status), `round/K/done/N` (node N's ranks all exited 0), `beat/N` (a counter node
/// N's distrun raises while it runs, see beat()), `stop` (the first
/// distrun that got SIGINT or SIGTERM, and the signal), `left/N` (node N knows how the job
/// ended; node 0 waits for these before it stops serving the store).
///
/// A node that cannot reach the store (its link is down, node 0 not up yet) connects again
/// every kRetryInterval within the waits of join_round and finish_round, which end at
/// --rdzv-timeout: a node whose link comes back in time joins the next round.
///
/// Not thread-safe: one thread (the supervisor's) calls it. Blocking: as each method says.
class NodeCoordinator {
 public:
  virtual ~NodeCoordinator() = default;

  /// Returns the signal (SIGINT or SIGTERM) distrun has received so far, or 0; called between
  /// the tries of the blocking waits, which give up on a signal.
  using SignalCheck = std::function<int()>;

  /// How long one store operation may wait for its answer.
  static constexpr std::chrono::milliseconds kAnswerTimeout{2000};
  /// How often the waits ask the store again, or try to reach it again.
  static constexpr std::chrono::milliseconds kRetryInterval{100};
  /// How often a distrun raises its beat counter (beat()).
  static constexpr std::chrono::milliseconds kBeatInterval{500};
  /// How long node 0 keeps serving the store at the end for the other nodes to learn how the job
  /// ended.
  static constexpr std::chrono::milliseconds kLeaveTimeout{5000};

  /// What join_round found: the ranks' MASTER_PORT for the round, or that a distrun stopped the
  /// job (this one when `signal_check` returned a signal, which is then published).
  struct Joined {
    int master_port = 0;
    std::optional<RoundOutcome> stopped;
  };

  /// Joins round `round` (0, 1, ... in order): publishes this node's options, node 0 the round's
  /// port, then waits until every node has joined. Throws CoordinationError naming the nodes that
  /// never joined within --rdzv-timeout (or the store, if it could never be reached), a node
  /// whose options differ from node 0's (every node throws the same), or a node rank claimed by
  /// two distruns. In a round after the first, a node that never joined and whose beat never
  /// moved during the wait is named as lost: its distrun died or is cut off.
  virtual Joined join_round(int round, const SignalCheck& signal_check) = 0;

  /// While the ranks run: whether the round has already ended elsewhere (another node's failure,
  /// or a distrun that got a signal). Never throws; asks the store at most every
  /// kRetryInterval (returning nullopt in between) and waits at most kAnswerTimeout. After the
  /// store failed to answer, it reports it on stderr and stops asking for the rest of the round.
  virtual std::optional<RoundOutcome> poll_round() = 0;

  /// A local rank failed first on this node: publishes it as the round's failure, unless one was
  /// published already (then that one stands) or the store was lost this round (finish_round
  /// publishes it once it is back). Never throws; waits at most kAnswerTimeout.
  virtual void publish_failure(int rank, int status) = 0;

  /// This distrun got `signal`: publishes that the job stops, unless a stop was published
  /// already. Best effort: never throws, waits at most kAnswerTimeout, does not retry.
  virtual void publish_stop(int signal) = 0;

  /// Once every local rank of the round has ended with `local` (kind, rank, status, signal of
  /// this node): the round's outcome for every node. A success waits until every node's ranks
  /// succeeded or one failed; a failure is published (if not yet) and the first published one
  /// returned; a stop returns at once. Throws CoordinationError naming the nodes that did not
  /// report within --rdzv-timeout (or the store it could not reach), and for each whether its
  /// distrun is lost (its beat never moved during the wait) or still answers.
  virtual RoundOutcome finish_round(const RoundOutcome& local, const SignalCheck& signal_check) = 0;

  /// While the local ranks run: tells the other nodes that this distrun is alive, by raising
  /// `beat/N` at most every kBeatInterval (the blocking waits do it too). Never throws; waits at
  /// most kAnswerTimeout; does nothing while the store is lost.
  virtual void beat() = 0;

  /// At the end of the job (also after a CoordinationError): the other nodes tell node 0 that
  /// they know how it ended (best effort); node 0 waits up to kLeaveTimeout for every node that
  /// ever joined, except those found lost, before returning, as the store goes away with it.
  virtual void leave() = 0;
};

/// `options`: validated, with nnodes > 1, master_addr and master_port given. Node 0 starts
/// serving the store at once (CoordinationError if it cannot, e.g. the port is taken); the
/// other nodes connect in join_round. Loads distrun's store module on first use
/// (CoordinationError naming the module if it cannot).
std::unique_ptr<NodeCoordinator> make_node_coordinator(const LaunchOptions& options);

}  // namespace launcher
}  // namespace distoptim
