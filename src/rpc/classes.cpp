#include <distoptim/rpc/classes.h>

#include <mutex>
#include <unordered_map>

#include <distoptim/rpc/detail/internal_registry.h>
#include <distoptim/rpc/rref.h>

#include "registry_internal.h"

namespace distoptim {
namespace rpc {
namespace {

struct ClassRegistry {
  std::mutex mutex;
  // Methods by class name, then by method name.
  std::unordered_map<std::string,
                     std::unordered_map<std::string, std::shared_ptr<const RawFunction>>>
      methods;                                                   // guarded by mutex
  std::unordered_map<std::type_index, std::string> class_names;  // guarded by mutex
};

// Function-local static: registrations run during static initialization of other files.
ClassRegistry& class_registry() {
  static ClassRegistry* instance = new ClassRegistry();  // Never destroyed, like the registry.
  return *instance;
}

std::shared_ptr<const RawFunction> find_method(const std::string& class_name,
                                               const std::string& method) {
  ClassRegistry& r = class_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.methods.find(class_name);
  if (it == r.methods.end()) return nullptr;
  auto found = it->second.find(method);
  return found == it->second.end() ? nullptr : found->second;
}

// Runs on the owner: (the RRef, as the owner's handle; the method's name; its arguments).
c10::IValue call_method(std::vector<c10::IValue> args) {
  TORCH_CHECK_VALUE(args.size() == 3 && args[0].isRRef() && args[1].isString() && args[2].isList(),
                    "a method call through an RRef with malformed arguments");
  const detail::RRefHandle& rref = args[0].toRRef();
  const std::string& method = args[1].toStringRef();
  const c10::IValue object = detail::rref_local_value(rref);
  const auto* holder =
      object.isCapsule() ? dynamic_cast<const ObjectHolder*>(object.toCapsule().get()) : nullptr;
  TORCH_CHECK_TYPE(holder != nullptr, "method '", method, "' called on ",
                   detail::describe_rref(rref), ", whose value is a ", object.tagKind(),
                   ", not an object of a remote class");
  auto function = find_method(holder->class_name(), method);
  TORCH_CHECK_VALUE(function != nullptr, "class '", holder->class_name(), "' has no method '",
                    method, "' (register it with DISTOPTIM_RPC_METHOD)");
  std::vector<c10::IValue> call_args{object};
  for (const c10::IValue& arg : args[2].toListRef()) call_args.push_back(arg);
  return (*function)(std::move(call_args));
}

const bool kCallMethodRegistered = [] {
  detail::register_internal_function(detail::kCallMethod, call_method);
  return true;
}();

}  // namespace

void register_raw_method(const std::string& class_name, const std::string& method,
                         RawFunction function) {
  TORCH_CHECK_VALUE(!class_name.empty() && !method.empty(),
                    "register_method: the class name and the method name must not be empty");
  TORCH_CHECK_VALUE(function != nullptr, "register_method: no function given for '", class_name,
                    ".", method, "'");
  ClassRegistry& r = class_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const bool inserted =
      r.methods[class_name]
          .emplace(method, std::make_shared<const RawFunction>(std::move(function)))
          .second;
  TORCH_CHECK_VALUE(inserted, "register_method: '", class_name, ".", method,
                    "' is already registered");
}

void register_class_name(std::type_index type, const std::string& class_name) {
  TORCH_CHECK_VALUE(!class_name.empty(), "register_class: the class name must not be empty");
  ClassRegistry& r = class_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto [it, inserted] = r.class_names.emplace(type, class_name);
  TORCH_CHECK_VALUE(inserted || it->second == class_name, "register_class: the C++ type of '",
                    class_name, "' is already registered as '", it->second, "'");
}

std::string registered_class_name(std::type_index type) {
  ClassRegistry& r = class_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.class_names.find(type);
  TORCH_CHECK_TYPE(it != r.class_names.end(), "rpc: objects of C++ type '", type.name(),
                   "' are not of a registered class (DISTOPTIM_RPC_CLASS)");
  return it->second;
}

namespace detail {

std::vector<c10::IValue> method_call_args(const RRefHandle& rref, const std::string& method,
                                          std::vector<c10::IValue> args) {
  TORCH_CHECK_VALUE(rref != nullptr, "rpc: calling method '", method, "' through an empty RRef");
  TORCH_CHECK_VALUE(!method.empty(), "rpc: empty method name (calling through ",
                    describe_rref(rref), ")");
  (void)kCallMethodRegistered;  // This file's registration must be linked in wherever used.
  c10::impl::GenericList list(c10::AnyType::get());
  for (auto& arg : args) list.push_back(std::move(arg));
  return {c10::IValue(rref), c10::IValue(method), c10::IValue(std::move(list))};
}

c10::intrusive_ptr<c10::ivalue::Future> method_call_values(const RRefHandle& rref,
                                                           const std::string& method,
                                                           std::vector<c10::IValue> args,
                                                           std::chrono::milliseconds timeout,
                                                           bool waited_only) {
  const auto call = waited_only ? waited_call_values : rpc_async_values;
  return call(rref_owner(rref).id, kCallMethod, method_call_args(rref, method, std::move(args)),
              timeout);
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
