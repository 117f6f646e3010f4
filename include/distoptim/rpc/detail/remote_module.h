#pragma once

// Internal: what RemoteModule<C> and register_remote_module (remote_module.h) call, defined in
// src/rpc/remote_module.cpp but for the templates. Not part of the public API; names may change.

#include <memory>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/TypeTraits.h>
#include <torch/nn/module.h>

#include <distoptim/rpc/classes.h>
#include <distoptim/rpc/detail/typed_function.h>
#include <distoptim/rpc/rref.h>

namespace distoptim {
namespace rpc {
namespace detail {

/// RRefs (owned here) to `module`'s parameters: what a RemoteModule's remote_parameters returns.
std::vector<RRef<at::Tensor>> module_parameter_rrefs(const torch::nn::Module& module, bool recurse);
/// The registered name of the module class `type`; c10::TypeError telling how to register it.
std::string remote_module_class_name(const std::type_info& type);
/// The c10::ValueError a RemoteModule throws for a method it cannot offer.
[[noreturn]] void throw_remote_module_unsupported(const std::string& method,
                                                  const std::string& module);

/// The methods RemoteModule<C> calls on the owner's module of the class registered as `name`:
/// `forward`, `train` and `remote_parameters`.
template <class C>
void register_module_methods(const std::string& name) {
  static_assert(std::is_base_of_v<torch::nn::Module, C>,
                "a remote module's class must derive from torch::nn::Module");
  register_method<C>(name, "forward", &C::forward);
  register_method<C>(name, "train", &torch::nn::Module::train);
  auto parameters = [](const std::shared_ptr<C>& module, bool recurse) {
    return module_parameter_rrefs(*module, recurse);
  };
  register_raw_method(
      name, "remote_parameters",
      wrap_typed<decltype(parameters), std::vector<RRef<at::Tensor>>>(
          name + ".remote_parameters", std::move(parameters),
          c10::guts::typelist::typelist<std::shared_ptr<C>, bool>{}, std::index_sequence<0, 1>{}));
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
