// The receive budget's reservations, and the queue of connections waiting for room.

#include "receive_budget.h"

#include "connection.h"

namespace distoptim {
namespace rpc {
namespace detail {

bool ReceiveBudget::reserve(size_t bytes, const std::shared_ptr<Connection>& connection) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (reserved_ == 0 || (reserved_ <= limit_ && bytes <= limit_ - reserved_)) {
    reserved_ += bytes;
    return true;
  }
  waiting_.push_back(connection);
  return false;
}

void ReceiveBudget::release(size_t bytes) {
  std::deque<std::weak_ptr<Connection>> wake;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    reserved_ -= bytes;
    wake.swap(waiting_);
  }
  // Each tries again on its own I/O thread, in the order they asked; those that still do not
  // fit queue again.
  for (const auto& waiter : wake) {
    if (auto connection = waiter.lock()) connection->retry_reservation();
  }
}

size_t ReceiveBudget::reserved() {
  std::lock_guard<std::mutex> lock(mutex_);
  return reserved_;
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
