#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
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

  void start_listening();
  void exchange_addresses(const std::string& name);
  void accept_next();
  void read_next(const std::shared_ptr<tensorpipe::Pipe>& pipe, int peer);
  void on_message(const std::shared_ptr<tensorpipe::Pipe>& pipe, int peer, MessageHeader header,
                  std::shared_ptr<std::string> body, std::vector<at::Tensor> buffers);
  void handle_request(const std::shared_ptr<tensorpipe::Pipe>& pipe, const MessageHeader& header,
                      const std::string& body, std::vector<at::Tensor> buffers);
  void reply(const std::shared_ptr<tensorpipe::Pipe>& pipe, uint64_t id, int caller,
             const c10::ivalue::Future& result);
  void handle_reply(int peer, const MessageHeader& header, const std::string& body,
                    std::vector<at::Tensor> buffers);
  void on_pipe_failed(int peer, const std::string& why);
  void write(const std::shared_ptr<tensorpipe::Pipe>& pipe, EncodedMessage message,
             std::function<void(const std::string& error)> on_written);
  std::shared_ptr<tensorpipe::Pipe> pipe_to(int peer);  // requires mutex_
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
  std::unordered_map<int, std::shared_ptr<tensorpipe::Pipe>> outgoing_;       // by mutex_
  std::vector<std::shared_ptr<tensorpipe::Pipe>> incoming_;                   // by mutex_
  std::map<int, std::string> lost_peers_;  // why each is lost; guarded by mutex_
  int in_flight_requests_ = 0;             // guarded by mutex_

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
