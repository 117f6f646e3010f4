#pragma once

// RemoteModule (PyTorch's torch.distributed.nn.RemoteModule): a torch::nn::Module created on
// another worker, whose forward runs there through RPC.
//
//   // On every worker, at namespace scope: the module class and its constructor's parameters.
//   DISTOPTIM_REMOTE_MODULE(torch::nn::LinearImpl, int64_t, int64_t);
//
//   // On a trainer:
//   auto fc = std::make_shared<RemoteModule<torch::nn::LinearImpl>>("ps/cpu", std::tuple{20, 30});
//   dist_autograd::ContextGuard context;
//   at::Tensor out = fc->forward(input);               // runs on "ps", recorded in the context
//   DistributedOptimizer optimizer("sgd", fc->remote_parameters(), {{"lr", 0.05}});
//
// forward(args...) is one RPC to the owner calling the module's forward with those arguments
// (all of them: C++ has no defaults across the wire); forward_async returns its future. Inside a
// distributed autograd context the call is recorded like any RPC, so gradients flow back to the
// module's parameters on the owner. As in PyTorch, the module is created asynchronously (remote()):
// an error constructing it arrives at the first forward, or at module_rref().confirm().
//
// A RemoteModule is an nn::Module, so a local model may hold one as a submodule (register_module),
// but it has no local parameters or buffers: parameters() is empty and remote_parameters() gives
// RRefs to the owner's, for the DistributedOptimizer. train()/eval() reach the remote module; the
// local copy of the flag follows. save()/load() are refused (save the module on its owner). Only
// the CPU device is supported (remote_device "worker/cpu", "rank:1/cpu" or "worker").
//
// Threading: as RRef; concurrent forwards run concurrently on the owner's request pool.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

#include <distoptim/rpc/api.h>
#include <distoptim/rpc/classes.h>
#include <distoptim/rpc/detail/remote_module.h>
#include <distoptim/rpc/rref.h>

namespace distoptim {
namespace rpc {

/// A parsed remote_device string, as PyTorch's: "<workername>/<device>", "rank:<rank>/<device>"
/// or "<workername>" (device cpu). A bare device ("cpu") names no worker and is refused here.
struct RemoteDevice {
  std::string worker_name;  // empty when given by rank
  std::optional<int> rank;
  std::string device;  // "cpu"

  /// The worker, for calls.
  WorkerRef worker() const;
  /// The worker's info (a running agent needed); c10::ValueError for an unknown worker.
  WorkerInfo worker_info() const;
  /// As written back: "ps/cpu", "rank:1/cpu".
  std::string to_string() const;
};

/// Parses `remote_device`; c10::ValueError naming it for a malformed string, an empty worker
/// name, a bare device, or a device other than the CPU.
RemoteDevice parse_remote_device(const std::string& remote_device);

/// Registers the nn::Module subclass C under `name` for RemoteModule<C>: its constructor (taking
/// CtorArgs), `forward`, `train` and `remote_parameters`. C's forward must not be overloaded.
template <class C, class... CtorArgs>
void register_remote_module(const std::string& name) {
  register_class<C, CtorArgs...>(name);
  detail::register_module_methods<C>(name);
}

/// The form behind DISTOPTIM_REMOTE_MODULE.
template <class C, class... CtorArgs>
struct RemoteModuleRegistrar {
  explicit RemoteModuleRegistrar(const std::string& name) {
    register_remote_module<C, CtorArgs...>(name);
  }
};

/// A module of class C living on another worker (see the top of this file).
template <class C>
class RemoteModule : public torch::nn::Module {
 public:
  /// Creates C(args...) on the worker `remote_device` names (PyTorch's RemoteModule(remote_device,
  /// module_cls, args)). Returns at once; `timeout` bounds the creation. Throws c10::ValueError for
  /// a bad remote_device, c10::TypeError for a class never registered, DistributedError with no
  /// agent running.
  template <class... Args>
  explicit RemoteModule(const std::string& remote_device, std::tuple<Args...> args = {},
                        std::chrono::milliseconds timeout = kDefaultTimeout)
      : RemoteModule(parse_remote_device(remote_device)) {
    module_rref_ = remote<C>(device_.worker(), detail::remote_module_class_name(typeid(C)),
                             std::move(args), timeout);
  }

  /// A RemoteModule over a module that already exists (PyTorch's init_from_module_rref), e.g.
  /// one another worker created and sent: several RemoteModules may share one module. Throws
  /// c10::ValueError if `module_rref` is empty or owned by another worker than remote_device's.
  static std::shared_ptr<RemoteModule> init_from_module_rref(const std::string& remote_device,
                                                             RRef<C> module_rref) {
    std::shared_ptr<RemoteModule> module(new RemoteModule(parse_remote_device(remote_device)));
    TORCH_CHECK_VALUE(module_rref.defined(),
                      "RemoteModule::init_from_module_rref: module_rref is "
                      "empty");
    const WorkerInfo owner = module_rref.owner();
    TORCH_CHECK_VALUE(module->device_.worker_info().id == owner.id,
                      "RemoteModule::init_from_module_rref: remote_device '",
                      module->device_.to_string(), "' is not the module's owner '", owner.name,
                      "'");
    module->module_rref_ = std::move(module_rref);
    return module;
  }

  /// The module's forward on its owner, with these arguments; blocks for the result (R).
  template <class R = at::Tensor, class... Args>
  R forward(Args&&... args) const {
    return module_rref_.rpc_sync().template method<R>("forward", std::forward<Args>(args)...);
  }
  /// The same, returning the result's future.
  template <class R = at::Tensor, class... Args>
  RpcFuture<R> forward_async(Args&&... args) const {
    return module_rref_.rpc_async().template method<R>("forward", std::forward<Args>(args)...);
  }

  /// RRefs to the remote module's parameters (with its submodules' when `recurse`), in the order
  /// of its parameters(): for the DistributedOptimizer.
  std::vector<RRef<at::Tensor>> remote_parameters(bool recurse = true) const {
    return module_rref_.rpc_sync().template method<std::vector<RRef<at::Tensor>>>(
        "remote_parameters", recurse);
  }

  /// The reference to the module on its owner (PyTorch's get_module_rref()).
  const RRef<C>& module_rref() const { return module_rref_; }
  const RRef<C>& get_module_rref() const { return module_rref_; }
  /// Where the module lives.
  const RemoteDevice& remote_device() const { return device_; }

  /// Sets training mode on the remote module (one RPC), then on this handle.
  void train(bool on = true) override {
    module_rref_.rpc_sync().template method<void>("train", on);
    torch::nn::Module::train(on);
  }

  void save(torch::serialize::OutputArchive& /*archive*/) const override {
    detail::throw_remote_module_unsupported("save", describe());
  }
  void load(torch::serialize::InputArchive& /*archive*/) override {
    detail::throw_remote_module_unsupported("load", describe());
  }
  void pretty_print(std::ostream& stream) const override { stream << describe(); }

 private:
  explicit RemoteModule(RemoteDevice device)
      : torch::nn::Module("RemoteModule"), device_(std::move(device)) {}

  std::string describe() const {
    return "RemoteModule(" + detail::remote_module_class_name(typeid(C)) + " on '" +
           device_.to_string() + "')";
  }

  RemoteDevice device_;
  RRef<C> module_rref_;
};

}  // namespace rpc
}  // namespace distoptim

/// Registers `Class` (an nn::Module subclass, named as written) for RemoteModule<Class>, with a
/// constructor taking the listed parameter types:
/// DISTOPTIM_REMOTE_MODULE(torch::nn::LinearImpl, int64_t, int64_t). Namespace scope; on every
/// worker that may own one.
#define DISTOPTIM_REMOTE_MODULE(Class, ...)                                                        \
  static const ::distoptim::rpc::RemoteModuleRegistrar<Class, ##__VA_ARGS__> DISTOPTIM_RPC_CONCAT( \
      distoptim_remote_module_registrar_, __COUNTER__)(#Class)
