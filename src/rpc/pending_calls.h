#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>

#include "calling_thread.h"

namespace distoptim {
namespace rpc {
namespace detail {

/// A call sent and not yet answered.
struct PendingCall {
  uint64_t id = 0;
  c10::intrusive_ptr<c10::ivalue::Future> future;
  int to = -1;
  std::string function;
  std::chrono::steady_clock::time_point deadline;
  bool has_deadline = false;
  /// The caller only waits on the future (rpc_sync and the like: no callback is ever attached),
  /// so its reply may complete it on the thread that reads it.
  bool waited_only = false;
  /// A waited_only call's caller when it may lead the agent's I/O loop as it waits, else null.
  std::shared_ptr<const CallingThread> leading_waiter;
};

/// The calls a worker has made and not yet seen answered, with their deadlines. Every call is
/// taken out exactly once: by its reply (take), its worker's loss (take_to), the stop
/// (take_all), or its deadline, when a timer thread takes it and hands it to `on_expired`
/// (outside the lock). Whoever takes a call completes its future. Thread-safe: one mutex guards
/// both tables; no future is completed and no handler runs while it is held.
class PendingCalls {
 public:
  using ExpiredHandler = std::function<void(std::vector<PendingCall> expired)>;

  explicit PendingCalls(ExpiredHandler on_expired);
  ~PendingCalls();
  PendingCalls(const PendingCalls&) = delete;
  PendingCalls& operator=(const PendingCalls&) = delete;

  void add(PendingCall call);
  /// The call `id`, if it is pending and went to `from`.
  std::optional<PendingCall> take(uint64_t id, int from);
  /// If call `id`, made to `from`, is pending and waited_only: its leading_waiter (maybe null).
  std::optional<std::shared_ptr<const CallingThread>> waited_only(uint64_t id, int from);
  /// Whether every pending call (none, too) is waited for by `waiter` (not null).
  bool only_calls_led_by(const CallingThread* waiter);
  std::vector<PendingCall> take_to(int peer);
  std::vector<PendingCall> take_all();
  /// Waits until no call is pending or `deadline` passes; returns whether none is.
  bool wait_empty(std::chrono::steady_clock::time_point deadline);
  size_t size();
  /// Stops the timer thread (calls still pending stay, for take_all).
  void stop();

 private:
  void erase_deadline_locked(const PendingCall& call);  // requires mutex_
  void run_timer();

  void notify_if_empty_locked();  // requires mutex_

  using TimePoint = std::chrono::steady_clock::time_point;
  const ExpiredHandler on_expired_;
  std::mutex mutex_;
  // The timer thread sleeps on `timer_changed_` until `timer_wakes_at_` (max(): nothing to
  // time) and is woken only for a deadline sooner than that, or to stop: not once per call, as
  // a wake-up on each call's way costs microseconds a round trip does not have. A deadline
  // whose call was answered stays behind in its wait: the thread wakes for nothing then (at
  // most once per deadline it waited for), and goes back to sleep.
  std::condition_variable timer_changed_;
  TimePoint timer_wakes_at_ = TimePoint::max();      // guarded by mutex_
  std::condition_variable emptied_;                  // no call is pending any more (wait_empty)
  int empty_waiters_ = 0;                            // guarded by mutex_
  std::unordered_map<uint64_t, PendingCall> calls_;  // guarded by mutex_
  std::multimap<TimePoint, uint64_t> deadlines_;     // guarded by mutex_
  bool stopping_ = false;                            // guarded by mutex_
  std::thread timer_;
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
