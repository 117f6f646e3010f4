#include "calling_thread.h"

#include "executor.h"

namespace distoptim {
namespace rpc {
namespace detail {

std::shared_ptr<const CallingThread> CallingThread::current() {
  if (Executor::current() != nullptr || IoLoop::on_loop_thread()) {
    return nullptr;
  }
  thread_local const auto kThisThread = std::make_shared<const CallingThread>();
  return kThisThread;
}

bool CallingThread::comes_back() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return waits_on_ == nullptr || waits_on_->completed();
}

CallingThread::Waiting::Waiting(const CallingThread& thread, const c10::ivalue::Future& future)
    : thread_(thread) {
  std::lock_guard<std::mutex> lock(thread_.mutex_);
  thread_.waits_on_ = &future;
}

CallingThread::Waiting::~Waiting() {
  std::lock_guard<std::mutex> lock(thread_.mutex_);
  thread_.waits_on_ = nullptr;
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
