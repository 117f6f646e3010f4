#pragma once

#include <memory>

#include <torch/optim/optimizer.h>

#include <distoptim/optim/functional_optimizer.h>

namespace distoptim {
namespace optim {

/// A LibTorch torch::optim::Optimizer driven as a FunctionalOptimizer (the other way round from
/// FunctionalOptimizerAdapter), so code written against FunctionalOptimizer (the
/// ZeroRedundancyOptimizer's local optimizer, say) also runs LibTorch's optimizers and users'
/// subclasses of them.
///
/// `step(gradients)` lends each gradient to its parameter's `.grad` (an undefined one leaves
/// `.grad` undefined, so LibTorch skips the parameter), runs the optimizer's `step()` and gives
/// every `.grad` back as it was, also when the step throws. Gradients are checked as every
/// FunctionalOptimizer checks them, before anything changes. Groups mirror the optimizer's
/// param groups; `add_param_group` adds one to the optimizer too. name() is "libtorch".
///
/// What does not carry over: options and state. A group's options live in the LibTorch
/// optimizer (set them there); overrides in an OptionBag are refused with c10::ValueError. The
/// optimizer keys its state by tensor address, which means nothing in another process or after
/// a restart, so `state_dict`, `load_state_dict` and `check_state_dict` throw c10::ValueError;
/// save the LibTorch optimizer itself (torch::save) where a checkpoint of it is needed.
///
/// Thread safety: as FunctionalOptimizer's (one caller at a time), and the `.grad` of the
/// parameters must not be used by others during a step.
class LibTorchOptimizerAdapter : public FunctionalOptimizer {
 public:
  /// Takes over `optimizer` (not null; c10::ValueError otherwise). Its parameters must be what
  /// FunctionalOptimizer accepts: dense float32/float64 CPU tensors, each once.
  explicit LibTorchOptimizerAdapter(std::unique_ptr<torch::optim::Optimizer> optimizer);

  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  const torch::optim::Optimizer& optimizer() const { return *optimizer_; }

 protected:
  void check_options(const OptionBag& resolved) const override;
  void on_group_options(size_t group, const OptionBag& resolved) override;
  void on_group_added(size_t group) override;
  void check_portable_state(const char* method) const override;
  void update(size_t group, const std::vector<ParamUpdate>& updates) override;
  void apply_updates(const std::vector<std::vector<ParamUpdate>>& by_group) override;

 private:
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  // While the constructor mirrors the optimizer's own groups, they are not added to it again.
  bool mirroring_ = true;
};

}  // namespace optim
}  // namespace distoptim
