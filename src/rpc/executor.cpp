#include "executor.h"

#include <algorithm>
#include <system_error>
#include <utility>

#include <c10/util/Exception.h>

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

thread_local Executor* t_current = nullptr;  // set by Executor::run on the pool's threads
thread_local bool t_blocking = false;        // inside a BlockingScope

void warn_at_bound(int max_threads) {
  TORCH_WARN("rpc: a request pool reached its bound of ", max_threads,
             " threads with requests queued and its threads blocked in nested waits; the queued "
             "requests wait for one to resume (raise RpcBackendOptions::max_extra_worker_threads, "
             "or make the waiting functions async_execution)");
}

}  // namespace

Executor::Executor(int threads, int max_extra_threads)
    : threads_wanted_(threads), max_threads_(threads + std::max(max_extra_threads, 0)) {
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int i = 0; i < threads; ++i) {
      std::thread thread([this] { run(); });
      threads_.emplace(thread.get_id(), std::move(thread));
      ++live_;
    }
  } catch (...) {
    stop();  // The threads already started must not outlive the pool.
    throw;
  }
}

Executor::~Executor() { stop(); }

Executor* Executor::current() { return t_current; }

int Executor::thread_count() {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_;
}

bool Executor::quiescent() {
  std::lock_guard<std::mutex> lock(mutex_);
  return jobs_.empty() && idle_ == live_;
}

bool Executor::nothing_queued() {
  std::lock_guard<std::mutex> lock(mutex_);
  return jobs_.empty();
}

void Executor::post(std::function<void()> job) {
  bool queued = false;
  bool warn = false;
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!stopping_) {
      jobs_.push_back(std::move(job));
      queued = true;
      warn = grow_locked();
      wake = idle_ > 0;
    }
  }
  // Woken after the lock is released: a thread woken while it is held would block on it at once
  // (two more context switches per job).
  if (wake) {
    wake_.notify_one();
  }
  if (warn) {
    warn_at_bound(max_threads_);
  }
  if (!queued) {
    try {
      job();
    } catch (...) {
    }
  }
}

bool Executor::grow_locked() {
  if (jobs_.size() <= static_cast<size_t>(idle_) || live_ - blocked_ >= threads_wanted_) {
    return false;  // An idle thread takes the job, or enough threads are free to come to it.
  }
  if (live_ >= max_threads_) {
    // A pool without compensation (0 extra threads) is fixed on purpose: no warning.
    return max_threads_ > threads_wanted_ && !std::exchange(warned_, true);
  }
  try {
    std::thread thread([this] { run(); });
    threads_.emplace(thread.get_id(), std::move(thread));
    ++live_;
  } catch (const std::system_error&) {
    // The system refuses another thread: the wait goes on without compensation, as at the bound.
  }
  return false;
}

void Executor::begin_blocking() {
  bool warn = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++blocked_;
    warn = grow_locked();
  }
  if (warn) {
    warn_at_bound(max_threads_);
  }
}

void Executor::end_blocking() {
  std::lock_guard<std::mutex> lock(mutex_);
  --blocked_;
  if (live_ - blocked_ > threads_wanted_ && idle_ > 0) {
    wake_.notify_one();  // One thread too many now: an idle one leaves.
  }
}

void Executor::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  // Threads may still start while the queue drains (a draining job blocks): join until none is
  // left. A thread leaving run() after its object was taken here finds nothing to move.
  for (;;) {
    std::vector<std::thread> joining;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& entry : threads_) joining.push_back(std::move(entry.second));
      threads_.clear();
      for (std::thread& thread : exited_) joining.push_back(std::move(thread));
      exited_.clear();
    }
    if (joining.empty()) {
      return;
    }
    for (std::thread& thread : joining) {
      if (thread.get_id() == std::this_thread::get_id()) {
        thread.detach();  // A job stopping its own pool: the thread ends when the job returns.
      } else {
        thread.join();
      }
    }
  }
}

void Executor::run() {
  t_current = this;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    if (!jobs_.empty()) {
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      try {
        job();
      } catch (...) {
      }
      job = nullptr;  // Its captures go before the lock is taken again.
      lock.lock();
    } else if (stopping_ || live_ - blocked_ > threads_wanted_) {
      break;  // Stopping and drained, or a surplus thread with nothing to do.
    } else {
      ++idle_;
      wake_.wait(lock);
      --idle_;
    }
  }
  --live_;
  // A thread cannot join itself: it leaves its object for the next thread to leave (or stop())
  // and joins the one left before it, which has already released the lock for good.
  std::vector<std::thread> finished;
  finished.swap(exited_);
  auto self = threads_.extract(std::this_thread::get_id());
  if (!self.empty()) {
    exited_.push_back(std::move(self.mapped()));
  }
  lock.unlock();
  for (std::thread& thread : finished) {
    thread.join();
  }
  t_current = nullptr;
}

Executor::BlockingScope::BlockingScope() {
  if (t_current != nullptr && !t_blocking) {
    pool_ = t_current;
    t_blocking = true;
    pool_->begin_blocking();
  }
}

Executor::BlockingScope::~BlockingScope() {
  if (pool_ != nullptr) {
    pool_->end_blocking();
    t_blocking = false;
  }
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
