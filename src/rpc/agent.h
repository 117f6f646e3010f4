#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>

#include <distoptim/comm/rendezvous.h>
#include <distoptim/rpc/api.h>

#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>

#include "executor.h"
#include "handshake.h"
#include "message.h"
#include "pending_calls.h"
#include "rref_context.h"
#include "transport/connection.h"

namespace distoptim {
namespace rpc {
namespace detail {

class Connection;
class Listener;

/// The agent behind the rpc API, on the library's own TCP transport (transport/connection.h).
///
/// Threads (docs/threading.md): one I/O thread (Asio: reads and writes frames, runs handshakes;
/// never blocks), `request_pool_` (runs incoming requests, any number of which may block on
/// nested calls), `completion_` (one thread: decodes responses and completes futures), the
/// pending calls' timer, `ordered_` (one thread: RRef control messages in the order they
/// arrive on their connection, and the RRef bookkeeping of a lost peer after them; never
/// blocks). One mutex, `mutex_`, guards the fields marked below; no future is completed and no
/// user code runs while it is held, and it is never taken before the RRef context's.
/// A request blocked in a nested wait gets a compensating pool thread, up to
/// max_extra_worker_threads of them (executor.h, docs/threading.md).
///
/// Connections: each worker opens one connection to each peer it calls (`outgoing_`) and
/// accepts the connections peers open to it (`incoming_`). Requests travel on the caller's
/// connection, replies come back on it. Every connection begins with the handshake
/// (handshake.h); until it has succeeded, calls for the peer wait in `Outgoing::held`, and
/// nothing a connecting peer sends is read but one small handshake frame. Accepted
/// connections still in their handshake (`unproven_`) are bounded in number and in time.
/// Requests received and not yet finished are bounded in bytes (options().inbound_queue_bytes):
/// past it, reading from callers pauses until they drain.
class Agent : public std::enable_shared_from_this<Agent> {
 public:
  Agent(const std::string& name, int rank, int world_size, const RpcBackendOptions& options);
  ~Agent();

  const WorkerInfo& self() const { return workers_[rank_]; }
  const std::vector<WorkerInfo>& workers() const { return workers_; }
  std::map<std::string, int64_t> debug_info();
  int resolve(const WorkerRef& to) const;

  /// Runs the interceptor over a request's arguments once its id is known; returns the metadata.
  using SendInterception = std::function<CallMetadata(uint64_t id, std::vector<c10::IValue>& args)>;
  /// Sends a request; RRefs among `args` are forked to `to`. `flags`: MessageHeader::kOrdered
  /// for RRef control messages. The interceptor sees the arguments of every request but control
  /// messages, unless `intercept` says otherwise.
  c10::intrusive_ptr<c10::ivalue::Future> send(int to, const std::string& function,
                                               std::vector<c10::IValue> args,
                                               std::chrono::milliseconds timeout,
                                               uint16_t flags = 0,
                                               SendInterception intercept = nullptr,
                                               bool waited_only = false);
  /// Runs the registered `callable` on the request pool of this worker; the future fails with a
  /// RemoteError naming this worker if it throws or is unknown. `prepare` (optional) runs first,
  /// on the same thread, and what it returns lives while the callable runs.
  using Preparation = std::function<std::shared_ptr<void>(std::vector<c10::IValue>& args)>;
  c10::intrusive_ptr<c10::ivalue::Future> run_locally(const std::string& callable,
                                                      std::vector<c10::IValue> args,
                                                      Preparation prepare = nullptr);
  /// `args` as a worker receives them from this one (encoded, decoded: copies, with the RRefs
  /// among them forked), for a call to this worker itself that must behave as to another.
  std::vector<c10::IValue> through_wire_to_self(const std::string& callable,
                                                const std::vector<c10::IValue>& args);
  std::chrono::milliseconds effective_timeout(std::chrono::milliseconds timeout) const {
    return timeout == kDefaultTimeout ? options_.rpc_timeout() : timeout;
  }
  RRefContext& rref_context() { return *rrefs_; }
  /// Whether the caller runs on one of this agent's threads that run user code: its request
  /// pool, its ordered thread or its completion thread.
  bool on_own_thread() const {
    const Executor* pool = Executor::current();
    return pool != nullptr &&
           (pool == request_pool_.get() || pool == ordered_.get() || pool == completion_.get());
  }
  /// Values still owned when the agent stopped (after a graceful shutdown: 0 unless leaked).
  size_t owned_at_stop() const { return owned_at_stop_; }
  void shutdown(bool graceful);

 private:
  enum class State { kRunning, kStopping, kStopped };
  struct Outgoing {
    std::shared_ptr<Connection> connection;  // null while connecting
    bool ready = false;                      // the handshake succeeded and `held` is written
    std::vector<EncodedMessage> held;        // messages sent before then, in order
    int attempts = 0;                        // connections tried so far
    std::string farewell;                    // why the peer said it closes, if it did
  };

  HandshakeConfig handshake_config() const;
  void start_listening();
  void exchange_addresses(const std::string& name);
  void on_accepted(const std::shared_ptr<Connection>& connection);
  void on_caller_proven(const std::shared_ptr<Connection>& connection, int caller);
  void forget_incoming(const std::shared_ptr<Connection>& connection);
  /// Opens (or re-opens, after a connection lost during its handshake) the connection to `peer`.
  void connect_to(int peer);
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
  void request_done(size_t bytes);
  void discard_rrefs(const std::vector<c10::IValue>& values);
  void handle_request(const std::shared_ptr<Connection>& connection, int caller,
                      const MessageHeader& header, const std::string& body,
                      std::vector<at::Tensor> buffers);
  void reply(const std::shared_ptr<Connection>& connection, uint64_t id, int caller,
             const std::string& callable, const c10::ivalue::Future& result);
  void handle_reply(int peer, const MessageHeader& header, const std::string& body,
                    std::vector<at::Tensor> buffers);
  void lose_peer(int peer, const std::string& why);
  void on_calls_expired(std::vector<PendingCall> expired);
  void fail_calls(std::vector<PendingCall> calls,
                  std::function<std::exception_ptr(const PendingCall&)> make_error);
  void barrier(const std::string& round, bool wait = true);
  // A peer died or stopped: its forks are released and the interceptor is told. On the ordered
  // thread, after the control messages the peer sent before.
  void on_peer_gone(int peer);
  void stop();

  const int rank_;
  const int world_size_;
  const RpcBackendOptions options_;
  const WireLimits limits_;
  comm::Rendezvous rendezvous_;
  std::vector<WorkerInfo> workers_;
  std::unordered_map<std::string, int> ids_by_name_;
  std::vector<std::pair<std::string, int>> addresses_;  // each worker's (IP, port), by id

  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> io_work_;
  std::thread io_thread_;
  std::shared_ptr<Listener> listener_;

  std::mutex mutex_;
  std::condition_variable idle_;                       // signalled when in_flight_requests_ drops
  State state_ = State::kRunning;                      // guarded by mutex_
  std::unordered_map<int, Outgoing> outgoing_;         // guarded by mutex_
  std::vector<std::shared_ptr<Connection>> incoming_;  // guarded by mutex_
  std::deque<std::shared_ptr<Connection>> unproven_;   // in handshake, oldest first; by mutex_
  std::map<int, std::string> lost_peers_;              // why each is lost; guarded by mutex_
  std::map<int, std::string> dead_peers_;  // lost other than by refusal; guarded by mutex_
  int in_flight_requests_ = 0;             // guarded by mutex_
  size_t inbound_bytes_ = 0;  // of requests received and not finished; guarded by mutex_
  std::vector<std::shared_ptr<Connection>> paused_;  // reading paused for it; by mutex_

  std::unique_ptr<PendingCalls> pending_;
  std::unique_ptr<RRefContext> rrefs_;
  size_t owned_at_stop_ = 0;

  std::unique_ptr<Executor> request_pool_;
  std::unique_ptr<Executor> ordered_;
  std::unique_ptr<Executor> completion_;
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
