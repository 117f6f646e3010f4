#include <distoptim/optim/option_bag.h>

#include <charconv>
#include <sstream>

#include <ATen/core/Dict.h>
#include <c10/util/Exception.h>

#include <distoptim/optim/detail/option_fields.h>

namespace distoptim {
namespace optim {

namespace {

// The shortest text that reads back as the same double: 0.1 prints as 0.1.
std::string render_double(double value) {
  char buffer[32];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}

std::string render(const c10::IValue& value) {
  std::ostringstream out;
  if (value.isDouble()) {
    out << render_double(value.toDouble());
  } else if (value.isTuple()) {
    out << '(';
    const auto& elements = value.toTupleRef().elements();
    for (size_t i = 0; i < elements.size(); ++i) out << (i ? ", " : "") << render(elements[i]);
    out << ')';
  } else if (value.isBool()) {
    out << (value.toBool() ? "true" : "false");
  } else if (value.isString()) {
    out << '"' << value.toStringRef() << '"';
  } else {
    out << value;
  }
  return out.str();
}

bool is_number(const c10::IValue& v) { return v.isDouble() || v.isInt(); }

double as_double(const c10::IValue& v) { return v.isDouble() ? v.toDouble() : v.toInt(); }

bool same_value(const c10::IValue& a, const c10::IValue& b) {
  if (is_number(a) && is_number(b)) return as_double(a) == as_double(b);
  if (a.isTuple() && b.isTuple()) {
    const auto& x = a.toTupleRef().elements();
    const auto& y = b.toTupleRef().elements();
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i) {
      if (!same_value(x[i], y[i])) return false;
    }
    return true;
  }
  if (a.isBool() && b.isBool()) return a.toBool() == b.toBool();
  if (a.isString() && b.isString()) return a.toStringRef() == b.toStringRef();
  return false;
}

bool is_allowed_value(const c10::IValue& v) {
  if (is_number(v) || v.isBool() || v.isString()) return true;
  if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) {
      if (!is_number(e)) return false;
    }
    return true;
  }
  if (v.isList()) {
    for (const auto& e : v.toListRef()) {
      if (!is_number(e)) return false;
    }
    return true;
  }
  return false;
}

}  // namespace

OptionBag::OptionBag(std::initializer_list<std::pair<const std::string, c10::IValue>> entries) {
  for (const auto& e : entries) set(e.first, e.second);
}

OptionBag& OptionBag::set(const std::string& key, c10::IValue value) {
  TORCH_CHECK_TYPE(is_allowed_value(value), "option '", key, "': value ", render(value),
                   " of type ", value.tagKind(),
                   " is not an optimizer option value (number, bool, string or tuple of numbers)");
  // Lists of numbers are stored as tuples so equal options compare and serialize alike.
  if (value.isList()) {
    std::vector<c10::IValue> elements(value.toListRef().begin(), value.toListRef().end());
    value = c10::ivalue::Tuple::create(std::move(elements));
  }
  values_[key] = std::move(value);
  return *this;
}

OptionBag& OptionBag::set(const std::string& key, std::initializer_list<double> values) {
  std::vector<c10::IValue> elements(values.begin(), values.end());
  return set(key, c10::ivalue::Tuple::create(std::move(elements)));
}

bool OptionBag::contains(const std::string& key) const { return values_.count(key) != 0; }

const c10::IValue& OptionBag::at(const std::string& key) const {
  auto it = values_.find(key);
  TORCH_CHECK_INDEX(it != values_.end(), "option '", key, "' is not set in ", to_string());
  return it->second;
}

std::vector<std::string> OptionBag::keys() const {
  std::vector<std::string> out;
  out.reserve(values_.size());
  for (const auto& item : values_) out.push_back(item.first);
  return out;
}

double OptionBag::get_double(const std::string& key) const {
  const auto& v = at(key);
  TORCH_CHECK_TYPE(is_number(v), "option '", key, "' must be a number, got ", render(v));
  return as_double(v);
}

int64_t OptionBag::get_int(const std::string& key) const {
  const auto& v = at(key);
  TORCH_CHECK_TYPE(v.isInt(), "option '", key, "' must be an integer, got ", render(v));
  return v.toInt();
}

bool OptionBag::get_bool(const std::string& key) const {
  const auto& v = at(key);
  TORCH_CHECK_TYPE(v.isBool(), "option '", key, "' must be a bool, got ", render(v));
  return v.toBool();
}

std::string OptionBag::get_string(const std::string& key) const {
  const auto& v = at(key);
  TORCH_CHECK_TYPE(v.isString(), "option '", key, "' must be a string, got ", render(v));
  return v.toStringRef();
}

std::tuple<double, double> OptionBag::get_pair(const std::string& key) const {
  const auto& v = at(key);
  const bool ok = v.isTuple() && v.toTupleRef().elements().size() == 2 &&
                  is_number(v.toTupleRef().elements()[0]) &&
                  is_number(v.toTupleRef().elements()[1]);
  TORCH_CHECK_TYPE(ok, "option '", key, "' must be a pair of numbers, got ", render(v));
  const auto& e = v.toTupleRef().elements();
  return std::make_tuple(as_double(e[0]), as_double(e[1]));
}

OptionBag OptionBag::merged_with(const OptionBag& overrides) const {
  OptionBag out = *this;
  for (const auto& item : overrides.values_) out.values_[item.first] = item.second;
  return out;
}

c10::IValue OptionBag::to_ivalue() const {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  for (const auto& item : values_) dict.insert(item.first, item.second);
  return dict;
}

OptionBag OptionBag::from_ivalue(const c10::IValue& value) {
  TORCH_CHECK_TYPE(value.isGenericDict(), "an option bag must be a dict, got ", value.tagKind());
  OptionBag bag;
  for (const auto& entry : value.toGenericDict()) {
    TORCH_CHECK_TYPE(entry.key().isString(), "option names must be strings, got ",
                     entry.key().tagKind());
    bag.set(entry.key().toStringRef(), entry.value());
  }
  return bag;
}

OptionBag OptionBag::changes_from(const OptionBag& current) const {
  OptionBag changed;
  for (const auto& item : values_) {
    auto it = current.values_.find(item.first);
    if (it == current.values_.end() || !same_value(item.second, it->second)) {
      changed.values_.insert(item);
    }
  }
  return changed;
}

std::string OptionBag::to_string() const {
  std::ostringstream out;
  out << '{';
  bool first = true;
  for (const auto& item : values_) {
    out << (first ? "" : ", ") << item.first << ": " << render(item.second);
    first = false;
  }
  out << '}';
  return out.str();
}

bool OptionBag::operator==(const OptionBag& other) const {
  if (values_.size() != other.values_.size()) return false;
  for (const auto& item : values_) {
    auto it = other.values_.find(item.first);
    if (it == other.values_.end() || !same_value(item.second, it->second)) return false;
  }
  return true;
}

namespace detail {

void read_option(const OptionBag& bag, const std::string& key, double& field) {
  field = bag.get_double(key);
}
void read_option(const OptionBag& bag, const std::string& key, int64_t& field) {
  field = bag.get_int(key);
}
void read_option(const OptionBag& bag, const std::string& key, bool& field) {
  field = bag.get_bool(key);
}
void read_option(const OptionBag& bag, const std::string& key, std::string& field) {
  field = bag.get_string(key);
}
void read_option(const OptionBag& bag, const std::string& key, std::tuple<double, double>& field) {
  field = bag.get_pair(key);
}

c10::IValue option_to_ivalue(double value) { return value; }
c10::IValue option_to_ivalue(int64_t value) { return value; }
c10::IValue option_to_ivalue(bool value) { return value; }
c10::IValue option_to_ivalue(const std::string& value) { return value; }
c10::IValue option_to_ivalue(const std::tuple<double, double>& value) {
  return c10::ivalue::Tuple::create({std::get<0>(value), std::get<1>(value)});
}

void throw_unknown_option(const std::string& bag, const std::string& key,
                          const std::vector<std::string>& known) {
  std::ostringstream names;
  for (size_t i = 0; i < known.size(); ++i) names << (i ? ", " : "") << known[i];
  TORCH_CHECK_VALUE(false, "unknown optimizer option '", key, "' in ", bag,
                    "; known options: ", names.str());
}

}  // namespace detail

}  // namespace optim
}  // namespace distoptim
