#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace distoptim {
namespace rpc {
namespace detail {

/// A pool of threads running posted jobs in order of posting. Thread-safe. stop() runs the jobs
/// already queued, then joins every thread; jobs posted after stop() run on the posting thread,
/// so a job (a future's completion) is never lost. A job that throws is a bug: the exception is
/// swallowed so that the pool survives. The destructor calls stop(). stop() called from one of
/// the pool's own jobs detaches that thread, which ends when the job returns: the pool must
/// outlive it (the agent refuses rpc::shutdown from a request for this reason).
///
/// Managed blocking: a job about to wait for something a queued job may have to produce (a
/// nested call's reply, a value still being created) opens a BlockingScope around the wait.
/// While jobs are queued and fewer than `threads` of the pool's threads are outside such a
/// scope, the pool starts a compensating thread, at most `max_extra_threads` beyond `threads`.
/// Past that bound the wait goes on without one (warned once, unless `max_extra_threads` is 0):
/// queued jobs then wait for a thread to come back, as in a fixed pool. When blocked jobs resume,
/// threads beyond `threads` that find the queue empty exit, so the pool shrinks back. Nothing
/// spins: idle threads sleep on a condition variable. One mutex, `mutex_`, guards every field below
/// but the constants.
class Executor {
 public:
  explicit Executor(int threads, int max_extra_threads = 0);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  void post(std::function<void()> job);
  void stop();

  /// The pool whose thread calls this, or null.
  static Executor* current();
  /// Threads running now, compensating ones included (for tests and diagnostics).
  int thread_count();
  /// No job queued and every thread waiting for one: a job run elsewhere now cannot overtake
  /// one posted before it.
  bool quiescent();
  /// No job queued (threads may be busy): a job started elsewhere now starts after every job
  /// posted before it.
  bool nothing_queued();

  /// Marks the calling thread as blocked for its lifetime, if it is a pool thread (else, and
  /// inside another scope, it does nothing). Never throws.
  class BlockingScope {
   public:
    BlockingScope();
    ~BlockingScope();
    BlockingScope(const BlockingScope&) = delete;
    BlockingScope& operator=(const BlockingScope&) = delete;

   private:
    Executor* pool_ = nullptr;
  };

 private:
  void run();
  void begin_blocking();
  void end_blocking();
  // Starts a thread if jobs wait and fewer than `threads_wanted_` threads are unblocked; returns
  // true the first time the bound refuses one (the caller warns, outside the lock).
  bool grow_locked();

  const int threads_wanted_;
  const int max_threads_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  bool warned_ = false;
  int live_ = 0;     // threads inside run()
  int idle_ = 0;     // of which waiting for a job
  int blocked_ = 0;  // of which inside a BlockingScope
  std::unordered_map<std::thread::id, std::thread> threads_;
  std::vector<std::thread>
      exited_;  // threads that left run(), joined by the next to leave or stop()
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
