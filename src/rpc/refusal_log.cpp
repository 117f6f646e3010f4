#include "refusal_log.h"

#include <c10/util/Exception.h>

namespace distoptim {
namespace rpc {
namespace detail {

RefusalLog::RefusalLog(std::string self_name, std::chrono::milliseconds interval, int burst,
                       std::string verb)
    : self_name_(std::move(self_name)),
      verb_(std::move(verb)),
      interval_(interval),
      burst_(burst) {}

RefusalLog::~RefusalLog() {
  std::lock_guard<std::mutex> lock(mutex_);
  summarize_locked(Clock::now());
}

void RefusalLog::refused(const std::string& peer_address, const std::string& why) {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  if (now - interval_start_ >= interval_) {
    summarize_locked(now);
    interval_start_ = now;
    logged_ = 0;
  }
  if (logged_ < burst_) {
    ++logged_;
    TORCH_WARN("rpc: worker '", self_name_, "' ", verb_, " a connection from ", peer_address, ": ",
               why);
    return;
  }
  ++counted_;
  last_ = peer_address + ": " + why;
}

void RefusalLog::summarize_locked(Clock::time_point now) {
  if (counted_ == 0) return;
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(now - interval_start_);
  TORCH_WARN("rpc: worker '", self_name_, "' ", verb_, " ", counted_,
             " more connection(s) in the last ", seconds.count(), " s (the last from ", last_, ")");
  counted_ = 0;
  last_.clear();
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
