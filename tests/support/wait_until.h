#pragma once

// A bounded poll, for tests that wait on a state another thread or process reaches (a counter, a
// file, a connection closed) where no event signals it.

#include <chrono>
#include <thread>

namespace distoptim {
namespace testing {

/// Calls `done` every 5 ms until it returns true (then true) or `limit` passes (then false).
template <class Predicate>
bool wait_until(Predicate done, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

}  // namespace testing
}  // namespace distoptim
