#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace distoptim {
namespace rpc {
namespace detail {

/// A fixed pool of threads running posted jobs in order of posting. Thread-safe. stop() runs
/// the jobs already queued, then joins every thread; jobs posted after stop() run on the posting
/// thread, so a job (a future's completion) is never lost. A job that throws is a bug: the
/// exception is swallowed so that the pool survives. The destructor calls stop().
class Executor {
 public:
  explicit Executor(int threads);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  void post(std::function<void()> job);
  void stop();

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> jobs_;  // guarded by mutex_
  bool stopping_ = false;                   // guarded by mutex_
  std::vector<std::thread> threads_;
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
