#pragma once

#include <tuple>

#include <distoptim/optim/detail/adam_options.h>
#include <distoptim/optim/functional_optimizer.h>

namespace distoptim {
namespace optim {

/// Options of Adam, named and defaulted as torch.optim.Adam's (PyTorch 1.13): lr 1e-3,
/// betas (0.9, 0.999), eps 1e-8, weight_decay 0 (added to the gradient), amsgrad and maximize
/// false.
struct AdamOptions : detail::AdamOptionsBase<AdamOptions> {
  /// The registry name of the optimizer these options are for (see registry.h).
  static constexpr const char* kOptimizer = "adam";
  /* implicit */ AdamOptions(double lr = 1e-3) : AdamOptionsBase(lr, /*weight_decay=*/0) {}
  /// Throws c10::ValueError naming the option and its value.
  void validate() const;
};

/// Options of AdamW: Adam's, with weight decay decoupled from the gradient (applied to the
/// parameter) and defaulting to 1e-2, as torch.optim.AdamW's.
struct AdamWOptions : detail::AdamOptionsBase<AdamWOptions> {
  /// The registry name of the optimizer these options are for (see registry.h).
  static constexpr const char* kOptimizer = "adamw";
  /* implicit */ AdamWOptions(double lr = 1e-3) : AdamOptionsBase(lr, /*weight_decay=*/1e-2) {}
  /// Throws c10::ValueError naming the option and its value.
  void validate() const;
};

namespace functional {
/// torch.optim.Adam's update. `steps[i]` is the step count of parameter i after this step
/// (1 on the first). `max_exp_avg_sqs` is read only with amsgrad. All buffers must exist.
void adam(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
          const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
          const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<int64_t>& steps,
          const AdamOptions& options);
/// torch.optim.AdamW's update (weight decay applied to the parameter, not the gradient).
void adamw(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
           const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
           const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<int64_t>& steps,
           const AdamWOptions& options);
}  // namespace functional

/// Adam. State: "exp_avg", "exp_avg_sq", "max_exp_avg_sq" (amsgrad only), created at a
/// parameter's first gradient. Registry name: "adam".
class Adam : public TypedFunctionalOptimizer<AdamOptions> {
 public:
  explicit Adam(std::vector<ParamGroup> groups, const AdamOptions& defaults = AdamOptions());
  Adam(std::vector<at::Tensor> params, const AdamOptions& defaults)
      : Adam(std::vector<ParamGroup>{ParamGroup(std::move(params))}, defaults) {}

 protected:
  void update(size_t group, const std::vector<ParamUpdate>& updates) override;
};

/// AdamW. Same state as Adam. Registry name: "adamw".
class AdamW : public TypedFunctionalOptimizer<AdamWOptions> {
 public:
  explicit AdamW(std::vector<ParamGroup> groups, const AdamWOptions& defaults = AdamWOptions());
  AdamW(std::vector<at::Tensor> params, const AdamWOptions& defaults)
      : AdamW(std::vector<ParamGroup>{ParamGroup(std::move(params))}, defaults) {}

 protected:
  void update(size_t group, const std::vector<ParamUpdate>& updates) override;
};

}  // namespace optim
}  // namespace distoptim
