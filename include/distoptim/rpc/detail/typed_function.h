#pragma once

// Internal: how typed functions, constructors and methods become the untyped callables the
// registry stores (registry.h, classes.h). Not part of the public API; names may change.

#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>
#include <c10/util/Exception.h>
#include <c10/util/TypeTraits.h>

#include <distoptim/rpc/detail/values.h>
#include <distoptim/rpc/values.h>

namespace distoptim {
namespace rpc {

template <class T>
class RpcFuture;

namespace detail {

/// rpc::RawFunction, the type the registry stores.
using RawFunctionType = std::function<c10::IValue(std::vector<c10::IValue> args)>;

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
RawFunctionType wrap_typed(std::string name, F function, c10::guts::typelist::typelist<Args...>,
                           std::index_sequence<I...>) {
  return [name = std::move(name),
          function = std::move(function)](std::vector<c10::IValue> args) -> c10::IValue {
    TORCH_CHECK_TYPE(args.size() == sizeof...(Args), "'", name, "' takes ", sizeof...(Args),
                     " argument(s), got ", args.size());
    auto call = [&]() -> decltype(auto) {
      return function(from_value_described<std::decay_t<Args>>(
          args[I], [&] { return "argument " + std::to_string(I) + " of '" + name + "'"; })...);
    };
    return result_to_value<R>(name, call);
  };
}
template <class M>
struct MethodTraits;
template <class C, class R, class... A>
struct MethodTraits<R (C::*)(A...)> {
  using Return = R;
  using Params = c10::guts::typelist::typelist<A...>;
  static constexpr size_t kArity = sizeof...(A);
};
template <class C, class R, class... A>
struct MethodTraits<R (C::*)(A...) const> : MethodTraits<R (C::*)(A...)> {};

template <class C, class M, class R, class... Args, size_t... I>
RawFunctionType wrap_method(std::string name, M method, c10::guts::typelist::typelist<Args...>,
                            std::index_sequence<I...>) {
  return [name = std::move(name), method](std::vector<c10::IValue> args) -> c10::IValue {
    TORCH_CHECK_TYPE(args.size() == sizeof...(Args) + 1, "'", name, "' takes ", sizeof...(Args),
                     " argument(s), got ", static_cast<int64_t>(args.size()) - 1);
    std::shared_ptr<C> self = from_value_described<std::shared_ptr<C>>(
        args[0], [&] { return "the object of '" + name + "'"; });
    auto call = [&]() -> decltype(auto) {
      return ((*self).*method)(from_value_described<std::decay_t<Args>>(
          args[I + 1], [&] { return "argument " + std::to_string(I) + " of '" + name + "'"; })...);
    };
    return result_to_value<R>(name, call);
  };
}
/// The constructor of class C as a registered function: arguments of types CtorArgs.
template <class C, class... CtorArgs>
RawFunctionType class_constructor(const std::string& name) {
  auto make = [](CtorArgs... args) -> std::shared_ptr<C> {
    return std::make_shared<C>(std::move(args)...);
  };
  using Traits = c10::guts::infer_function_traits_t<decltype(make)>;
  return wrap_typed<decltype(make), std::shared_ptr<C>>(
      name, std::move(make), typename Traits::parameter_types{},
      std::make_index_sequence<sizeof...(CtorArgs)>{});
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
