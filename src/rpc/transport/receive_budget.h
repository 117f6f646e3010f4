#pragma once

// The memory a worker's connections may hold for frames they are still receiving: a frame's
// body and tensors are allocated only once their announced size is reserved here, so peers that
// announce large frames and send them slowly (or not at all) share one bound instead of each
// pinning what it announced.

#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>

namespace distoptim {
namespace rpc {
namespace detail {

class Connection;

/// Bytes of frames being received, shared by a worker's connections. Thread-safe.
///
/// A reservation is granted when it fits under the limit, or when nothing else is reserved (a
/// single frame larger than the limit still travels, alone). Otherwise the connection waits,
/// reading nothing more, and is woken (Connection::retry_reservation) when bytes are released.
/// Frames of at most kUnreservedBytes are not counted at all: each connection reads one frame at
/// a time, so they cost at most that much per connection, and a caller's small calls are never
/// held up behind others' large frames.
class ReceiveBudget {
 public:
  static constexpr size_t kUnreservedBytes = size_t{64} << 10;

  explicit ReceiveBudget(size_t limit) : limit_(limit) {}
  ReceiveBudget(const ReceiveBudget&) = delete;
  ReceiveBudget& operator=(const ReceiveBudget&) = delete;

  /// Reserves `bytes` for `connection`'s next frame, or queues it to be woken once bytes are
  /// released and returns false.
  bool reserve(size_t bytes, const std::shared_ptr<Connection>& connection);
  /// Returns a reservation; the waiting connections try theirs again.
  void release(size_t bytes);

  size_t limit() const { return limit_; }
  /// Bytes reserved now (for diagnostics and tests).
  size_t reserved();

 private:
  const size_t limit_;
  std::mutex mutex_;
  size_t reserved_ = 0;                            // guarded by mutex_
  std::deque<std::weak_ptr<Connection>> waiting_;  // in the order they asked; by mutex_
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
