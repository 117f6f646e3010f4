#include "executor.h"

namespace distoptim {
namespace rpc {
namespace detail {

Executor::Executor(int threads) {
  threads_.reserve(threads);
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this] { run(); });
  }
}

Executor::~Executor() { stop(); }

void Executor::post(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!stopping_) {
      jobs_.push_back(std::move(job));
      wake_.notify_one();
      return;
    }
  }
  try {
    job();
  } catch (...) {
  }
}

void Executor::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_ && threads_.empty()) {
      return;
    }
    stopping_ = true;
  }
  wake_.notify_all();
  for (std::thread& thread : threads_) {
    if (thread.get_id() == std::this_thread::get_id()) {
      thread.detach();  // A job stopping its own pool: the thread ends when the job returns.
    } else if (thread.joinable()) {
      thread.join();
    }
  }
  threads_.clear();
}

void Executor::run() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) {
        return;  // Stopping, and the queue is drained.
      }
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    try {
      job();
    } catch (...) {
    }
  }
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
