#pragma once

#include <torch/arg.h>

#include <distoptim/optim/functional_optimizer.h>

namespace distoptim {
namespace optim {

/// Options of RMSprop, named and defaulted as torch.optim.RMSprop's (PyTorch 1.13).
struct RMSpropOptions {
  /// The registry name of the optimizer these options are for (see registry.h).
  static constexpr const char* kOptimizer = "rmsprop";
  /* implicit */ RMSpropOptions(double lr = 1e-2) : lr_(lr) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(double, alpha) = 0.99;
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(bool, centered) = false;
  TORCH_ARG(bool, maximize) = false;

 public:
  void validate() const;
  template <class V>
  void visit(V&& v) {
    v("lr", lr_);
    v("alpha", alpha_);
    v("eps", eps_);
    v("weight_decay", weight_decay_);
    v("momentum", momentum_);
    v("centered", centered_);
    v("maximize", maximize_);
  }
};

namespace functional {
/// torch.optim.RMSprop's update. `grad_avgs` is read only when centered, `momentum_buffers`
/// only when momentum > 0.
void rmsprop(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
             const std::vector<at::Tensor>& square_avgs, const std::vector<at::Tensor>& grad_avgs,
             const std::vector<at::Tensor>& momentum_buffers, const RMSpropOptions& options);
}  // namespace functional

/// RMSprop. State: "square_avg", "momentum_buffer" (momentum > 0), "grad_avg" (centered),
/// created at a parameter's first gradient. Registry name: "rmsprop".
class RMSprop : public TypedFunctionalOptimizer<RMSpropOptions> {
 public:
  explicit RMSprop(std::vector<ParamGroup> groups,
                   const RMSpropOptions& defaults = RMSpropOptions());
  RMSprop(std::vector<at::Tensor> params, const RMSpropOptions& defaults)
      : RMSprop(std::vector<ParamGroup>{ParamGroup(std::move(params))}, defaults) {}

 protected:
  void update(size_t group, const std::vector<ParamUpdate>& updates) override;
};

}  // namespace optim
}  // namespace distoptim
