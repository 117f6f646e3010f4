#pragma once

#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <distoptim/data_parallel/model_averaging.h>

namespace distoptim {
namespace data_parallel {

/// Post-local SGD (PyTorch's torch.distributed.optim.PostLocalSGDOptimizer): wraps any LibTorch
/// optimizer (torch::optim::SGD, ..., or distoptim's adapters such as optim::TorchAdam) and a
/// model averager; each `step` runs the local optimizer's step, then
/// `averager.average_parameters(param_groups())`, which averages the parameters across ranks
/// when the averager's period comes round.
///
///   auto state = std::make_shared<PostLocalSGDState>(std::nullopt, std::nullopt, 100);
///   ddp.register_comm_hook(post_local_sgd_hook(state));
///   PostLocalSGDOptimizer opt(
///       std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.01)),
///       std::make_shared<PeriodicModelAverager>(/*period=*/4, /*warmup_steps=*/100));
///   for (...) { opt.zero_grad(); loss(ddp.forward(x)).backward(); opt.step(); }
///
/// `warmup_steps` of the averager should equal the hook's `start_local_sgd_iter`.
///
/// The optimizer and the averager are shared: keep a handle to the optimizer to drive it with an
/// LR scheduler, to the averager to read its step. This class is not itself a
/// torch::optim::Optimizer: LibTorch's base class owns its param groups by value, so a wrapper
/// deriving from it could not share the wrapped optimizer's.
///
/// Checkpoints: `state_dict()` is the local optimizer's archive (what its `save` writes) plus the
/// averager's step under the key kStepKey (an int); `load_state_dict` restores both, and when the
/// archive has no step (say, written by a plain optimizer) it warns (TORCH_WARN) and sets the
/// step to 0, as PyTorch does. `torch::save(opt, path)` and `torch::load(opt, path)` work too.
///
/// Thread safety: none, as LibTorch's optimizers. Collectiveness: `step` is collective over the
/// averager's process group (see ModelAverager). Errors: `step` checks the parameters (dense
/// CPU floating point, c10::ValueError naming the parameter and the rank) before the local step;
/// if the averaging then fails (distoptim::DistributedError) the local step stays applied,
/// parameters are as the local optimizer left them and the averager's step is unchanged.
class PostLocalSGDOptimizer {
 public:
  /// The archive key of the averager's step.
  static constexpr const char* kStepKey = "averager_step";

  /// `optim` and `averager` must not be null (c10::ValueError).
  PostLocalSGDOptimizer(std::shared_ptr<torch::optim::Optimizer> optim,
                        std::shared_ptr<ModelAverager> averager);

  /// The local optimizer's step (with `closure`, if given, whose loss it returns), then the
  /// averager's `average_parameters` over every param group.
  at::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr);

  /// Zeroes the gradients as the wrapped optimizer's zero_grad() does, except that gradients
  /// which are views of a DistributedDataParallel's buckets (gradient_as_bucket_view), which
  /// LibTorch's refuses, are zeroed in place and stay views.
  void zero_grad();
  std::vector<torch::optim::OptimizerParamGroup>& param_groups() { return optim_->param_groups(); }
  const std::vector<torch::optim::OptimizerParamGroup>& param_groups() const {
    return optim_->param_groups();
  }
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
    optim_->add_param_group(param_group);
  }

  torch::optim::Optimizer& optimizer() { return *optim_; }
  const torch::optim::Optimizer& optimizer() const { return *optim_; }
  ModelAverager& averager() { return *averager_; }
  const ModelAverager& averager() const { return *averager_; }

  /// The local optimizer's state plus the averager's step (`archive.save_to(path)` writes it).
  torch::serialize::OutputArchive state_dict() const;
  /// Restores the local optimizer's state and the averager's step; without a step, warns and
  /// sets it to 0. A step that is not a non-negative int is a c10::ValueError thrown before
  /// anything changes; if the local optimizer's `load` throws, the step is unchanged (whether
  /// the optimizer's own state is depends on it: distoptim's adapters change nothing).
  void load_state_dict(torch::serialize::InputArchive& state_dict);

  /// LibTorch's names for the two above (torch::optim::Optimizer::save/load).
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  std::shared_ptr<torch::optim::Optimizer> optim_;
  std::shared_ptr<ModelAverager> averager_;
};

/// For torch::save(opt, ...) and torch::load(opt, ...).
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const PostLocalSGDOptimizer& optimizer);
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           PostLocalSGDOptimizer& optimizer);

}  // namespace data_parallel
}  // namespace distoptim
