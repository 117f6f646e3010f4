#include <distoptim/rpc/registry.h>

#include <mutex>
#include <unordered_map>

#include <distoptim/rpc/detail/internal_registry.h>

#include "registry_internal.h"

namespace distoptim {
namespace rpc {
namespace {

struct FunctionRegistry {
  std::mutex mutex;
  std::unordered_map<std::string, std::shared_ptr<const RawFunction>> functions;  // by mutex
};

// Function-local static: registrations run during static initialization of other files. Never
// destroyed: registrars may outlive main.
FunctionRegistry& function_registry() {
  static FunctionRegistry* instance = new FunctionRegistry();
  return *instance;
}

constexpr const char* kReservedPrefix = "__distoptim.";

void insert_function(const std::string& name, RawFunction function) {
  FunctionRegistry& r = function_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const bool inserted =
      r.functions.emplace(name, std::make_shared<const RawFunction>(std::move(function))).second;
  TORCH_CHECK_VALUE(inserted, "register_function: a function or class named '", name,
                    "' is already registered");
}

}  // namespace

void register_raw_function(const std::string& name, RawFunction function) {
  TORCH_CHECK_VALUE(!name.empty(), "register_function: the name must not be empty");
  TORCH_CHECK_VALUE(function != nullptr, "register_function: no function given for '", name, "'");
  TORCH_CHECK_VALUE(name.rfind(kReservedPrefix, 0) != 0, "register_function: the name '", name,
                    "' starts with '", kReservedPrefix, "', which is reserved for distoptim");
  insert_function(name, std::move(function));
}

bool is_function_registered(const std::string& name) {
  FunctionRegistry& r = function_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.functions.count(name) > 0;
}

namespace detail {

void register_internal_function(const std::string& name, RawFunction function) {
  insert_function(name, std::move(function));
}

std::shared_ptr<const RawFunction> find_function(const std::string& name) {
  FunctionRegistry& r = function_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.functions.find(name);
  return it == r.functions.end() ? nullptr : it->second;
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
