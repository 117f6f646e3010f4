#pragma once

// Internal: what the conversions of values.h share: a conversion's error, described only when
// it fails, and the conversion of both kinds of map. Not part of the public API; names may change.

#include <string>
#include <type_traits>
#include <utility>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace distoptim {
namespace rpc {

template <class T>
c10::IValue to_value(T&& value);
template <class T>
T from_value(const c10::IValue& value, const std::string& context);

namespace detail {

/// from_value<T>(value, describe()), with the context built only when the conversion fails: a
/// context built on every call costs allocations on every call of a typed function or rpc_sync.
template <class T, class Describe>
T from_value_described(const c10::IValue& value, const Describe& describe) {
  try {
    return from_value<T>(value, std::string());
  } catch (...) {
    // Converted again, for the error with its context.
  }
  return from_value<T>(value, describe());
}

[[noreturn]] inline void throw_type_mismatch(const std::string& context, const char* expected,
                                             const c10::IValue& got) {
  TORCH_CHECK_TYPE(false, context, ": expected ", expected, ", got ", got.tagKind());
}

template <class Map>
struct MapTraits {
  using Key = typename Map::key_type;
  using Mapped = typename Map::mapped_type;
  static_assert(std::is_same_v<Key, std::string> || std::is_integral_v<Key>,
                "rpc: dict keys must be strings or integers");
  static constexpr const char* name() { return "dict"; }
  static c10::IValue to(Map values) {
    c10::TypePtr key_type = std::is_same_v<Key, std::string> ? c10::TypePtr(c10::StringType::get())
                                                             : c10::TypePtr(c10::IntType::get());
    c10::impl::GenericDict dict(std::move(key_type), c10::AnyType::get());
    for (auto& [key, value] : values) {
      dict.insert(to_value(key), to_value(std::move(value)));
    }
    return c10::IValue(std::move(dict));
  }
  static Map from(const c10::IValue& value, const std::string& context) {
    if (!value.isGenericDict()) throw_type_mismatch(context, name(), value);
    Map out;
    for (const auto& entry : value.toGenericDict()) {
      Key key = from_value<Key>(entry.key(), context + " (a key)");
      Mapped mapped = from_value<Mapped>(entry.value(), context + "[" + c10::str(key) + "]");
      out.emplace(std::move(key), std::move(mapped));
    }
    return out;
  }
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
