#include "liveness.h"

#include <distoptim/comm/errors.h>
#include <distoptim/rpc/detail/internal_registry.h>

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

const bool kAliveRegistered = [] {
  register_internal_function(kAliveFunction,
                             [](std::vector<c10::IValue>) -> c10::IValue { return {}; });
  return true;
}();

}  // namespace

LivenessProbe::LivenessProbe(Ask ask, std::chrono::milliseconds timeout,
                             std::function<bool(int peer)> refused_us)
    : ask_(std::move(ask)), timeout_(timeout), refused_us_(std::move(refused_us)) {}

std::string liveness_failure(const std::exception_ptr& error, std::chrono::milliseconds timeout) {
  try {
    std::rethrow_exception(error);
  } catch (const TimeoutError&) {
    return "it did not answer a liveness check within " + std::to_string(timeout.count()) +
           " ms (stopped, hung or unreachable)";
  } catch (const c10::Error& error) {
    return std::string("a liveness check failed: ") + error.what_without_backtrace();
  } catch (const std::exception& error) {
    return std::string("a liveness check failed: ") + error.what();
  }
}

std::optional<std::pair<int, std::string>> LivenessProbe::check(const std::vector<int>& peers) {
  (void)kAliveRegistered;
  for (int peer : peers) {
    c10::intrusive_ptr<c10::ivalue::Future>& question = in_flight_[peer];
    if (question && !question->completed()) continue;
    if (question && question->hasError()) {
      const std::string why = liveness_failure(question->exception_ptr(), timeout_);
      question.reset();  // asked afresh if it is still waited for
      // A peer that refused our connection answered it: alive, waited for.
      if (refused_us_ && refused_us_(peer)) continue;
      return std::make_pair(peer, why);
    }
    try {
      question = ask_(peer, timeout_);
    } catch (...) {
      return std::make_pair(peer, liveness_failure(std::current_exception(), timeout_));
    }
  }
  return std::nullopt;
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
