#pragma once

#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>

#include <distoptim/rpc/api.h>

#include "group.h"
#include "lost_members.h"

namespace distoptim {
namespace rpc {
namespace detail {

/// Who the members of a dynamic group are, as this worker keeps them: it tells the members that
/// joined before it that it joined (announce_join), takes the other members' notices that they
/// joined, left or were dropped (on_notice), and, when it leaves, waits for the others if it is
/// the store host, marks itself left and tells the members (leave_group, tell_members_left). The
/// store host (over etcd, where no member hosts the store, every member) also drops the members
/// that die without leaving (LostMemberWatch). The workers
/// themselves are in the WorkerGroup's table, which this updates; calls go through the agent
/// (Send), so this object knows nothing of connections or frames.
///
/// Threading: announce_join from the thread calling init_rpc; leave_group and tell_members_left
/// from the thread calling shutdown; on_notice from the threads that run requests; on_peer_gone
/// from the ordered thread; the store host's drops on the LostMemberWatch's thread. One mutex,
/// `mutex_`, guards `gone_`; `leaving_` is atomic; the table is WorkerTable's. No future is
/// completed and no user code runs here. Every wait is bounded: by init_timeout, liveness_timeout
/// or the caller's deadline.
class Membership {
 public:
  /// Sends `function` to worker `to` (Agent::send); returns the call's future.
  using Send = std::function<c10::intrusive_ptr<c10::ivalue::Future>(
      int to, const std::string& function, std::vector<c10::IValue> args,
      std::chrono::milliseconds timeout)>;
  /// Counts worker `id` as lost: whatever it still sends is not run (Dispatcher::caller_lost).
  using CallerLost = std::function<void(int id)>;
  /// Whether the connection to worker `id` ended in a refusal by either side (Peers::refused_us):
  /// it is alive, but one side did not take the other's proof.
  using Refused = std::function<bool(int id)>;

  /// `group` outlives this object.
  Membership(WorkerGroup& group, const RpcBackendOptions& options, Send send,
             CallerLost caller_lost, Refused refused);
  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  /// Once the group is met, before peers' connections are taken: the store host of a dynamic
  /// group (over etcd, every member) starts watching for members that die without leaving (its
  /// suspects come from the connections' callbacks).
  void watch_lost_members();
  /// Dynamic group, once this worker accepts connections: tells every member that joined before
  /// it that it joined. A member that is leaving, or is lost, is marked left; any other failure
  /// to tell one is a DistributedError naming it, a refusal by either side included (a member
  /// key that does not match the one its record holds: a record rewritten in the store).
  void announce_join();
  /// init_rpc failed after this worker claimed its place in a dynamic group: it marks itself
  /// left, so that a worker joining later does not wait for it (it never joined).
  void abandon_join();
  /// A notice (kMemberJoined, kMemberLeft, kMemberDropped) from `caller`: its reply.
  /// c10::ValueError in a static group and for a malformed notice.
  c10::IValue on_notice(int caller, const std::string& notice, std::vector<c10::IValue> args);
  /// A peer died or stopped (its connection ended without a notice that it left).
  void on_peer_gone(int peer);

  /// A dynamic group's graceful shutdown, its first part: this worker begins to leave (joining
  /// workers are told it does not stay); the store host waits (until `deadline`) for the others
  /// to leave, as they join and leave through its store; then it is marked left in the store.
  /// Returns the store host's failure to wait (TimeoutError naming the workers that stayed), for
  /// the caller to throw once it has left all the same.
  std::exception_ptr leave_group(std::chrono::steady_clock::time_point deadline);
  /// Then: tells every other member that this worker left, waiting for each at most
  /// liveness_timeout (and not past `deadline`).
  void tell_members_left(std::chrono::steady_clock::time_point deadline);

  /// Stops the store host's watch: first when the agent stops, since a member dropped then would
  /// be told by calls that fail. Idempotent.
  void stop();

 private:
  // The store host waits for the other members to leave.
  void wait_for_others_to_leave(std::chrono::steady_clock::time_point deadline);
  // The store host drops member `id`, which died without leaving (LostMemberWatch): marks it left
  // in the store and here, and tells the other members.
  void drop_member(int id, const std::string& why);
  const WorkerInfo& self() const { return group_.self(); }
  std::string name_of(int id) const { return group_.table().snapshot()->name(id); }

  WorkerGroup& group_;
  const RpcBackendOptions options_;
  const Send send_;
  const CallerLost caller_lost_;
  const Refused refused_;

  // This worker has begun to leave (joining workers are told it does not stay).
  std::atomic<bool> leaving_{false};
  std::mutex mutex_;
  // Workers whose connections closed without a notice that they left (they died), by id.
  std::set<int> gone_;  // guarded by mutex_
  // The store host of a dynamic group only. Set before Peers start (its suspects come from their
  // callbacks); stopped first by stop().
  std::unique_ptr<LostMemberWatch> lost_members_;
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
