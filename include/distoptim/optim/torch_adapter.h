#pragma once

#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <distoptim/optim/adadelta.h>
#include <distoptim/optim/adagrad.h>
#include <distoptim/optim/adam.h>
#include <distoptim/optim/adamax.h>
#include <distoptim/optim/functional_optimizer.h>
#include <distoptim/optim/option_bag.h>
#include <distoptim/optim/rmsprop.h>
#include <distoptim/optim/rprop.h>
#include <distoptim/optim/sgd.h>

namespace distoptim {
namespace optim {

/// The options of one param group of a FunctionalOptimizerAdapter, as LibTorch sees them
/// (`adapter.param_groups()[g].options()`): the group's complete OptionBag (defaults merged with
/// the group's overrides). `get_lr`/`set_lr` read and write the "lr" entry, so LibTorch's LR
/// schedulers (torch::optim::StepLR, ...) drive the adapter as they drive torch::optim::Adam.
/// Changes made here take effect at the adapter's next `step`.
///
/// Also the way to give a LibTorch-style param group its own options:
/// `OptimizerParamGroup(params, std::make_unique<AdapterOptions>(AdamOptions(0.1)))`.
/// A group's options are complete, as in LibTorch: every key of the given options applies.
///
/// Thread safety: a plain value type. Errors: `get_lr`/`set_lr` on a bag without "lr" throw
/// c10::Error.
class AdapterOptions : public torch::optim::OptimizerCloneableOptions<AdapterOptions> {
 public:
  AdapterOptions() = default;
  explicit AdapterOptions(OptionBag bag) : bag_(std::move(bag)) {}
  /// From a typed options struct (SGDOptions, AdamOptions, ... or a user's own).
  template <class Options,
            class = std::enable_if_t<!std::is_same<std::decay_t<Options>, AdapterOptions>::value &&
                                     !std::is_same<std::decay_t<Options>, OptionBag>::value>>
  explicit AdapterOptions(const Options& options) : bag_(options_to_bag(options)) {}

  const OptionBag& bag() const { return bag_; }
  OptionBag& bag() { return bag_; }
  /// Sets one option (chainable): `options.set("momentum", 0.95)`.
  AdapterOptions& set(const std::string& key, c10::IValue value);

  double get_lr() const override;
  void set_lr(const double lr) override;

  /// Every option as an archive entry of the same name.
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override;

 private:
  OptionBag bag_;
};

/// A FunctionalOptimizer exposed as a `torch::optim::Optimizer`: a drop-in for LibTorch's own
/// optimizers (param groups, zero_grad, step with a closure, LR schedulers, torch::save/load).
///
/// The adapter owns the functional optimizer and mirrors its groups in `param_groups()`: the
/// same tensors (sharing storage and `.grad`), each group's options an AdapterOptions holding the
/// group's complete OptionBag. `step(closure)` evaluates the closure with grad mode on (as
/// LibTorch does), pushes option changes made through `param_groups()` to the functional
/// optimizer (`set_group_options`), forwards groups appended through the base class's
/// `add_param_group`, reads each parameter's `.grad` (a parameter without one is skipped, its
/// state untouched) and runs the functional step under NoGradGuard. It returns the closure's
/// loss, or an undefined tensor without a closure.
///
/// Differences from LibTorch's optimizers, all deliberate:
/// - Per-parameter state lives in `functional()` (keyed by parameter index, see
///   `FunctionalOptimizer::state`); the base class's `state()` map stays empty.
/// - `save`/`load` store the functional optimizer's state dict (keyed by parameter index, the
///   form Python's `torch.load` reads) under the archive key "distoptim_state_dict", not
///   LibTorch's TensorImpl-address keys; `torch::save(adapter, path)` and
///   `torch::load(adapter, path)` round-trip into an adapter over parameters of the same shapes
///   and grouping. Archives written by LibTorch's own optimizers are refused.
/// - A group appended through the base class that the functional optimizer refuses (say, a
///   parameter already optimized) makes every `step` throw until it is removed from
///   `param_groups()`; the adapter's own `add_param_group` checks before adding anything.
/// - Parameters are added only as whole groups. Changing the parameter list of an existing group
///   (the deprecated `add_parameters`, or editing `param_groups()[g].params()`) makes the next
///   `step` throw.
/// - Changing `defaults()` affects only groups added afterwards, as in LibTorch; `load` resets
///   `defaults()` to the snapshot's (the functional optimizer restores its defaults too).
///
/// Thread safety: none, as LibTorch's optimizers; calls on one adapter must not overlap.
/// Errors: c10::Error, from the adapter (naming the group) or from the functional optimizer,
/// thrown before any parameter or state changes. A step that throws after pushing an option
/// change leaves that change applied (it is what the user asked for), parameters untouched.
class FunctionalOptimizerAdapter : public torch::optim::Optimizer {
 public:
  /// Takes ownership of `optimizer` (not null).
  explicit FunctionalOptimizerAdapter(std::unique_ptr<FunctionalOptimizer> optimizer);
  /// Builds the optimizer registered as `name` (see registry.h) over `groups`.
  FunctionalOptimizerAdapter(const std::string& name, std::vector<ParamGroup> groups,
                             const OptionBag& defaults = {});
  FunctionalOptimizerAdapter(const std::string& name, std::vector<at::Tensor> params,
                             const OptionBag& defaults = {});

  /// Runs the closure (if any), then one update from the parameters' `.grad`.
  at::Tensor step(LossClosure closure = nullptr) override;

  /// LibTorch's form: `group.options()`, if present, must be an AdapterOptions (its keys apply
  /// over the defaults); without options the group takes `defaults()`.
  void add_param_group(const torch::optim::OptimizerParamGroup& group);
  /// distoptim's form: `group.overrides` apply over the defaults.
  void add_param_group(const ParamGroup& group);

  /// Writes the functional optimizer's state dict; `load` reads it back (validated as a whole
  /// first: on error nothing changes).
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  /// The functional optimizer. Option changes made through `param_groups()` reach it at the next
  /// `step`, `add_param_group`, `load` or `sync()`.
  FunctionalOptimizer& functional() { return *optimizer_; }
  const FunctionalOptimizer& functional() const { return *optimizer_; }

  /// Pushes pending changes made through the base class (group options, appended groups) to
  /// the functional optimizer now. `step` calls it.
  void sync();

  /// The archive key `save` writes.
  static constexpr const char* kArchiveKey = "distoptim_state_dict";

 protected:
  /// Converts LibTorch-style groups to distoptim's, checking each group's options type.
  static std::vector<ParamGroup> to_param_groups(
      const std::vector<torch::optim::OptimizerParamGroup>& groups, const OptionBag& defaults);

 private:
  /// The mirror of functional group `group` as LibTorch sees it.
  torch::optim::OptimizerParamGroup mirror_group(size_t group) const;
  /// The mirror's options of `group`, refreshed from the functional optimizer.
  void refresh_group_options(size_t group);
  /// Adds `group` (overrides relative to the functional optimizer's defaults) to the functional
  /// optimizer, then its mirror. Pending groups must have been synced first.
  void append_group(const ParamGroup& group);

  std::unique_ptr<FunctionalOptimizer> optimizer_;
  // Gradient list handed to the functional step; kept to avoid reallocating each step.
  std::vector<at::Tensor> grads_;
};

/// A FunctionalOptimizerAdapter over the built-in `Optim` (with options struct `Options`),
/// constructed as LibTorch's optimizers are:
/// `distoptim::optim::TorchAdam opt(model->parameters(), distoptim::optim::AdamOptions(1e-3));`
/// See the aliases below.
template <class Optim, class Options>
class TorchOptimizer : public FunctionalOptimizerAdapter {
 public:
  explicit TorchOptimizer(std::vector<at::Tensor> params, const Options& defaults = Options())
      : FunctionalOptimizerAdapter(std::make_unique<Optim>(
            std::vector<ParamGroup>{ParamGroup(std::move(params))}, defaults)) {}
  explicit TorchOptimizer(std::vector<ParamGroup> groups, const Options& defaults = Options())
      : FunctionalOptimizerAdapter(std::make_unique<Optim>(std::move(groups), defaults)) {}
  /// LibTorch-style groups; a group's options, if any, must be an AdapterOptions.
  explicit TorchOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                          const Options& defaults = Options())
      : FunctionalOptimizerAdapter(
            std::make_unique<Optim>(to_param_groups(groups, options_to_bag(defaults)), defaults)) {}

  Optim& functional() { return static_cast<Optim&>(FunctionalOptimizerAdapter::functional()); }
  const Optim& functional() const {
    return static_cast<const Optim&>(FunctionalOptimizerAdapter::functional());
  }
};

/// The built-ins as `torch::optim::Optimizer`s, one per functional optimizer; each takes the
/// distoptim options struct of the same name (TorchSGD takes SGDOptions, ...).
using TorchSGD = TorchOptimizer<SGD, SGDOptions>;
using TorchAdam = TorchOptimizer<Adam, AdamOptions>;
using TorchAdamW = TorchOptimizer<AdamW, AdamWOptions>;
using TorchAdagrad = TorchOptimizer<Adagrad, AdagradOptions>;
using TorchAdadelta = TorchOptimizer<Adadelta, AdadeltaOptions>;
using TorchAdamax = TorchOptimizer<Adamax, AdamaxOptions>;
using TorchRMSprop = TorchOptimizer<RMSprop, RMSpropOptions>;
using TorchRprop = TorchOptimizer<Rprop, RpropOptions>;

}  // namespace optim
}  // namespace distoptim
