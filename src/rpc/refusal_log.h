#pragma once

#include <chrono>
#include <mutex>
#include <string>

namespace distoptim {
namespace rpc {
namespace detail {

/// The warnings of a worker's refused (or closed, with `verb` "closed") connections, at a bounded
/// rate: anyone who can reach the listener can make it refuse connections as fast as it can open
/// them, and a warning each would let them fill the log (and spend the I/O thread on writing it).
///
/// In each interval the first `burst` refusals are logged in full; the rest are counted, and the
/// first refusal after the interval ends (or the log's destruction, at the worker's stop) logs
/// one summary line for them: "worker 'w' refused N more connection(s) in the last T s (the last
/// from ADDR: WHY)". Every refusal is either logged or counted in a summary. Thread-safe.
class RefusalLog {
 public:
  RefusalLog(std::string self_name, std::chrono::milliseconds interval = std::chrono::seconds(10),
             int burst = 5, std::string verb = "refused");
  ~RefusalLog();
  RefusalLog(const RefusalLog&) = delete;
  RefusalLog& operator=(const RefusalLog&) = delete;

  /// A connection from `peer_address` refused for `why`.
  void refused(const std::string& peer_address, const std::string& why);

 private:
  using Clock = std::chrono::steady_clock;
  // Logs the summary of the counted refusals, if any; mutex_ held.
  void summarize_locked(Clock::time_point now);

  const std::string self_name_;
  const std::string verb_;
  const std::chrono::milliseconds interval_;
  const int burst_;
  std::mutex mutex_;
  Clock::time_point interval_start_;  // guarded by mutex_; the epoch before the first refusal
  int logged_ = 0;                    // in full, this interval; guarded by mutex_
  int counted_ = 0;                   // beyond the burst, this interval; guarded by mutex_
  std::string last_;                  // the last counted one, "ADDR: WHY"; guarded by mutex_
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
