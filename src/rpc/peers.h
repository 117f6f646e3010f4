#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <asio/steady_timer.hpp>

#include "handshake.h"
#include "message.h"
#include "refusal_log.h"
#include "transport/connection.h"
#include "transport/io_loop.h"
#include "transport/listener.h"
#include "worker_table.h"

namespace distoptim {
namespace rpc {
namespace detail {

/// What Peers hands up: every callback runs on the I/O thread (on_peer_lost also on the thread
/// that stops Peers) and must not block.
struct PeerEvents {
  /// A request frame (or a farewell) from `caller`, on the connection it opened and proved.
  /// Returns whether to go on reading that connection; false pauses it until resume_reading().
  std::function<bool(const std::shared_ptr<Connection>& connection, int caller, Frame frame)>
      on_request;
  /// A reply frame from `peer`, on the connection this worker opened to it.
  std::function<void(int peer, Frame frame)> on_reply;
  /// The connection `caller` opened to this worker closed: it died or stopped.
  std::function<void(int caller)> on_caller_gone;
  /// `caller` proved itself on a connection it opened to this worker (each time it connects).
  std::function<void(int caller)> on_caller_proven;
  /// The connection to `peer` is lost for good (`why`); messages sent to it are dropped.
  std::function<void(int peer, const std::string& why)> on_peer_lost;
};

/// A worker's connections to the other workers of its group, on the library's transport
/// (transport/connection.h: TCP, or a Unix-domain socket to a worker on the same host): the I/O
/// thread, the listener, one connection to each peer this worker calls, opened on first use, and
/// the connections peers open to it. Knows nothing of calls, requests or RRefs: it moves frames and
/// says when a peer is lost.
///
/// Connecting side: with `unix_sockets`, a connection to a peer first tries the Unix-domain
/// socket named after its address (the name exists only on the peer's host), and takes TCP if
/// nothing listens there, or if whoever does fails the handshake; then the peer is reached over
/// TCP from then on. Every connection begins with the handshake (handshake.h); until it has
/// succeeded, messages for the peer wait in order, then go in the order they were sent. A
/// connection lost before its handshake ends is tried again a few times (the peer's listener was
/// busy, or it evicted us among stalled connections); a refusal, or a loss after the handshake,
/// loses the peer for good. A peer lost other than by refusal counts as dead.
///
/// Accepting side: nothing a connecting peer sends is read but one small handshake frame until it
/// has proven itself; connections still in their handshake are bounded in number (the workers
/// known + kExtraUnprovenConnections, the oldest evicted past that) and in time (the handshake
/// timeout). A proven worker id has one connection here at a time (admit_caller). All accepted
/// connections still holding a descriptor, including those closing after a refusal and, in a
/// dynamic group, those proving ids of no known member, are bounded by
/// max_accepted_connections(workers known): past it the oldest that is not a known member's
/// proven connection is closed at once. Replies to a caller go on the connection it opened
/// (Connection::send).
///
/// Receiving, once proven (both sides): frames larger than ReceiveBudget::kUnreservedBytes are
/// read only within one budget of `receive_budget_bytes` shared by all connections (a connection
/// waits, reading nothing, until its frame fits), and a frame none of whose bytes arrived for
/// `frame_stall_timeout` closes its connection (checked every quarter of it, logged at a bounded
/// rate).
///
/// Threading: one mutex guards the tables below; no callback runs while it is held. Lock order:
/// a caller's own lock may be held around send() (the agent sends under its lock so that calls
/// reach a connection in the order they were made); Peers never calls up while holding its lock.
class Peers {
 public:
  /// Starts the I/O thread and listens on `address` (an IP address), port chosen by the system,
  /// and with `unix_sockets` on the Unix-domain socket named after it, and connects to peers
  /// through theirs when they are on this host. Throws DistributedError if it cannot listen.
  Peers(const std::string& address, WireLimits limits, size_t receive_budget_bytes,
        std::chrono::milliseconds frame_stall_timeout, bool unix_sockets);
  ~Peers();
  Peers(const Peers&) = delete;
  Peers& operator=(const Peers&) = delete;

  const std::string& listen_address() const;
  int listen_port() const;

  /// Once the workers' addresses are known: accepts connections from now on (they waited in the
  /// backlog) and hands frames to `events`. `workers` says where each worker listens (read when a
  /// connection to it opens; a dynamic group's table grows meanwhile) and which ids a connecting
  /// peer may prove; it outlives this object.
  void start(HandshakeConfig handshake, const WorkerTable& workers, PeerEvents events);

  /// Sends `message` to `peer` after those sent before it, opening the connection on first use.
  /// Returns why the peer is lost if it is (nothing is sent then), else nothing.
  std::optional<std::string> send(int peer, EncodedMessage message);
  /// Runs `handler` on the I/O loop (as a handler of it: io_loop.h), unless the loop stops first.
  void run_on_loop(std::function<void()> handler);
  /// Drops a message to `peer` not yet written, by its header id (a call that timed out).
  void drop_queued(int peer, uint64_t id);
  /// Closes the connection to `peer` and counts it as lost (why); on_peer_lost runs.
  void lose(int peer, const std::string& why);
  /// Peers lost other than by refusal, with why.
  std::map<int, std::string> dead_peers();
  /// Whether `peer` refused this worker's connection in its handshake (it is alive).
  bool refused_us(int peer);
  /// Waits until every open connection has written what was sent on it (replies included), or
  /// `deadline` passes: a worker leaving a dynamic group flushes its last replies before it
  /// closes its connections.
  void wait_writes_done(std::chrono::steady_clock::time_point deadline);
  /// "connections", "connections.accepted", "unix_socket.connections", "peer_memory.connections",
  /// "peer_memory.bytes_read", "receive_budget.reserved_bytes" (rpc::get_debug_info).
  std::map<std::string, int64_t> debug_info();
  /// Closes every connection and the listener and stops the I/O loop: no callback runs after.
  /// Messages not yet written are dropped. Idempotent.
  void stop();
  /// After stop(): waits for the requests still running on the I/O loop's threads (a request
  /// runs on the thread that read it, io_loop.h). Call it once the calls they may wait for are
  /// failed.
  void join();

  /// Accepted connections whose peer has not proven itself yet, beyond one per worker.
  static constexpr size_t kExtraUnprovenConnections = 64;
  /// Accepted connections closing (a refusal or a protocol error being told) beyond those.
  static constexpr size_t kExtraClosingConnections = 64;
  /// Accepted connections holding a descriptor at once: one proven per worker, the unproven, and
  /// the closing.
  static size_t max_accepted_connections(size_t known_workers) {
    return 2 * known_workers + kExtraUnprovenConnections + kExtraClosingConnections;
  }
  /// Stall checks per frame_stall_timeout.
  static constexpr int kStallChecks = 4;
  /// Connection attempts to a peer lost before its handshake ends, before it counts as lost.
  /// Threads taking turns at the I/O loop: the leader and one follower, enough for one request
  /// at a time to run on the thread that read it (more wait on the request pool).
  static constexpr int kIoLoopThreads = 2;
  static constexpr int kConnectAttempts = 5;
  static constexpr std::chrono::milliseconds kReconnectDelay{100};

 private:
  struct Outgoing {
    std::shared_ptr<Connection> connection;  // null while connecting
    bool ready = false;                      // the handshake succeeded and `held` is written
    std::vector<EncodedMessage> held;        // messages sent before then, in order
    int attempts = 0;                        // connections tried so far
    bool tcp_only = false;                   // its Unix name failed the handshake: TCP
    std::string farewell;                    // why the peer said it closes, if it did
  };

  void on_accepted(const std::shared_ptr<Connection>& connection);
  void on_caller_proven(const std::shared_ptr<Connection>& connection, int caller);
  void forget_incoming(const std::shared_ptr<Connection>& connection);
  /// Accepting side: the oldest accepted connections that are no known member's proven one, while
  /// more than max_accepted_connections() hold a descriptor, removed from accepted_ for the caller
  /// to close; mutex_ held.
  std::vector<std::shared_ptr<Connection>> over_accepted_locked(const WorkerTable::Snapshot& table);
  /// Closes connections whose frame stopped arriving, then checks again after a quarter of
  /// frame_stall_timeout.
  void check_stalls();
  /// HandshakeConfig::admit: one live connection per proven worker id.
  std::optional<std::string> admit_caller(const Connection* connection, int caller);
  /// Whether `connection` held `caller`'s identity here; it no longer does.
  bool release_caller(const Connection* connection, int caller);
  /// Connecting side: opens a connection to `peer` once its member key is known.
  void connect_to(int peer);
  void open_connection(int peer, const std::string& host, int port);
  void on_connected(int peer, const std::shared_ptr<Connection>& connection);
  void on_outgoing_lost(int peer, const std::shared_ptr<Connection>& connection,
                        const std::string& why, bool refused);
  bool on_request_frame(const std::shared_ptr<Connection>& connection, int caller, Frame frame);
  bool on_reply_frame(const std::shared_ptr<Connection>& connection, int peer, Frame frame);
  void protocol_error(const std::shared_ptr<Connection>& connection, const std::string& why);
  /// The message that tells a peer why we close its connection (logged here too).
  EncodedMessage farewell(Connection* connection, const std::string& why);
  /// Logs the reason a peer gave for closing a connection, and returns it.
  std::string log_farewell(const Frame& frame);

  const WireLimits limits_;
  const std::chrono::milliseconds stall_timeout_;
  const bool unix_sockets_;
  const std::shared_ptr<ReceiveBudget> budget_;
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> io_work_;
  // The I/O thread: two threads that take turns (io_loop.h), so that a request can run on the
  // one that read it while the other goes on with the loop.
  std::unique_ptr<IoLoop> io_loop_;
  std::shared_ptr<Listener> listener_;
  asio::steady_timer stall_check_;  // I/O thread only
  // Connections this worker closes (a stalled frame, a protocol error), logged at a bounded rate:
  // a proven peer that reconnects and misbehaves in a loop must not fill the log. Set by start().
  std::unique_ptr<RefusalLog> closures_;
  // Set by start(), then read-only.
  HandshakeConfig handshake_;
  const WorkerTable* workers_ = nullptr;
  PeerEvents events_;

  std::mutex mutex_;
  bool stopped_ = false;                               // guarded by mutex_
  std::unordered_map<int, Outgoing> outgoing_;         // guarded by mutex_
  std::vector<std::shared_ptr<Connection>> incoming_;  // guarded by mutex_
  std::deque<std::shared_ptr<Connection>> unproven_;   // in handshake, oldest first; by mutex_
  // Every accepted connection that may still hold a descriptor, oldest first: those open and
  // those closing after a refusal or a farewell (which incoming_ no longer lists). Pruned of
  // closed ones at each accept. Guarded by mutex_.
  std::deque<std::shared_ptr<Connection>> accepted_;
  std::map<int, std::string> lost_;  // why each is lost; guarded by mutex_
  std::map<int, std::string> dead_;  // lost other than by refusal; guarded by mutex_
  std::set<int> refused_;            // lost by refusal; guarded by mutex_
  // The one proven incoming connection of each caller id: a second proof of an id whose
  // connection is open is refused, and only that connection's end means the caller is gone.
  std::unordered_map<int, const Connection*> callers_;  // guarded by mutex_
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
