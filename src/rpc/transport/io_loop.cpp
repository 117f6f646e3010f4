#include "io_loop.h"

#include <utility>

#include <c10/util/Exception.h>
#include <asio/post.hpp>

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

// The loop this thread leads, and where a handler leaves the job to run after handing it over.
thread_local IoLoop* t_leading = nullptr;
thread_local std::function<void()>* t_after = nullptr;

}  // namespace

IoLoop::IoLoop(asio::io_context& io, int threads, const AwaitedReplies* awaited)
    : io_(io), awaited_(awaited) {
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

void IoLoop::poll_for_reply() {
  // Seen here, or the leader sees the wait before it sleeps: its flag is set before it looks.
  if (leader_sleeping_.load()) {
    asio::post(io_, [] {});
  }
}

void IoLoop::poll_awaited(const std::function<void()>& job) {
  const uint64_t begun = awaited_->begun();
  const auto until = std::chrono::steady_clock::now() + kReplyPoll;
  while (!job && awaited_->any()) {
    if (io_.poll_one() > 0) {
      continue;
    }
    if (io_.stopped() || std::chrono::steady_clock::now() >= until) {
      polled_through_ = begun;  // these waits' poll ran out: sleep until a new wait begins
      return;
    }
    std::this_thread::yield();  // a busy machine's other threads run between polls
  }
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
    const auto should_poll = [this] {
      return awaited_ != nullptr && awaited_->any() && awaited_->begun() != polled_through_;
    };
    while (!job && running) {
      if (should_poll()) {
        poll_awaited(job);
        continue;
      }
      leader_sleeping_.store(true);
      if (should_poll()) {  // a wait that began before the flag was set (poll_for_reply)
        leader_sleeping_.store(false, std::memory_order_relaxed);
        continue;
      }
      running = io_.run_one() > 0;  // 0: stopped (a work guard keeps it from running dry)
      leader_sleeping_.store(false, std::memory_order_relaxed);
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
