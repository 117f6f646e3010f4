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
// A RemoteModule can be made anew when its owner died and a process was started again under the
// owner's name (dist_optim/recovery.h does it for a trainer's whole model): make_anew() creates
// the module there again from its constructor's arguments (kept when it was created with them;
// given with make_anew_with for one bound to an existing module), bind_to_remote() binds the
// handle to a module another handle made anew. PyTorch has neither (a lost owner ends its job).
//
// Threading: as RRef; concurrent forwards run concurrently on the owner's request pool. Not
// make_anew, make_anew_with or bind_to_remote while another call uses the handle.

#include <chrono>
#include <cstdint>
#include <functional>
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
#include <distoptim/rpc/detail/rref_calls.h>
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

/// What every RemoteModule<C> offers whatever its class C: what a recovery of its lost owner
/// needs (dist_optim/recovery.h).
class RemoteModuleBase : public torch::nn::Module {
 public:
  /// Where the module lives.
  const RemoteDevice& remote_device() const { return device_; }
  /// Names the module across workers: the id of the reference this handle was created or first
  /// bound with (kept when it is made anew or bound again), the same on every handle made from
  /// that reference.
  const std::string& module_key() const { return key_; }
  /// remote_parameters(true) of the module as it is now.
  virtual std::vector<RRef<at::Tensor>> owner_parameters() const = 0;
  /// Whether make_anew() can make the module anew: its constructor's arguments are known.
  virtual bool can_make_anew() const = 0;
  /// Creates the module again from its constructor's arguments on the worker remote_device names
  /// now (a process started again under a lost owner's name), asynchronously as the constructor
  /// does, and binds this handle to it; returns its reference, untyped. c10::ValueError naming
  /// the module when its arguments are unknown (bound to an existing module: see make_anew_with)
  /// or its device names a rank (a process started again has another).
  virtual RRef<c10::IValue> make_anew() = 0;
  /// Binds this handle to the module that `function`(key) returns on `worker`, the module's
  /// worker by name (a module another handle made anew and handed out, say); checked by
  /// confirm() of module_rref(). c10::ValueError when `worker` is not remote_device's.
  virtual void bind_to_remote(const std::string& worker, const std::string& function,
                              const std::string& key) = 0;
  /// The module's worker becomes `worker` (a backup that takes over a lost owner's modules,
  /// dist_optim/recovery.h's hot_standby), keeping the device: the next make_anew or
  /// bind_to_remote makes or finds the module there. Changes nothing else; c10::ValueError for
  /// an empty name.
  void move_to(const std::string& worker) {
    TORCH_CHECK_VALUE(!worker.empty(), "RemoteModule::move_to: the worker's name is empty");
    device_.worker_name = worker;
    device_.rank.reset();
  }

 protected:
  explicit RemoteModuleBase(RemoteDevice device)
      : torch::nn::Module("RemoteModule"), device_(std::move(device)) {}
  void keep_key(const detail::RRefHandle& handle) { key_ = detail::rref_global_id(handle); }

  RemoteDevice device_;
  std::string key_;
};

/// A module of class C living on another worker (see the top of this file).
template <class C>
class RemoteModule : public RemoteModuleBase {
 public:
  /// Creates C(args...) on the worker `remote_device` names (PyTorch's RemoteModule(remote_device,
  /// module_cls, args)). Returns at once; `timeout` bounds the creation. Throws c10::ValueError for
  /// a bad remote_device, c10::TypeError for a class never registered, DistributedError with no
  /// agent running.
  template <class... Args>
  explicit RemoteModule(const std::string& remote_device, std::tuple<Args...> args = {},
                        std::chrono::milliseconds timeout = kDefaultTimeout)
      : RemoteModule(parse_remote_device(remote_device)) {
    make_anew_with(std::move(args), timeout);
    module_rref_ = make_(device_);
    keep_key(module_rref_.handle());
  }

  /// A RemoteModule over a module that already exists (PyTorch's init_from_module_rref), e.g.
  /// one another worker created and sent: several RemoteModules may share one module.
  /// `module_key`: the sending handle's module_key(), which a module made anew after its owner
  /// was lost keeps; give it with the reference, so that this handle too binds to the module's
  /// next incarnation (empty: the reference's id, right until the module is made anew). Throws
  /// c10::ValueError if `module_rref` is empty or owned by another worker than remote_device's.
  static std::shared_ptr<RemoteModule> init_from_module_rref(const std::string& remote_device,
                                                             RRef<C> module_rref,
                                                             const std::string& module_key = {}) {
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
    module->key_ =
        module_key.empty() ? detail::rref_global_id(module->module_rref_.handle()) : module_key;
    return module;
  }

  /// The arguments C's constructor takes to make this module anew (make_anew): for a handle
  /// bound to an existing module, those it was created with. A RemoteModule created here keeps
  /// its own.
  template <class... Args>
  void make_anew_with(std::tuple<Args...> args,
                      std::chrono::milliseconds timeout = kDefaultTimeout) {
    // On the worker device_ names when it is made (move_to may change it).
    make_ = [args = std::move(args), timeout](const RemoteDevice& device) {
      return remote<C>(device.worker(), detail::remote_module_class_name(typeid(C)), args, timeout);
    };
  }
  bool can_make_anew() const override { return static_cast<bool>(make_); }
  RRef<c10::IValue> make_anew() override {
    TORCH_CHECK_VALUE(make_, "RemoteModule::make_anew: ", describe(),
                      " was bound to an existing module: give its constructor's arguments with "
                      "make_anew_with");
    TORCH_CHECK_VALUE(!device_.rank.has_value(), "RemoteModule::make_anew: ", describe(),
                      " names its worker by rank; a process started again has another rank: name "
                      "the worker in remote_device");
    module_rref_ = make_(device_);
    return RRef<c10::IValue>(module_rref_.handle());
  }
  void bind_to_remote(const std::string& worker, const std::string& function,
                      const std::string& key) override {
    TORCH_CHECK_VALUE(device_.worker_name == worker, "RemoteModule::bind_to_remote: ", describe(),
                      " cannot be bound to a module of worker '", worker, "'");
    module_rref_ = remote<C>(worker, function, std::tuple{key});
  }
  std::vector<RRef<at::Tensor>> owner_parameters() const override {
    return remote_parameters(true);
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
  explicit RemoteModule(RemoteDevice device) : RemoteModuleBase(std::move(device)) {}

  std::string describe() const {
    return "RemoteModule(" + detail::remote_module_class_name(typeid(C)) + " on '" +
           device_.to_string() + "')";
  }

  RRef<C> module_rref_;
  std::function<RRef<C>(const RemoteDevice&)> make_;  // creates C(args...) on a device's worker
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
