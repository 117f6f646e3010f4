#pragma once

#include <torch/arg.h>

#include <distoptim/optim/functional_optimizer.h>

namespace distoptim {
namespace optim {

/// Options of Adadelta, named and defaulted as torch.optim.Adadelta's (PyTorch 1.13).
struct AdadeltaOptions {
  /// The registry name of the optimizer these options are for (see registry.h).
  static constexpr const char* kOptimizer = "adadelta";
  /* implicit */ AdadeltaOptions(double lr = 1.0) : lr_(lr) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(double, rho) = 0.9;
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, maximize) = false;

 public:
  void validate() const;
  template <class V>
  void visit(V&& v) {
    v("lr", lr_);
    v("rho", rho_);
    v("eps", eps_);
    v("weight_decay", weight_decay_);
    v("maximize", maximize_);
  }
};

namespace functional {
/// torch.optim.Adadelta's update.
void adadelta(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
              const std::vector<at::Tensor>& square_avgs, const std::vector<at::Tensor>& acc_deltas,
              const AdadeltaOptions& options);
}  // namespace functional

/// Adadelta. State: "square_avg", "acc_delta", created at a parameter's first gradient.
/// Registry name: "adadelta".
class Adadelta : public TypedFunctionalOptimizer<AdadeltaOptions> {
 public:
  explicit Adadelta(std::vector<ParamGroup> groups,
                    const AdadeltaOptions& defaults = AdadeltaOptions());
  Adadelta(std::vector<at::Tensor> params, const AdadeltaOptions& defaults)
      : Adadelta(std::vector<ParamGroup>{ParamGroup(std::move(params))}, defaults) {}

 protected:
  void update(size_t group, const std::vector<ParamUpdate>& updates) override;
};

}  // namespace optim
}  // namespace distoptim
