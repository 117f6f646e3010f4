#include "pending_calls.h"

#include <algorithm>

namespace distoptim {
namespace rpc {
namespace detail {

PendingCalls::PendingCalls(ExpiredHandler on_expired) : on_expired_(std::move(on_expired)) {
  timer_ = std::thread([this] { run_timer(); });
}

PendingCalls::~PendingCalls() { stop(); }

void PendingCalls::add(PendingCall call) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (call.has_deadline) {
    deadlines_.emplace(call.deadline, call.id);
    if (call.deadline < timer_wakes_at_) {
      timer_wakes_at_ = call.deadline;
      timer_changed_.notify_one();
    }
  }
  const uint64_t id = call.id;
  calls_.emplace(id, std::move(call));
}

void PendingCalls::notify_if_empty_locked() {
  if (calls_.empty() && empty_waiters_ > 0) {
    emptied_.notify_all();
  }
}

void PendingCalls::erase_deadline_locked(const PendingCall& call) {
  if (!call.has_deadline) {
    return;
  }
  auto range = deadlines_.equal_range(call.deadline);
  for (auto it = range.first; it != range.second; ++it) {
    if (it->second == call.id) {
      deadlines_.erase(it);
      return;
    }
  }
}

std::optional<PendingCall> PendingCalls::take(uint64_t id, int from) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = calls_.find(id);
  if (it == calls_.end() || it->second.to != from) {
    return std::nullopt;
  }
  PendingCall call = std::move(it->second);
  calls_.erase(it);
  erase_deadline_locked(call);
  notify_if_empty_locked();
  return call;
}

std::optional<std::shared_ptr<const CallingThread>> PendingCalls::waited_only(uint64_t id,
                                                                              int from) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = calls_.find(id);
  if (it == calls_.end() || it->second.to != from || !it->second.waited_only) return std::nullopt;
  return it->second.leading_waiter;
}

bool PendingCalls::only_calls_led_by(const CallingThread* waiter) {
  if (waiter == nullptr) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  return std::all_of(calls_.begin(), calls_.end(), [&](const auto& entry) {
    return entry.second.leading_waiter.get() == waiter;
  });
}

std::vector<PendingCall> PendingCalls::take_to(int peer) {
  std::vector<PendingCall> taken;
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = calls_.begin(); it != calls_.end();) {
    if (it->second.to == peer) {
      erase_deadline_locked(it->second);
      taken.push_back(std::move(it->second));
      it = calls_.erase(it);
    } else {
      ++it;
    }
  }
  notify_if_empty_locked();
  return taken;
}

std::vector<PendingCall> PendingCalls::take_all() {
  std::vector<PendingCall> taken;
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [id, call] : calls_) {
    taken.push_back(std::move(call));
  }
  calls_.clear();
  deadlines_.clear();
  notify_if_empty_locked();
  return taken;
}

bool PendingCalls::wait_empty(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  ++empty_waiters_;
  const bool empty = emptied_.wait_until(lock, deadline, [this] { return calls_.empty(); });
  --empty_waiters_;
  return empty;
}

size_t PendingCalls::size() {
  std::lock_guard<std::mutex> lock(mutex_);
  return calls_.size();
}

void PendingCalls::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  timer_changed_.notify_all();
  if (timer_.joinable()) {
    timer_.join();
  }
}

void PendingCalls::run_timer() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    const auto now = std::chrono::steady_clock::now();
    std::vector<PendingCall> expired;
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      auto it = calls_.find(deadlines_.begin()->second);
      deadlines_.erase(deadlines_.begin());
      if (it != calls_.end()) {
        expired.push_back(std::move(it->second));
        calls_.erase(it);
      }
    }
    if (!expired.empty()) {
      notify_if_empty_locked();
      lock.unlock();
      on_expired_(std::move(expired));
      lock.lock();
      continue;
    }
    timer_wakes_at_ = deadlines_.empty() ? TimePoint::max() : deadlines_.begin()->first;
    if (timer_wakes_at_ == TimePoint::max()) {
      timer_changed_.wait(lock);
    } else {
      // A copy: add() may move timer_wakes_at_ while this waits.
      const TimePoint wake_at = timer_wakes_at_;
      timer_changed_.wait_until(lock, wake_at);
    }
  }
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
