#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <asio/io_context.hpp>

namespace at {
class ThreadLocalState;
}  // namespace at

namespace distoptim {
namespace rpc {
namespace detail {

/// The threads that run an io_context's loop, one at a time (leader/followers): at any moment at
/// most one of them leads, running the loop's handlers, and every hand-over goes through one
/// mutex, so the handlers are confined as on a single I/O thread. A handler may ask to run a job
/// on its own thread once it returns (run_after_handler): the thread that read a request runs it
/// at once, so no thread waits to be woken before the job starts.
///
/// While the job runs its thread keeps the loop (nobody reads meanwhile), so that no follower has
/// to wake per job: on a virtual machine each wake-up costs an idle CPU's restart, on the path of
/// whatever the other core runs. A job that waits in the library leads the loop itself while it
/// waits (lead_until, called by the rpc layer's waits), so that what it waits for is read with
/// nobody woken on the way. A job that blocks elsewhere (a user's lock, a long computation) loses
/// the loop to a follower once it has kept it a whole `long_job` (kLongJob): a follower watches
/// while jobs run (timed waits, not a spin; it stops watching after a `long_job` with no job), so
/// such a job stalls the loop for about that long at most. The job's thread then follows.
///
/// A thread outside the loop may lead it too. When the reply that ends a caller's wait is read
/// by a loop thread while nothing else is expected (leave_to_next_wait), that thread leaves the
/// loop kept for the next wait of a thread outside it and watches as for a job: the caller, back
/// in the library for its next call, leads the loop while it waits (lead_left_loop_until) and
/// reads its reply itself, so a blocking round trip wakes one thread on each side, as a bare
/// socket's ping-pong does, not two on the caller's. A caller that does not wait again within a
/// `long_job` loses the loop to the watching follower, as a job does. The loop is left only for
/// a caller that will come back (NextWaiter): one still blocked on something else would not, and
/// what it waits for would go unread for that long.
///
/// Threading: the threads start at construction and run until the io_context stops; join()
/// (also the destructor) from a thread outside the loop. One mutex guards the fields below.
class IoLoop {
 public:
  /// How long one job may keep the loop before a watching follower takes it over, by default.
  static constexpr std::chrono::microseconds kLongJob{1000};

  IoLoop(asio::io_context& io, int threads, std::chrono::microseconds long_job = kLongJob);
  ~IoLoop();
  IoLoop(const IoLoop&) = delete;
  IoLoop& operator=(const IoLoop&) = delete;

  /// Waits until the io_context has stopped and no handler runs any more; a job
  /// (run_after_handler) may still be running.
  void wait_stopped();
  /// Waits for every thread to leave: the io_context stopped and every job returned.
  void join();

  /// Whether the calling thread runs a handler of a loop with a follower waiting to take it
  /// over, and has no job set yet: run_after_handler may be called.
  static bool can_run_after_handler();
  /// From a handler the loop runs, after can_run_after_handler() said yes: runs `job` on this
  /// thread right after the handler returns, keeping the loop meanwhile (above). The job must not
  /// throw.
  static void run_after_handler(std::function<void()> job);
  /// On a thread running a job that keeps its loop: runs the loop's handlers on this thread until
  /// `done()` or `deadline`, then keeps the loop again, and returns true. `arm` is called first
  /// with a function that makes the loop look at `done()` again: whatever may make it true off
  /// the loop's threads must call it then (from any thread, at any time, even once the loop is
  /// gone). Handlers run meanwhile run no job after them (can_run_after_handler() says no).
  /// Elsewhere, or once the loop was taken over, it returns false at once: the caller waits its
  /// own way. It also returns (true) when the loop stops.
  static bool lead_until(const std::function<bool()>& done,
                         const std::function<void(std::function<void()>)>& arm,
                         std::optional<std::chrono::steady_clock::time_point> deadline);
  /// On a thread outside every loop, while a loop is left for the next outside wait: as
  /// lead_until, after which the loop is left for the next wait again (when a handler asked,
  /// leave_to_next_wait) or handed back to its threads. Otherwise false at once. Not from a
  /// thread whose wait other work queues behind (a pool's): what it waits for may be such work.
  /// `last`, if given, runs once done() holds, still leading, as a handler would (it may call
  /// leave_to_next_wait), under the calling thread's own LibTorch state; not when a handler of
  /// the lead already asked to leave the loop.
  static bool lead_left_loop_until(const std::function<bool()>& done,
                                   const std::function<void(std::function<void()>)>& arm,
                                   std::optional<std::chrono::steady_clock::time_point> deadline,
                                   const std::function<void()>& last = {});
  /// Whether the calling thread runs a handler or a job of a loop, or leads one.
  static bool on_loop_thread();
  /// Whom a loop is left for. Asked under the loop's lock once the handler that left the loop
  /// has returned (and its future's callbacks ran), so that a thread that looks for a left loop
  /// before it blocks is either seen blocked here or finds the loop left.
  class NextWaiter {
   public:
    virtual ~NextWaiter() = default;
    /// Whether the thread will wait again soon and lead: it runs, or its wait has ended.
    virtual bool comes_back() const = 0;
  };
  /// From a handler the loop runs on one of its threads or on an outside thread leading it: once
  /// the handler returns, the loop is left for the next wait of `waiter`, a thread outside it
  /// (above), if it comes back; otherwise the thread that ran the handler reads on. Ignored on a
  /// job's thread leading it (lead_until): that job keeps the loop anyway.
  static void leave_to_next_wait(std::shared_ptr<const NextWaiter> waiter);

 private:
  // What of LibTorch's thread-local state handlers depend on, cheap to read: the modes and
  // dispatch keys, and whether anything is installed (callbacks, hooks, modes, debug info).
  struct ThreadModes {
    uint64_t included_keys = 0;
    uint64_t excluded_keys = 0;
    bool grad = false;
    bool inference = false;
    bool forward_grad = false;
    bool record_functions = false;
    bool nothing_installed = false;

    static ThreadModes current();
    // Equal, with nothing installed on either: the whole states agree.
    bool same_as(const ThreadModes& other) const;
  };

  void run_thread();
  // Runs handlers on the calling thread until done() or the deadline (lead_until's loop).
  void run_handlers_until(const std::function<bool()>& done,
                          const std::function<void(std::function<void()>)>& arm,
                          std::optional<std::chrono::steady_clock::time_point> deadline);
  // A loop left for an outside wait, now led by the calling thread; null if none is.
  static IoLoop* claim_left_loop();
  // Leaves the loop led outside: for the next outside wait again (when `leave_for` comes back),
  // or to its threads; notifies whoever waits for the loop to stop or for its outside leader to
  // leave.
  void end_outside_lead(const std::shared_ptr<const NextWaiter>& leave_for);
  // Waits until this thread may lead; false when the loop stopped.
  bool follow(std::unique_lock<std::mutex>& lock);

  // What lead_until's wake-up posts to, for as long as the loop exists.
  struct Wake {
    std::mutex mutex;
    asio::io_context* io = nullptr;
  };
  void stop_locked(std::unique_lock<std::mutex>& lock);
  // Marks a new job as keeping the loop and wakes a follower to watch it if none does; unlocks.
  // Returns the job's number.
  uint64_t keep_locked(std::unique_lock<std::mutex>& lock);

  asio::io_context& io_;
  const std::chrono::microseconds long_job_;
  const std::shared_ptr<Wake> wake_;
  std::mutex mutex_;
  std::condition_variable follow_;      // a follower may lead, or a job began, or the loop stopped
  std::condition_variable stopped_cv_;  // the loop stopped
  bool led_ = false;                    // a thread leads (runs handlers or keeps the loop)
  bool stopped_ = false;                // the io_context stopped: every thread leaves
  int waiting_ = 0;                     // followers waiting to lead
  bool watching_ = false;               // one of them watches the jobs (timed waits)
  uint64_t jobs_begun_ = 0;             // jobs run after a handler, ever
  uint64_t kept_job_ = 0;               // the number of the job keeping the loop now, or 0
  uint64_t left_job_ = 0;    // kept_job_'s number when the loop was left for an outside wait
  int outside_leaders_ = 0;  // outside threads leading the loop (at most one)
  std::condition_variable outside_left_;  // outside_leaders_ dropped
  // LibTorch's thread-local state (grad and inference mode, dispatch keys) of a loop thread
  // before any job ran on it: what handlers run under, also on a waiting job's thread or an
  // outside thread leading the loop (set by the first thread to run).
  std::unique_ptr<at::ThreadLocalState> loop_state_;
  // loop_state_'s modes, to tell whether a thread about to run handlers is already in them.
  ThreadModes loop_modes_;
  std::vector<std::thread> threads_;
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
