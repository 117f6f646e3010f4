#pragma once

// The callables a worker runs for its peers. Only functions registered here can be invoked by
// a remote request: nothing else is ever constructed or called from what arrives on the wire.
// Register the same functions in every process, from the same code (static registration):
//
//   int64_t add(int64_t a, int64_t b) { return a + b; }
//   DISTOPTIM_RPC_FUNCTION("add", add);
//
// Parameters and results may be any mix of the types of values.h; a void result returns None.
//
// async_execution (PyTorch's @rpc.functions.async_execution): a function may return the future
// of its result, an RpcFuture<T> (api.h) or a c10::intrusive_ptr<c10::ivalue::Future>; the
// caller's reply (or the value of remote()) is sent when that future completes, and no thread
// of the request pool waits for it meanwhile. An error in the future reaches the caller as a
// RemoteError, as a throw would. The future's callbacks run on the completion thread: a then()
// must not block.
//
//   DISTOPTIM_RPC_FUNCTION("add_via", [](std::string peer, int64_t a, int64_t b) {
//     return rpc_async<int64_t>(peer, "add", std::tuple{a, b}).then([](int64_t sum) {
//       return sum * 2;
//     });
//   });
//
// A RawFunction does the same by returning a c10::IValue that holds a future.
//
// Names starting with "__distoptim." are reserved.

#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>
#include <c10/util/Exception.h>
#include <c10/util/TypeTraits.h>

#include <distoptim/rpc/values.h>

namespace distoptim {
namespace rpc {

template <class T>
class RpcFuture;

/// A callable on IValues: what the registry stores. Arguments arrive by value. A result holding
/// a c10::ivalue::Future is the future of the result (async_execution).
using RawFunction = std::function<c10::IValue(std::vector<c10::IValue> args)>;

/// Registers `function` under `name`. Throws c10::ValueError if `name` is empty, taken or
/// reserved (starts with "__distoptim.").
/// Thread safety: safe from any thread (a mutex guards the registry); functions run on the
/// RPC worker threads, so they must be safe to call concurrently.
void register_raw_function(const std::string& name, RawFunction function);

/// Whether a function is registered under `name`. Thread-safe.
bool is_function_registered(const std::string& name);

namespace detail {
/// Registers a function under a name reserved for distoptim ("__distoptim.*"): the layers above
/// rpc (distributed autograd, the DistributedOptimizer) register theirs with it.
void register_internal_function(const std::string& name, RawFunction function);

template <class R>
struct IsFutureResult : std::false_type {};
template <class T>
struct IsFutureResult<RpcFuture<T>> : std::true_type {};
template <>
struct IsFutureResult<c10::intrusive_ptr<c10::ivalue::Future>> : std::true_type {};

/// What a typed function's result `call()` of type R becomes: None for void, the future itself
/// for a future (async_execution), else to_value.
template <class R, class Call>
c10::IValue result_to_value(const std::string& name, Call&& call) {
  if constexpr (std::is_void_v<R>) {
    call();
    return c10::IValue();
  } else if constexpr (IsFutureResult<std::decay_t<R>>::value) {
    c10::intrusive_ptr<c10::ivalue::Future> future;
    if constexpr (std::is_same_v<std::decay_t<R>, c10::intrusive_ptr<c10::ivalue::Future>>) {
      future = call();
    } else {
      future = call().raw();
    }
    TORCH_CHECK_VALUE(future != nullptr, "'", name, "' returned a null future");
    return c10::IValue(std::move(future));
  } else {
    return to_value(call());
  }
}

template <class F, class R, class... Args, size_t... I>
RawFunction wrap_typed(std::string name, F function, c10::guts::typelist::typelist<Args...>,
                       std::index_sequence<I...>) {
  return [name = std::move(name),
          function = std::move(function)](std::vector<c10::IValue> args) -> c10::IValue {
    TORCH_CHECK_TYPE(args.size() == sizeof...(Args), "'", name, "' takes ", sizeof...(Args),
                     " argument(s), got ", args.size());
    auto call = [&]() -> decltype(auto) {
      return function(from_value<std::decay_t<Args>>(
          args[I], "argument " + std::to_string(I) + " of '" + name + "'")...);
    };
    return result_to_value<R>(name, call);
  };
}
}  // namespace detail

/// Registers a typed function (function pointer, lambda or functor with one operator()).
/// Arguments that do not convert to the parameter types fail the call with a c10::TypeError
/// naming the argument, which reaches the caller as a RemoteError.
template <class F>
void register_function(const std::string& name, F function) {
  using Traits = c10::guts::infer_function_traits_t<F>;
  using R = typename Traits::return_type;
  using Params = typename Traits::parameter_types;
  register_raw_function(
      name, detail::wrap_typed<F, R>(name, std::move(function), Params{},
                                     std::make_index_sequence<Traits::number_of_parameters>{}));
}

/// Registers a function when constructed; the form behind DISTOPTIM_RPC_FUNCTION.
class FunctionRegistrar {
 public:
  template <class F>
  FunctionRegistrar(const std::string& name, F function) {
    register_function(name, std::move(function));
  }
};

}  // namespace rpc
}  // namespace distoptim

#define DISTOPTIM_RPC_CONCAT_INNER(a, b) a##b
#define DISTOPTIM_RPC_CONCAT(a, b) DISTOPTIM_RPC_CONCAT_INNER(a, b)

/// Registers `function` under the string `name` at static-initialization time (namespace scope).
#define DISTOPTIM_RPC_FUNCTION(name, function)                           \
  static const ::distoptim::rpc::FunctionRegistrar DISTOPTIM_RPC_CONCAT( \
      distoptim_rpc_function_registrar_, __COUNTER__)(name, function)
