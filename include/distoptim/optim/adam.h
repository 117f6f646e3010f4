#pragma once

#include <tuple>

#include <torch/arg.h>

#include <distoptim/optim/functional_optimizer.h>

namespace distoptim {
namespace optim {

/// Options of Adam, named and defaulted as torch.optim.Adam's (PyTorch 1.13).
struct AdamOptions {
  using Pair = std::tuple<double, double>;
  /* implicit */ AdamOptions(double lr = 1e-3) : lr_(lr) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(Pair, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(bool, maximize) = false;


 public:
  void validate() const;
  template <class V>
  void visit(V&& v) {
    v("lr", lr_);
    v("betas", betas_);
    v("eps", eps_);
    v("weight_decay", weight_decay_);
    v("amsgrad", amsgrad_);
    v("maximize", maximize_);
  }
};

/// Options of AdamW: Adam's, with decoupled weight decay defaulting to 1e-2.
struct AdamWOptions {
  using Pair = std::tuple<double, double>;
  /* implicit */ AdamWOptions(double lr = 1e-3) : lr_(lr) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(Pair, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(bool, maximize) = false;


 public:
  void validate() const;
  template <class V>
  void visit(V&& v) {
    v("lr", lr_);
    v("betas", betas_);
    v("eps", eps_);
    v("weight_decay", weight_decay_);
    v("amsgrad", amsgrad_);
    v("maximize", maximize_);
  }
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
