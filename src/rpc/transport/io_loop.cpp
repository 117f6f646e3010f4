#include "io_loop.h"

#include <utility>

#include <c10/util/Exception.h>

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

// The loop this thread leads, and where a handler leaves the job to run after handing it over.
thread_local IoLoop* t_leading = nullptr;
thread_local std::function<void()>* t_after = nullptr;

}  // namespace

IoLoop::IoLoop(asio::io_context& io, int threads) : io_(io) {
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this] { run_thread(); });
  }
}

IoLoop::~IoLoop() { join(); }

void IoLoop::wait_stopped() {
  std::unique_lock<std::mutex> lock(mutex_);
  stopped_cv_.wait(lock, [this] { return stopped_; });
}

void IoLoop::join() {
  for (std::thread& thread : threads_) {
    if (thread.joinable()) thread.join();
  }
}

bool IoLoop::can_hand_off() {
  IoLoop* loop = t_leading;
  if (loop == nullptr || *t_after) {
    return false;
  }
  // While this thread leads, a waiting follower stays waiting: the answer holds until the
  // handler returns.
  std::lock_guard<std::mutex> lock(loop->mutex_);
  return loop->waiting_ > 0;
}

void IoLoop::run_after_hand_off(std::function<void()> job) {
  TORCH_INTERNAL_ASSERT(t_leading != nullptr && !*t_after && job);
  *t_after = std::move(job);
}

void IoLoop::run_thread() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    ++waiting_;
    follow_.wait(lock, [this] { return stopped_ || !led_; });
    --waiting_;
    if (stopped_) {
      return;
    }
    led_ = true;
    lock.unlock();

    std::function<void()> job;
    t_leading = this;
    t_after = &job;
    bool running = true;
    while (!job && running) {
      running = io_.run_one() > 0;  // 0: stopped (a work guard keeps it from running dry)
    }
    t_leading = nullptr;
    t_after = nullptr;

    lock.lock();
    led_ = false;
    if (!running) {
      stopped_ = true;
      lock.unlock();
      follow_.notify_all();
      stopped_cv_.notify_all();
      return;
    }
    lock.unlock();
    follow_.notify_one();  // before the job: the follower wakes while the job runs
    job();
    job = nullptr;  // its captures go before the lock is taken
    lock.lock();
  }
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
