#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "liveness.h"

namespace distoptim {
namespace rpc {
namespace detail {

/// The store host of a dynamic group drops the members that die without leaving. A member is
/// dropped when both hold: a connection between it and the store host ended without a notice
/// that it left (its process died, or stopped its agent without leaving), and it then fails one
/// liveness check (LivenessProbe's call of kAliveFunction, within liveness_timeout, on a fresh
/// connection if the old one is gone). A live worker answers that check from its transport's
/// threads whatever its user code does, and never ends a connection while its agent runs, so a
/// slow worker is never dropped; a stopped one (SIGSTOP) keeps its connections open and is not
/// dropped either (the store host's shutdown does not wait for it: Membership::leave_group).
///
/// Threading: suspect() from any thread, never blocks (it queues); one thread of this object's
/// own checks the suspects one at a time and runs `drop` for those that fail. stop() (and the
/// destructor) joins that thread: a check in progress is abandoned within 10 ms, a `drop` in
/// progress runs to its end (it is bounded by the store's and the calls' timeouts).
class LostMemberWatch {
 public:
  /// Whether `id` is a member that has not left (a member that left sent its notice before its
  /// connections ended: it is not checked).
  using IsMember = std::function<bool(int id)>;
  /// Drops member `id`, which failed its check (`why`).
  using Drop = std::function<void(int id, const std::string& why)>;

  LostMemberWatch(LivenessProbe::Ask ask, std::chrono::milliseconds timeout, IsMember is_member,
                  Drop drop);
  ~LostMemberWatch();
  LostMemberWatch(const LostMemberWatch&) = delete;
  LostMemberWatch& operator=(const LostMemberWatch&) = delete;

  /// A connection between `id` and this worker ended without a notice that it left.
  void suspect(int id);
  /// Stops checking; suspects not checked yet are not. Idempotent.
  void stop();

 private:
  void run();
  // Checks `id`: the reason it failed its liveness check, empty if it answered or if stopping.
  std::string check(int id);

  const LivenessProbe::Ask ask_;
  const std::chrono::milliseconds timeout_;
  const IsMember is_member_;
  const Drop drop_;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<int> suspects_;  // guarded by mutex_
  bool stopping_ = false;     // guarded by mutex_
  std::thread thread_;
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
