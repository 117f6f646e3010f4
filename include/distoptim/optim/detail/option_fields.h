#pragma once

// Internal: one field of a typed options struct read from and written to an OptionBag, for
// options_from_bag and options_to_bag (option_bag.h), defined in src/optim/option_bag.cpp. Not
// part of the public API; names may change.

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/core/ivalue.h>

namespace distoptim {
namespace optim {

class OptionBag;

namespace detail {

void read_option(const OptionBag& bag, const std::string& key, double& field);
void read_option(const OptionBag& bag, const std::string& key, int64_t& field);
void read_option(const OptionBag& bag, const std::string& key, bool& field);
void read_option(const OptionBag& bag, const std::string& key, std::string& field);
void read_option(const OptionBag& bag, const std::string& key, std::tuple<double, double>& field);
c10::IValue option_to_ivalue(double value);
c10::IValue option_to_ivalue(int64_t value);
c10::IValue option_to_ivalue(bool value);
c10::IValue option_to_ivalue(const std::string& value);
c10::IValue option_to_ivalue(const std::tuple<double, double>& value);
[[noreturn]] void throw_unknown_option(const std::string& bag, const std::string& key,
                                       const std::vector<std::string>& known);

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
