#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>

namespace distoptim {
namespace rpc {
namespace detail {

/// The internal function a liveness check calls: it does nothing, so that it is answered by the
/// peer's transport and request threads while its user code trains or sleeps.
constexpr const char* kAliveFunction = "__distoptim.rpc.alive";

/// Why a liveness check with `timeout` failed with `error`: "it did not answer a liveness check
/// within 2000 ms (stopped, hung or unreachable)", or the call's error.
std::string liveness_failure(const std::exception_ptr& error, std::chrono::milliseconds timeout);

/// Tells a stopped, hung or unreachable worker from a slow one while this worker waits for it (at
/// a graceful shutdown's barriers): each check() asks the workers it is given whether they are
/// alive (a call of kAliveFunction with `timeout`), unless the last question to one is still
/// unanswered; a worker whose answer does not come within `timeout`, or whose call fails, is
/// lost. A slow worker answers from its transport's threads, whatever its user code does.
///
/// Threading: one thread (the one waiting at the barrier) uses a probe; the calls complete on the
/// agent's threads and are only looked at from that thread.
class LivenessProbe {
 public:
  /// Calls kAliveFunction on `peer` with `timeout`; returns the call's future.
  using Ask = std::function<c10::intrusive_ptr<c10::ivalue::Future>(
      int peer, std::chrono::milliseconds timeout)>;

  /// `refused_us(peer)`: whether `peer` refused this worker's connection (another shared
  /// secret): it answered, so it is alive, and its failed checks are no loss.
  LivenessProbe(Ask ask, std::chrono::milliseconds timeout,
                std::function<bool(int peer)> refused_us = {});

  /// Asks each of `peers` that has no question in flight. Returns a peer whose last call failed
  /// and why ("it did not answer a liveness check within 2000 ms (stopped, hung or
  /// unreachable)", or the call's error); nullopt while all answer.
  std::optional<std::pair<int, std::string>> check(const std::vector<int>& peers);

 private:
  const Ask ask_;
  const std::chrono::milliseconds timeout_;
  const std::function<bool(int)> refused_us_;
  std::map<int, c10::intrusive_ptr<c10::ivalue::Future>> in_flight_;
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
