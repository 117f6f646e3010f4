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

#include <distoptim/rpc/detail/typed_function.h>
#include <distoptim/rpc/values.h>

namespace distoptim {
namespace rpc {

/// A callable on IValues: what the registry stores. Arguments arrive by value. A result holding
/// a c10::ivalue::Future is the future of the result (async_execution).
using RawFunction = detail::RawFunctionType;

/// Registers `function` under `name`. Throws c10::ValueError if `name` is empty, taken or
/// reserved (starts with "__distoptim.").
/// Thread safety: safe from any thread (a mutex guards the registry); functions run on the
/// RPC worker threads, so they must be safe to call concurrently.
void register_raw_function(const std::string& name, RawFunction function);

/// Whether a function is registered under `name`. Thread-safe.
bool is_function_registered(const std::string& name);

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
