#pragma once

#include <memory>
#include <mutex>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>

#include "transport/io_loop.h"

namespace distoptim {
namespace rpc {
namespace detail {

/// A thread that makes blocking calls and may lead the agent's I/O loop while it waits for them
/// (IoLoop::lead_left_loop_until): one per thread, made at its first such call. A loop is left
/// for its next wait only while it comes back to wait: it runs, or the future it waits on has
/// completed. One blocked on another future (the second of two calls made at once, say) would
/// not lead, and the loop would go unread until its watching thread took it back.
class CallingThread final : public IoLoop::NextWaiter {
 public:
  /// The calling thread's, or null where its waits may not lead a loop: on a pool's thread, whose
  /// awaited reply may be queued behind it, or on a loop's own.
  static std::shared_ptr<const CallingThread> current();

  bool comes_back() const override;

  /// For as long as it lives, this thread waits on `future` (wait_future). Made before the wait
  /// looks for a loop left for it: a loop thread that decides afterwards sees it.
  class Waiting {
   public:
    Waiting(const CallingThread& thread, const c10::ivalue::Future& future);
    ~Waiting();
    Waiting(const Waiting&) = delete;
    Waiting& operator=(const Waiting&) = delete;

   private:
    const CallingThread& thread_;
  };

 private:
  mutable std::mutex mutex_;
  mutable const c10::ivalue::Future* waits_on_ = nullptr;  // guarded by mutex_
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
