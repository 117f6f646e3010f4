#pragma once

#include <tuple>

#include <torch/arg.h>

#include <distoptim/optim/functional_optimizer.h>

namespace distoptim {
namespace optim {

/// Options of Adamax, named and defaulted as torch.optim.Adamax's (PyTorch 1.13).
struct AdamaxOptions {
  /// The registry name of the optimizer these options are for (see registry.h).
  static constexpr const char* kOptimizer = "adamax";
  using Pair = std::tuple<double, double>;
  /* implicit */ AdamaxOptions(double lr = 2e-3) : lr_(lr) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(Pair, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, maximize) = false;

 public:
  void validate() const;
  template <class V>
  void visit(V&& v) {
    v("lr", lr_);
    v("betas", betas_);
    v("eps", eps_);
    v("weight_decay", weight_decay_);
    v("maximize", maximize_);
  }
};

namespace functional {
/// torch.optim.Adamax's update; `steps[i]` is the count after this step.
void adamax(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
            const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_infs,
            const std::vector<int64_t>& steps, const AdamaxOptions& options);
}  // namespace functional

/// Adamax. State: "exp_avg", "exp_inf", created at a parameter's first gradient.
/// Registry name: "adamax".
class Adamax : public TypedFunctionalOptimizer<AdamaxOptions> {
 public:
  explicit Adamax(std::vector<ParamGroup> groups, const AdamaxOptions& defaults = AdamaxOptions());
  Adamax(std::vector<at::Tensor> params, const AdamaxOptions& defaults)
      : Adamax(std::vector<ParamGroup>{ParamGroup(std::move(params))}, defaults) {}

 protected:
  void update(size_t group, const std::vector<ParamUpdate>& updates) override;
};

}  // namespace optim
}  // namespace distoptim
