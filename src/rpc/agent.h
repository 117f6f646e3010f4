#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>

#include <distoptim/rpc/api.h>

#include "dispatcher.h"
#include "group.h"
#include "membership.h"
#include "message.h"
#include "peers.h"
#include "pending_calls.h"
#include "rref_context.h"

namespace distoptim {
namespace rpc {
namespace detail {

/// The agent behind the rpc API: one per process, made by init_rpc. It puts together the rooms of
/// the rpc layer (docs/threading.md), each with one job, depending on each other one way:
///
///   WorkerGroup  the workers and the rendezvous store: init's exchange, shutdown's barriers
///   Peers        connections, handshakes and frames (the transport)
///   PendingCalls the calls made and not yet answered, with their deadlines
///   Dispatcher   requests to the threads that run them, replies to the pending calls
///   RRefContext  the RRef protocol, on the RRefChannel this agent gives it
///   Membership   a dynamic group's joins, leaves and dropped members, told through this agent
///
/// and does what is left: making a call (send), failing the calls of a lost peer or a passed
/// deadline, and the lifecycle (graceful shutdown, stop).
///
/// Threading: send() from any thread while the agent runs. One mutex, `mutex_`, guards `state_`
/// and is held from a call's registration to its hand-off to Peers, so that calls reach a
/// connection in the order they were made; it is never taken inside another room's lock, and no
/// future is completed and no user code runs while it is held.
class Agent final : public RRefChannel, public std::enable_shared_from_this<Agent> {
 public:
  /// Meets the other workers and starts serving (init_rpc). Throws as init_rpc documents; on
  /// error nothing is left running.
  static std::shared_ptr<Agent> create(const std::string& name, int rank, int world_size,
                                       const RpcBackendOptions& options);
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  const WorkerInfo& self() const { return group_.self(); }
  const std::shared_ptr<const MemberKey>& own_key() const { return group_.own_key(); }
  /// The workers that have joined and not left, by id.
  std::vector<WorkerInfo> workers() const { return group_.workers(); }
  int resolve(const WorkerRef& to) const { return group_.resolve(to); }
  /// get_worker_info: worker `id` (as resolve returned it); c10::ValueError if it left.
  WorkerInfo member(int id) const;
  /// rpc::get_debug_info's counters: the connections', the RRef tables' and the requests'.
  std::map<std::string, int64_t> debug_info();
  std::chrono::milliseconds effective_timeout(std::chrono::milliseconds timeout) const {
    return timeout == kDefaultTimeout ? options_.rpc_timeout() : timeout;
  }
  RRefContext& rref_context() { return *rrefs_; }
  /// Whether the caller runs on one of this agent's threads that run user code.
  bool on_own_thread() const { return dispatcher_.on_own_thread(); }

  /// Once `caller`'s wait has ended off the I/O loop's threads (a future completed on the
  /// completion thread, say): leaves the loop for its next wait as a reply read on the loop would
  /// (Dispatcher::leave_loop_for_replies_of), asked at once so that the loop is left before then.
  void offer_loop_to(std::shared_ptr<const CallingThread> caller);
  /// The same, decided now: on a thread that leads the agent's I/O loop, as a handler.
  void leave_loop_for(const std::shared_ptr<const CallingThread>& caller) {
    dispatcher_.leave_loop_for_replies_of(caller);
  }
  /// Sends a request to `to`; RRefs among `args` are forked to `to`. The interceptor sees its
  /// arguments. `waited_only`: the caller only waits on the future (PendingCall::waited_only).
  c10::intrusive_ptr<c10::ivalue::Future> send(int to, const std::string& function,
                                               std::vector<c10::IValue> args,
                                               std::chrono::milliseconds timeout,
                                               bool waited_only = false);
  // RRefChannel.
  c10::intrusive_ptr<c10::ivalue::Future> send_control(int to, const std::string& function,
                                                       std::vector<c10::IValue> args,
                                                       std::chrono::milliseconds timeout,
                                                       SendInterception intercept,
                                                       bool waited_only) override;
  c10::intrusive_ptr<c10::ivalue::Future> run_locally(const std::string& callable,
                                                      std::vector<c10::IValue> args,
                                                      Preparation prepare) override {
    return dispatcher_.run_locally(callable, std::move(args), std::move(prepare));
  }

  /// Values still owned when the agent stopped (after a graceful shutdown: 0 unless leaked).
  size_t owned_at_stop() const { return owned_at_stop_; }
  void shutdown(bool graceful);

 private:
  enum class State { kRunning, kStopping, kStopped };

  Agent(int rank, int world_size, const RpcBackendOptions& options);
  void start(const std::string& name);
  c10::intrusive_ptr<c10::ivalue::Future> send_message(int to, const std::string& function,
                                                       std::vector<c10::IValue> args,
                                                       std::chrono::milliseconds timeout,
                                                       uint16_t flags,
                                                       const SendInterception& intercept,
                                                       bool waited_only);
  void on_peer_lost(int peer, const std::string& why);
  void on_calls_expired(std::vector<PendingCall> expired);
  // A peer died or stopped: its forks are released and the interceptor is told. On the ordered
  // thread, after the control messages the peer sent before.
  void on_peer_gone(int peer);
  void stop();
  std::string name_of(int id) const { return group_.table().snapshot()->name(id); }
  // A dynamic group's graceful shutdown: this worker's own (api.h, shutdown).
  void leave();

  const RpcBackendOptions options_;
  const WireLimits limits_;
  WorkerGroup group_;
  // Declared in the order they are built; stop() takes them down in its own order.
  PendingCalls pending_;
  Dispatcher dispatcher_;
  Peers peers_;
  std::unique_ptr<RRefContext> rrefs_;

  std::mutex mutex_;
  State state_ = State::kRunning;  // guarded by mutex_
  size_t owned_at_stop_ = 0;
  // Last, so destroyed first: the store host's watch calls through the rooms above.
  Membership membership_;
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
