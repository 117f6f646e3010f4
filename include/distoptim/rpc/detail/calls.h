#pragma once

// Internal: the untyped calls behind the typed rpc API (api.h, rref.h), and the waits and
// argument conversions they share. Not part of the public API; names may change.

#include <chrono>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>

#include <distoptim/rpc/detail/values.h>
#include <distoptim/rpc/values.h>

namespace distoptim {
namespace rpc {

class WorkerRef;

namespace detail {

/// Blocks until `future` completes, or until `deadline` (none: no bound); returns whether it
/// completed. On a thread of the agent's request pool the wait is managed: the pool may start a
/// thread in its place meanwhile (RpcBackendOptions::max_extra_worker_threads).
bool wait_future(c10::ivalue::Future& future,
                 std::optional<std::chrono::steady_clock::time_point> deadline = std::nullopt);

/// Waits for `future` and returns its value as a T, or throws what the future holds.
/// `describe()` names the call in a conversion error and runs only then.
template <class T, class Describe>
T wait_for_result(c10::ivalue::Future& future, const Describe& describe) {
  wait_future(future);
  future.waitAndThrow();
  if constexpr (std::is_void_v<T>) {
    return;
  } else if constexpr (std::is_same_v<T, c10::IValue>) {
    return future.constValue();
  } else {
    return from_value_described<T>(future.constValue(),
                                   [&describe] { return "the result of " + describe(); });
  }
}

/// rpc_async_values for a caller that only ever waits on the future (never attaches a callback,
/// never hands it on): its reply may complete the future on the thread that reads it, one thread
/// hand-off fewer (docs/threading.md). rpc_sync and the blocking RRef calls use it.
c10::intrusive_ptr<c10::ivalue::Future> waited_call_values(const WorkerRef& to,
                                                           const std::string& function,
                                                           std::vector<c10::IValue> args,
                                                           std::chrono::milliseconds timeout);

/// The arguments of a call as values: to_value of each, in order. The one conversion every call
/// (rpc_sync, rpc_async, remote, RRef method calls) goes through.
template <class... Args>
std::vector<c10::IValue> to_values(Args&&... args) {
  std::vector<c10::IValue> values;
  values.reserve(sizeof...(Args));
  (values.push_back(to_value(std::forward<Args>(args))), ...);
  return values;
}
/// The same for arguments given as a tuple (PyTorch's `args=`).
template <class... Args>
std::vector<c10::IValue> tuple_values(std::tuple<Args...> args) {
  return std::apply([](auto&&... arg) { return to_values(std::move(arg)...); }, std::move(args));
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
