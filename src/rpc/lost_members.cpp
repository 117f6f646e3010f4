#include "lost_members.h"

#include <c10/util/Exception.h>

namespace distoptim {
namespace rpc {
namespace detail {

LostMemberWatch::LostMemberWatch(LivenessProbe::Ask ask, std::chrono::milliseconds timeout,
                                 IsMember is_member, Drop drop)
    : ask_(std::move(ask)),
      timeout_(timeout),
      is_member_(std::move(is_member)),
      drop_(std::move(drop)),
      thread_([this] { run(); }) {}

LostMemberWatch::~LostMemberWatch() { stop(); }

void LostMemberWatch::suspect(int id) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    suspects_.push_back(id);
  }
  changed_.notify_all();
}

void LostMemberWatch::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    suspects_.clear();
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void LostMemberWatch::run() {
  while (true) {
    int id = -1;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [this] { return stopping_ || !suspects_.empty(); });
      if (stopping_) return;
      id = suspects_.front();
      suspects_.pop_front();
    }
    try {
      if (!is_member_(id)) continue;
      const std::string why = check(id);
      // Checked again: a notice that it left may have come meanwhile.
      if (!why.empty() && is_member_(id)) drop_(id, why);
    } catch (const std::exception& error) {
      // The agent is stopping (its calls throw then): nothing more to drop.
      TORCH_WARN("rpc: checking whether worker id ", id, " is alive failed: ", error.what());
    }
  }
}

std::string LostMemberWatch::check(int id) {
  c10::intrusive_ptr<c10::ivalue::Future> answer;
  try {
    answer = ask_(id, timeout_);
  } catch (...) {
    return liveness_failure(std::current_exception(), timeout_);
  }
  // Bounded by the call's own timeout; polled, so that stop() is not held up by it.
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_ && !answer->completed()) {
    changed_.wait_for(lock, std::chrono::milliseconds(10));
  }
  if (stopping_ || !answer->hasError()) return {};
  return liveness_failure(answer->exception_ptr(), timeout_);
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
