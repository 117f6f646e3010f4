#pragma once

#include <atomic>
#include <cstdint>

namespace distoptim {
namespace rpc {
namespace detail {

/// The replies callers block on right now (PendingCall::waited_only calls pending), and how many
/// such waits have begun: the loop's leading thread polls for them a while before it sleeps in
/// epoll (IoLoop::kReplyPoll). Thread-safe (atomics).
class AwaitedReplies {
 public:
  void begin() {
    begun_.fetch_add(1, std::memory_order_relaxed);
    awaited_.fetch_add(1);
  }
  void end() { awaited_.fetch_sub(1, std::memory_order_relaxed); }
  bool any() const { return awaited_.load() > 0; }
  uint64_t begun() const { return begun_.load(std::memory_order_relaxed); }

 private:
  std::atomic<int> awaited_{0};
  std::atomic<uint64_t> begun_{0};
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
