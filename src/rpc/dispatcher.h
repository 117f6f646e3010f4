#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>

#include <distoptim/rpc/api.h>
#include <distoptim/rpc/registry.h>

#include "executor.h"
#include "message.h"
#include "pending_calls.h"
#include "rref_context.h"
#include "transport/connection.h"
#include "worker_table.h"

namespace distoptim {
namespace rpc {
namespace detail {

/// Where a worker's messages go once they are off the wire: requests to the threads that run
/// them, replies to the call table (pending_calls.h), and back.
///
/// Requests: a request frame is admitted (counted in flight, its bytes against the inbound bound
/// options().inbound_queue_bytes: past it, reading from that caller pauses until requests drain
/// below half), then run on the I/O thread that read it, which keeps the loop meanwhile
/// (transport/io_loop.h), or on `request_pool` when the loop's other thread is busy running one
/// (RRef control messages on `ordered`, one thread, in the order they arrived on their
/// connection); the reply is written on the caller's connection. A
/// registered function that returns a future (async_execution) is answered when the future
/// completes, on whichever thread completes it, and stays in flight until then.
///
/// Replies: a reply completes its pending call's future on `completion` (one thread, where the
/// future's callbacks run), or directly on the I/O thread for a caller that only waits
/// (PendingCall::waited_only) when that cannot overtake a reply still queued there. Failed calls
/// (lost peer, deadline, stop) are completed on `completion` too.
///
/// Threading: on_request_frame and on_reply_frame on the I/O thread (never block); the rest from
/// any thread. One mutex guards the request counters; no future is completed and no user code
/// runs while it is held.
class Dispatcher {
 public:
  Dispatcher(const RpcBackendOptions& options, WireLimits limits, PendingCalls& calls);
  ~Dispatcher();
  Dispatcher(const Dispatcher&) = delete;
  Dispatcher& operator=(const Dispatcher&) = delete;

  /// Handles a membership notice (kMemberJoined, kMemberLeft, kMemberDropped) from `caller`: its
  /// reply.
  using MembershipHandler =
      std::function<c10::IValue(int caller, const std::string& callable, std::vector<c10::IValue>)>;

  /// Once the group is known: this worker's id, the workers (names for messages; it outlives
  /// this object), the RRef protocol that takes the RRefs in messages, `owner`, what owns this
  /// dispatcher and the RRef protocol (the agent): a future completing after it is gone answers
  /// no one, and the handler of membership notices. Before any frame arrives.
  void start(int self, const WorkerTable& workers, RRefContext* rrefs, std::weak_ptr<void> owner,
             MembershipHandler membership);

  /// I/O thread: admits a request; returns whether to go on reading its connection.
  bool on_request_frame(const std::shared_ptr<Connection>& connection, int caller, Frame frame);
  /// I/O thread: a reply from `peer`.
  void on_reply_frame(int peer, Frame frame);

  /// Runs the registered `callable` on the request pool; the future fails with a RemoteError
  /// naming this worker if it throws or is unknown. `prepare` (optional) runs first, on the same
  /// thread, and what it returns lives while the callable runs. Throws DistributedError once
  /// stopping.
  c10::intrusive_ptr<c10::ivalue::Future> run_locally(const std::string& callable,
                                                      std::vector<c10::IValue> args,
                                                      Preparation prepare = nullptr);
  /// Completes each call's future with make_error(call), on the completion thread.
  void fail_calls(std::vector<PendingCall> calls,
                  std::function<std::exception_ptr(const PendingCall&)> make_error);
  /// I/O thread, when `peer`'s connection ends: on the completion thread, after the replies read
  /// before the end (queued there before), takes the calls to `peer` still pending and completes
  /// each with make_error(call). A reply the peer wrote before closing answers its call.
  void fail_calls_to(int peer, std::function<std::exception_ptr(const PendingCall&)> make_error);
  /// Runs `job` on the ordered thread, after the control messages received before.
  void post_ordered(std::function<void()> job);

  /// Any thread: `caller` is lost (it died, stopped, or its connection failed); requests of it
  /// that have not started yet never run.
  void caller_lost(int caller);
  /// Any thread: `caller` proved itself on a new connection, so it is alive: its requests run
  /// again (those of its closed connection are still dropped, by that connection's state).
  void caller_back(int caller);
  /// Requests not run because their caller was lost before they started.
  int64_t dropped_requests() const { return dropped_requests_.load(std::memory_order_relaxed); }
  /// Requests received (or run locally) and not finished.
  int64_t requests_in_flight();
  /// From a handler of the I/O loop: when all still expected are replies that `caller` waits for
  /// (its next call, or the rest of those it made at once) and no request is in flight, leaves
  /// the loop for its next wait, so that it reads them itself (io_loop.h).
  void leave_loop_for_replies_of(const std::shared_ptr<const CallingThread>& caller);

  /// Waits until no request is in flight or `deadline` passes; returns how many still are.
  int wait_idle(std::chrono::steady_clock::time_point deadline);
  /// Whether the caller runs on one of the threads that run user code here.
  bool on_own_thread() const;
  /// Refuses new requests (they are dropped unread).
  void refuse_requests();
  /// Joins the request pool, then the ordered and completion threads: jobs queued still run.
  void stop();

 private:
  void handle_request(const std::shared_ptr<Connection>& connection, int caller,
                      const MessageHeader& header, const std::string& body,
                      std::vector<at::Tensor> buffers);
  void handle_reply(int peer, const MessageHeader& header, const std::string& body,
                    std::vector<at::Tensor> buffers);
  void reply(const std::shared_ptr<Connection>& connection, uint64_t id, int caller,
             const std::string& callable, const c10::ivalue::Future& result);
  /// Runs `function` on `args` and returns its result. A result that is a future itself
  /// (async_execution) keeps the request in flight until it completes: then
  /// `done(result, owner_alive)` runs, on the thread that completed it, and nothing is returned.
  std::optional<c10::IValue> invoke(
      const RawFunction& function, std::vector<c10::IValue> args,
      std::function<void(c10::ivalue::Future& result, bool owner_alive)> done);
  void request_done(size_t bytes);
  void discard_rrefs(const std::vector<c10::IValue>& values, bool accepted_by_reply = false);
  std::string name(int worker) const { return workers_->snapshot()->name(worker); }

  const size_t inbound_limit_;
  const WireLimits limits_;
  PendingCalls& calls_;
  int self_ = -1;
  const WorkerTable* workers_ = nullptr;
  MembershipHandler membership_;
  RRefContext* rrefs_ = nullptr;
  std::weak_ptr<void> owner_;

  std::mutex mutex_;
  std::condition_variable idle_;  // signalled when in_flight_ drops
  bool refusing_ = false;         // guarded by mutex_
  int in_flight_ = 0;             // guarded by mutex_
  size_t inbound_bytes_ = 0;      // of requests received and not finished; guarded by mutex_
  std::vector<std::shared_ptr<Connection>> paused_;  // reading paused for it; by mutex_
  std::atomic<int64_t> dropped_requests_{0};
  // By worker id (ids are never reused, so a flag is never cleared); sized by start().
  std::unique_ptr<std::atomic<bool>[]> lost_callers_;
  size_t lost_callers_capacity_ = 0;

  // Declared last: destroyed first, joining their threads while everything above still exists.
  std::unique_ptr<Executor> request_pool_;
  std::unique_ptr<Executor> ordered_;
  std::unique_ptr<Executor> completion_;
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
