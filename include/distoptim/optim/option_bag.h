#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/core/ivalue.h>

#include <distoptim/optim/detail/option_fields.h>

namespace distoptim {
namespace optim {

/// A string-keyed bag of optimizer options, the untyped twin of the typed option structs
/// (SGDOptions, AdamOptions, ...). It is what travels to remote workers and into checkpoints,
/// so every value is an IValue: a double, an int, a bool, a string or a tuple of doubles.
///
/// Thread safety: a plain value type; concurrent reads are safe, writes need outside locking.
/// Errors: a getter called with a missing key or a value of the wrong type throws c10::Error
/// naming the key.
class OptionBag {
 public:
  OptionBag() = default;
  OptionBag(std::initializer_list<std::pair<const std::string, c10::IValue>> entries);

  /// Sets `key` to `value` (chainable): `OptionBag().set("lr", 0.1).set("nesterov", true)`.
  OptionBag& set(const std::string& key, c10::IValue value);
  /// A tuple of numbers: `OptionBag().set("betas", {0.9, 0.98})`.
  OptionBag& set(const std::string& key, std::initializer_list<double> values);
  bool contains(const std::string& key) const;
  bool empty() const { return values_.empty(); }
  size_t size() const { return values_.size(); }
  const c10::IValue& at(const std::string& key) const;
  std::vector<std::string> keys() const;
  const std::map<std::string, c10::IValue>& items() const { return values_; }

  /// Typed reads. A number stored as int converts to double; nothing else converts.
  double get_double(const std::string& key) const;
  int64_t get_int(const std::string& key) const;
  bool get_bool(const std::string& key) const;
  std::string get_string(const std::string& key) const;
  /// Accepts a tuple or list of two numbers.
  std::tuple<double, double> get_pair(const std::string& key) const;

  /// Entries of `overrides` replace those of this bag; returns the merged bag.
  OptionBag merged_with(const OptionBag& overrides) const;
  /// The entries of this bag that `current` lacks or holds with another value (compared as ==
  /// does): what must be set on `current` to make it agree with this bag. Keys of `current`
  /// absent from this bag are not in it.
  OptionBag changes_from(const OptionBag& current) const;

  /// Conversion to and from a GenericDict IValue, the form used by serialization.
  c10::IValue to_ivalue() const;
  static OptionBag from_ivalue(const c10::IValue& value);

  /// A readable rendering, e.g. `{lr: 0.1, nesterov: true}`, for error messages and logs.
  std::string to_string() const;

  bool operator==(const OptionBag& other) const;
  bool operator!=(const OptionBag& other) const { return !(*this == other); }

 private:
  std::map<std::string, c10::IValue> values_;
};

/// Converts between a typed options struct and an OptionBag. `Options` must offer
/// `template <class V> void visit(V&& v)` calling `v(name, field)` for each field, with fields of
/// type double, int64_t, bool, std::string or std::tuple<double, double> (see SGDOptions).
/// Unknown keys are an error that lists the known keys.
template <class Options>
Options options_from_bag(const OptionBag& bag, Options base = Options());
template <class Options>
OptionBag options_to_bag(const Options& options);
/// The field names `Options::visit` declares, in declaration order.
template <class Options>
std::vector<std::string> option_keys();

template <class Options>
std::vector<std::string> option_keys() {
  Options options;
  std::vector<std::string> keys;
  options.visit([&](const char* name, auto&) { keys.emplace_back(name); });
  return keys;
}

template <class Options>
Options options_from_bag(const OptionBag& bag, Options base) {
  const std::vector<std::string> known = option_keys<Options>();
  for (const auto& item : bag.items()) {
    bool found = false;
    for (const auto& k : known) found = found || (k == item.first);
    if (!found) detail::throw_unknown_option(bag.to_string(), item.first, known);
  }
  base.visit([&](const char* name, auto& field) {
    if (bag.contains(name)) detail::read_option(bag, name, field);
  });
  return base;
}

template <class Options>
OptionBag options_to_bag(const Options& options) {
  OptionBag bag;
  // visit is non-const so one declaration serves reads and writes.
  Options copy = options;
  copy.visit(
      [&](const char* name, auto& field) { bag.set(name, detail::option_to_ivalue(field)); });
  return bag;
}

}  // namespace optim
}  // namespace distoptim
