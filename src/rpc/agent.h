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

#include "executor.h"
#include "message.h"
#include "rref_context.h"

namespace tensorpipe {
class Context;
class Listener;
class Pipe;
class Error;
}  // namespace tensorpipe

namespace distoptim {
namespace rpc {
namespace detail {

/// The TensorPipe agent behind the rpc API.
///
/// Threads: TensorPipe's event loops (I/O only: they decode headers, allocate buffers and post
/// work), `request_pool_` (runs incoming requests, any number of which may block on nested
/// calls), `completion_` (one thread: decodes responses and completes futures), `timer_` (fails
/// calls past their deadline), `ordered_` (one thread: RRef control messages, in the order they
/// arrive on their pipe; never blocks). One mutex, `mutex_`, guards the fields marked below; no
/// future is completed and no user code runs while it is held, and it is never taken before
/// the RRef context's. Every pending call completes exactly once:
/// whoever erases it from `pending_` (response, timeout, lost peer, shutdown) completes it.
/// A request blocked in a nested wait gets a compensating pool thread, up to
/// max_extra_worker_threads of them (executor.h, docs/threading.md).
///
/// Pipes: each worker opens one pipe to each peer it calls (`outgoing_`) and accepts the pipes
/// peers open to it (`incoming_`). Requests travel on the caller's pipe, replies come back on it.
/// Every pipe begins with the handshake (agent.cpp); until it has succeeded, messages for the
/// peer wait in `Outgoing::held`, and nothing a connecting peer sends is read but its proof.
/// Accepted pipes still waiting for a proof (`unproven_`) are bounded in number.
class Agent : public std::enable_shared_from_this<Agent> {
 public:
  Agent(const std::string& name, int rank, int world_size, const RpcBackendOptions& options);
  ~Agent();

  const WorkerInfo& self() const { return workers_[rank_]; }
  const std::vector<WorkerInfo>& workers() const { return workers_; }
  int resolve(const WorkerRef& to) const;

  /// Sends a request; RRefs among `args` are forked to `to`. `flags`: MessageHeader::kOrdered
  /// for RRef control messages.
  c10::intrusive_ptr<c10::ivalue::Future> send(int to, const std::string& function,
                                               std::vector<c10::IValue> args,
                                               std::chrono::milliseconds timeout,
                                               uint16_t flags = 0);
  /// Runs the registered `callable` on the request pool of this worker; the future fails with a
  /// RemoteError naming this worker if it throws or is unknown.
  c10::intrusive_ptr<c10::ivalue::Future> run_locally(const std::string& callable,
                                                      std::vector<c10::IValue> args);
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
  struct PendingCall {
    c10::intrusive_ptr<c10::ivalue::Future> future;
    int to = -1;
    std::string function;
    std::chrono::steady_clock::time_point deadline;
    bool has_deadline = false;
  };
  enum class State { kRunning, kStopping, kStopped };
  struct Outgoing {
    std::shared_ptr<tensorpipe::Pipe> pipe;
    bool ready = false;                // the handshake succeeded and `held` is written
    std::vector<EncodedMessage> held;  // messages sent before then, in order
  };
  /// Called with the handshake message, or with what went wrong: `pipe_failed` when the pipe
  /// itself failed (the peer went away), else the peer sent something that is not a handshake.
  using HandshakeCallback =
      std::function<void(Status failure, bool pipe_failed, HandshakeMessage message)>;

  void start_listening();
  void exchange_addresses(const std::string& name);
  void accept_next();
  void read_handshake(const std::shared_ptr<tensorpipe::Pipe>& pipe, HandshakeCallback done);
  void challenge(const std::shared_ptr<tensorpipe::Pipe>& pipe);
  void refuse(const std::shared_ptr<tensorpipe::Pipe>& pipe, const std::string& why);
  void answer_challenge(const std::shared_ptr<tensorpipe::Pipe>& pipe, int peer);
  void release_held(int peer, const std::shared_ptr<tensorpipe::Pipe>& pipe);
  void forget_incoming(const std::shared_ptr<tensorpipe::Pipe>& pipe);
  /// Reads messages from a pipe whose handshake succeeded, one after another. `peer`: the
  /// worker on its other end; `outgoing`: whether we opened it (it carries our calls).
  void read_next(const std::shared_ptr<tensorpipe::Pipe>& pipe, int peer, bool outgoing);
  void on_message(const std::shared_ptr<tensorpipe::Pipe>& pipe, int peer, bool outgoing,
                  MessageHeader header, std::shared_ptr<std::string> body,
                  std::vector<at::Tensor> buffers);
  void handle_request(const std::shared_ptr<tensorpipe::Pipe>& pipe, int caller,
                      const MessageHeader& header, const std::string& body,
                      std::vector<at::Tensor> buffers);
  void reply(const std::shared_ptr<tensorpipe::Pipe>& pipe, uint64_t id, int caller,
             const c10::ivalue::Future& result);
  void handle_reply(int peer, const MessageHeader& header, const std::string& body,
                    std::vector<at::Tensor> buffers);
  void on_pipe_failed(int peer, const std::string& why);
  void write(const std::shared_ptr<tensorpipe::Pipe>& pipe, EncodedMessage message,
             std::function<void(const std::string& error)> on_written);
  Outgoing& pipe_to(int peer);  // requires mutex_
  void fail_calls(std::vector<PendingCall> calls,
                  std::function<std::exception_ptr(const PendingCall&)> make_error);
  void run_timer();
  void barrier(const std::string& round, bool wait = true);
  void stop();

  const int rank_;
  const int world_size_;
  const RpcBackendOptions options_;
  const WireLimits limits_;
  comm::Rendezvous rendezvous_;
  std::vector<WorkerInfo> workers_;
  std::unordered_map<std::string, int> ids_by_name_;
  std::vector<std::string> urls_;  // each worker's uv:// URL, by id

  std::shared_ptr<tensorpipe::Context> context_;
  std::shared_ptr<tensorpipe::Listener> listener_;

  std::mutex mutex_;
  std::condition_variable idle_;  // signalled when pending_ or in_flight_requests_ drop
  std::condition_variable timer_wake_;
  State state_ = State::kRunning;                                             // guarded by mutex_
  uint64_t next_id_ = 1;                                                      // guarded by mutex_
  std::unordered_map<uint64_t, PendingCall> pending_;                         // guarded by mutex_
  std::multimap<std::chrono::steady_clock::time_point, uint64_t> deadlines_;  // by mutex_
  std::unordered_map<int, Outgoing> outgoing_;                                // by mutex_
  std::vector<std::shared_ptr<tensorpipe::Pipe>> incoming_;                   // by mutex_
  std::deque<std::shared_ptr<tensorpipe::Pipe>> unproven_;  // in handshake, oldest first; by mutex_
  std::deque<std::shared_ptr<tensorpipe::Pipe>> refused_;   // by mutex_
  std::map<int, std::string> lost_peers_;                   // why each is lost; guarded by mutex_
  int in_flight_requests_ = 0;                              // guarded by mutex_

  std::unique_ptr<RRefContext> rrefs_;
  size_t owned_at_stop_ = 0;

  std::unique_ptr<Executor> request_pool_;
  std::unique_ptr<Executor> ordered_;
  std::unique_ptr<Executor> completion_;
  std::thread timer_;
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
