#pragma once

// Conversions between C++ values and the c10::IValue values RPC messages carry, used by the
// typed callables (registry.h) and the typed calls (api.h). Supported: c10::IValue itself,
// at::Tensor, bool, every integer type (range-checked), float and double, std::string (and, to
// send only, C strings such as literals), std::vector<T>, std::map / std::unordered_map with
// std::string or integer keys, std::tuple<T...>, std::pair<A, B> (as a 2-tuple) and
// std::optional<T> (None when empty).
//
// from_value throws c10::TypeError naming what was expected and what arrived, prefixed with a
// caller-supplied context ("argument 2 of 'add' on worker 'ps'").

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>
#include <c10/util/Exception.h>

#include <distoptim/rpc/detail/values.h>

namespace distoptim {
namespace rpc {

template <class T, class Enable = void>
struct ValueTraits;

/// Whether T converts to and from a c10::IValue (has a ValueTraits specialization).
template <class T, class = void>
struct HasValueTraits : std::false_type {};
template <class T>
struct HasValueTraits<T, std::void_t<decltype(ValueTraits<T>::name())>> : std::true_type {};

template <class T>
c10::IValue to_value(T&& value) {
  return ValueTraits<std::decay_t<T>>::to(std::forward<T>(value));
}

template <class T>
T from_value(const c10::IValue& value, const std::string& context) {
  return ValueTraits<T>::from(value, context);
}

template <>
struct ValueTraits<c10::IValue> {
  static constexpr const char* name() { return "any value"; }
  static c10::IValue to(c10::IValue value) { return value; }
  static c10::IValue from(const c10::IValue& value, const std::string&) { return value; }
};

template <>
struct ValueTraits<at::Tensor> {
  static constexpr const char* name() { return "Tensor"; }
  static c10::IValue to(at::Tensor value) { return c10::IValue(std::move(value)); }
  static at::Tensor from(const c10::IValue& value, const std::string& context) {
    if (!value.isTensor()) detail::throw_type_mismatch(context, name(), value);
    return value.toTensor();
  }
};

template <>
struct ValueTraits<bool> {
  static constexpr const char* name() { return "bool"; }
  static c10::IValue to(bool value) { return c10::IValue(value); }
  static bool from(const c10::IValue& value, const std::string& context) {
    if (!value.isBool()) detail::throw_type_mismatch(context, name(), value);
    return value.toBool();
  }
};

template <class T>
struct ValueTraits<T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>>> {
  static constexpr const char* name() { return "int"; }
  static c10::IValue to(T value) {
    if constexpr (std::is_unsigned_v<T> && sizeof(T) >= sizeof(int64_t)) {
      TORCH_CHECK_VALUE(value <= static_cast<T>(std::numeric_limits<int64_t>::max()),
                        "rpc: the integer ", value, " does not fit a signed 64-bit int");
    }
    return c10::IValue(static_cast<int64_t>(value));
  }
  static T from(const c10::IValue& value, const std::string& context) {
    if (!value.isInt()) detail::throw_type_mismatch(context, name(), value);
    const int64_t wide = value.toInt();
    if constexpr (std::is_signed_v<T>) {
      TORCH_CHECK_VALUE(
          wide >= std::numeric_limits<T>::min() && wide <= std::numeric_limits<T>::max(), context,
          ": ", wide, " is out of range of the parameter's integer type");
    } else {
      TORCH_CHECK_VALUE(wide >= 0 && static_cast<uint64_t>(wide) <= std::numeric_limits<T>::max(),
                        context, ": ", wide, " is out of range of the parameter's integer type");
    }
    return static_cast<T>(wide);
  }
};

template <class T>
struct ValueTraits<T, std::enable_if_t<std::is_floating_point_v<T>>> {
  static constexpr const char* name() { return "float"; }
  static c10::IValue to(T value) { return c10::IValue(static_cast<double>(value)); }
  /// Ints are accepted where a float is expected, as Python does.
  static T from(const c10::IValue& value, const std::string& context) {
    if (value.isDouble()) return static_cast<T>(value.toDouble());
    if (value.isInt()) return static_cast<T>(value.toInt());
    detail::throw_type_mismatch(context, name(), value);
  }
};

template <>
struct ValueTraits<std::string> {
  static constexpr const char* name() { return "str"; }
  static c10::IValue to(std::string value) { return c10::IValue(std::move(value)); }
  static std::string from(const c10::IValue& value, const std::string& context) {
    if (!value.isString()) detail::throw_type_mismatch(context, name(), value);
    return value.toStringRef();
  }
};

/// A C string (a literal in `std::tuple{"ps", 1}`) is sent as a str. Send-only: a callable's
/// parameter or a call's result has no storage of its own for a const char* to point into, so
/// those take std::string.
template <class T>
struct ValueTraits<T,
                   std::enable_if_t<std::is_same_v<T, const char*> || std::is_same_v<T, char*>>> {
  static c10::IValue to(const char* value) {
    TORCH_CHECK_VALUE(value != nullptr, "rpc: a null C string cannot be sent (as a str)");
    return c10::IValue(std::string(value));
  }
  template <class U = T>
  static U from(const c10::IValue&, const std::string&) {
    static_assert(!std::is_same_v<U, U>,
                  "rpc: a received str cannot be a C string; take std::string instead");
  }
};

template <class T>
struct ValueTraits<std::optional<T>> {
  static constexpr const char* name() { return "optional value"; }
  static c10::IValue to(std::optional<T> value) {
    return value ? to_value(std::move(*value)) : c10::IValue();
  }
  static std::optional<T> from(const c10::IValue& value, const std::string& context) {
    if (value.isNone()) return std::nullopt;
    return from_value<T>(value, context);
  }
};

template <class T>
struct ValueTraits<std::vector<T>> {
  static constexpr const char* name() { return "list"; }
  static c10::IValue to(std::vector<T> values) {
    c10::impl::GenericList list(c10::AnyType::get());
    list.reserve(values.size());
    for (auto& value : values) list.push_back(to_value(std::move(value)));
    return c10::IValue(std::move(list));
  }
  static std::vector<T> from(const c10::IValue& value, const std::string& context) {
    if (!value.isList()) detail::throw_type_mismatch(context, name(), value);
    std::vector<T> out;
    const auto items = value.toListRef();
    out.reserve(items.size());
    for (size_t i = 0; i < items.size(); ++i) {
      out.push_back(from_value<T>(items[i], context + "[" + std::to_string(i) + "]"));
    }
    return out;
  }
};

template <class K, class V>
struct ValueTraits<std::map<K, V>> : detail::MapTraits<std::map<K, V>> {};
template <class K, class V>
struct ValueTraits<std::unordered_map<K, V>> : detail::MapTraits<std::unordered_map<K, V>> {};

template <class... Ts>
struct ValueTraits<std::tuple<Ts...>> {
  static constexpr const char* name() { return "tuple"; }
  static c10::IValue to(std::tuple<Ts...> values) {
    return std::apply(
        [](auto&&... items) {
          return c10::IValue(
              c10::ivalue::Tuple::create(std::vector<c10::IValue>{to_value(std::move(items))...}));
        },
        std::move(values));
  }
  static std::tuple<Ts...> from(const c10::IValue& value, const std::string& context) {
    if (!value.isTuple()) detail::throw_type_mismatch(context, name(), value);
    const auto& elements = value.toTupleRef().elements();
    TORCH_CHECK_TYPE(elements.size() == sizeof...(Ts), context, ": expected a tuple of ",
                     sizeof...(Ts), " elements, got ", elements.size());
    return from_elements(elements, context, std::index_sequence_for<Ts...>{});
  }

 private:
  template <size_t... I>
  static std::tuple<Ts...> from_elements(c10::ArrayRef<c10::IValue> elements,
                                         const std::string& context, std::index_sequence<I...>) {
    return std::tuple<Ts...>(
        from_value<Ts>(elements[I], context + "[" + std::to_string(I) + "]")...);
  }
};

template <class A, class B>
struct ValueTraits<std::pair<A, B>> {
  static constexpr const char* name() { return "tuple"; }
  static c10::IValue to(std::pair<A, B> value) {
    return ValueTraits<std::tuple<A, B>>::to(std::tuple<A, B>(std::move(value)));
  }
  static std::pair<A, B> from(const c10::IValue& value, const std::string& context) {
    auto [a, b] = ValueTraits<std::tuple<A, B>>::from(value, context);
    return {std::move(a), std::move(b)};
  }
};

}  // namespace rpc
}  // namespace distoptim
