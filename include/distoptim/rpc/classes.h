#pragma once

// Remote classes: a class registered with its constructor's parameter types can be created on
// another worker by remote<T>(to, "ClassName", args) (rref.h); the object stays on that worker,
// and its registered methods are called through the RRef:
//
//   struct EmbeddingTable : torch::nn::Module {
//     EmbeddingTable(int64_t ntoken, int64_t ninp);
//     at::Tensor forward(const at::Tensor& input);
//   };
//   DISTOPTIM_RPC_CLASS(EmbeddingTable, int64_t, int64_t);
//   DISTOPTIM_RPC_METHOD(EmbeddingTable, forward);
//
//   RRef<EmbeddingTable> table = remote<EmbeddingTable>("ps", "EmbeddingTable", std::tuple{10, 4});
//   at::Tensor out = table.rpc_sync().method<at::Tensor>("forward", input);
//
// The class is registered under its name as written in the macro; it shares the namespace of
// function names.

#include <memory>
#include <string>
#include <typeindex>
#include <typeinfo>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <distoptim/rpc/detail/values.h>
#include <distoptim/rpc/registry.h>
#include <distoptim/rpc/values.h>

namespace distoptim {
namespace rpc {

/// Registers `function` as method `method` of the remote class `class_name`; its first argument
/// is the object (a value of ObjectHolder). Throws c10::ValueError if taken. Thread-safe.
void register_raw_method(const std::string& class_name, const std::string& method,
                         RawFunction function);

/// The registry of C++ types of remote classes (behind register_class). Thread-safe;
/// registered_class_name throws c10::TypeError for a type never registered.
void register_class_name(std::type_index type, const std::string& class_name);
std::string registered_class_name(std::type_index type);

/// An object of a remote class as a c10::IValue holds it on its owner (a capsule). It never
/// travels: sending one is a c10::TypeError.
class ObjectHolder : public torch::CustomClassHolder {
 public:
  ObjectHolder(std::string class_name, std::type_index type, std::shared_ptr<void> object)
      : class_name_(std::move(class_name)), type_(type), object_(std::move(object)) {}
  const std::string& class_name() const { return class_name_; }
  std::type_index type() const { return type_; }
  const std::shared_ptr<void>& object() const { return object_; }

 private:
  std::string class_name_;
  std::type_index type_;
  std::shared_ptr<void> object_;
};

/// Objects of registered classes, by shared pointer (the object is shared, never copied).
template <class C>
struct ValueTraits<std::shared_ptr<C>> {
  static constexpr const char* name() { return "object of a remote class"; }
  static c10::IValue to(std::shared_ptr<C> object) {
    TORCH_CHECK_VALUE(object != nullptr, "rpc: a null object of class '",
                      registered_class_name(typeid(C)), "'");
    return c10::IValue::make_capsule(c10::make_intrusive<ObjectHolder>(
        registered_class_name(typeid(C)), std::type_index(typeid(C)), std::move(object)));
  }
  static std::shared_ptr<C> from(const c10::IValue& value, const std::string& context) {
    const ObjectHolder* holder =
        value.isCapsule() ? dynamic_cast<const ObjectHolder*>(value.toCapsule().get()) : nullptr;
    if (holder == nullptr) detail::throw_type_mismatch(context, name(), value);
    TORCH_CHECK_TYPE(holder->type() == std::type_index(typeid(C)), context,
                     ": expected an object of class '", registered_class_name(typeid(C)),
                     "', got one of class '", holder->class_name(), "'");
    return std::static_pointer_cast<C>(holder->object());
  }
};

/// Registers class C under `name`, constructible remotely with arguments of types CtorArgs
/// (C must be constructible from them). Throws c10::ValueError if the name is taken or reserved.
template <class C, class... CtorArgs>
void register_class(const std::string& name) {
  register_class_name(typeid(C), name);
  register_raw_function(name, detail::class_constructor<C, CtorArgs...>(name));
}

/// Registers `method` (a pointer to a member function of C or of a base of C) as method
/// `method_name` of the remote class `class_name`.
template <class C, class M>
void register_method(const std::string& class_name, const std::string& method_name, M method) {
  using Traits = detail::MethodTraits<M>;
  register_raw_method(class_name, method_name,
                      detail::wrap_method<C, M, typename Traits::Return>(
                          class_name + "." + method_name, method, typename Traits::Params{},
                          std::make_index_sequence<Traits::kArity>{}));
}

/// Registers a class or a method when constructed; the forms behind the macros below.
template <class C, class... CtorArgs>
struct ClassRegistrar {
  explicit ClassRegistrar(const std::string& name) { register_class<C, CtorArgs...>(name); }
};
template <class C>
struct MethodRegistrar {
  template <class M>
  MethodRegistrar(const std::string& class_name, const std::string& method_name, M method) {
    register_method<C>(class_name, method_name, method);
  }
};

}  // namespace rpc
}  // namespace distoptim

/// Registers class `Class` (named as written) with a constructor taking the listed parameter
/// types: DISTOPTIM_RPC_CLASS(EmbeddingTable, int64_t, int64_t, double). Namespace scope.
#define DISTOPTIM_RPC_CLASS(Class, ...)                                                     \
  static const ::distoptim::rpc::ClassRegistrar<Class, ##__VA_ARGS__> DISTOPTIM_RPC_CONCAT( \
      distoptim_rpc_class_registrar_, __COUNTER__)(#Class)

/// Registers `Class::method` as a method callable through an RRef to a `Class` object, under
/// the name `method`. Namespace scope.
#define DISTOPTIM_RPC_METHOD(Class, method)                                   \
  static const ::distoptim::rpc::MethodRegistrar<Class> DISTOPTIM_RPC_CONCAT( \
      distoptim_rpc_method_registrar_, __COUNTER__)(#Class, #method, &Class::method)
