#pragma once

#include <tuple>

#include <torch/arg.h>

#include <distoptim/optim/functional_optimizer.h>

namespace distoptim {
namespace optim {

/// Options of Rprop, named and defaulted as torch.optim.Rprop's (PyTorch 1.13).
struct RpropOptions {
  /// The registry name of the optimizer these options are for (see registry.h).
  static constexpr const char* kOptimizer = "rprop";
  using Pair = std::tuple<double, double>;
  /* implicit */ RpropOptions(double lr = 1e-2) : lr_(lr) {}
  TORCH_ARG(double, lr);
  /// (etaminus, etaplus)
  TORCH_ARG(Pair, etas) = std::make_tuple(0.5, 1.2);
  /// (minimal, maximal) step size
  TORCH_ARG(Pair, step_sizes) = std::make_tuple(1e-6, 50.0);
  TORCH_ARG(bool, maximize) = false;

 public:
  void validate() const;
  template <class V>
  void visit(V&& v) {
    v("lr", lr_);
    v("etas", etas_);
    v("step_sizes", step_sizes_);
    v("maximize", maximize_);
  }
};

namespace functional {
/// torch.optim.Rprop's update.
void rprop(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
           const std::vector<at::Tensor>& prevs, const std::vector<at::Tensor>& step_sizes,
           const RpropOptions& options);
}  // namespace functional

/// Rprop. State: "prev", "step_size" (starts at lr), created at a parameter's first gradient.
/// Registry name: "rprop".
class Rprop : public TypedFunctionalOptimizer<RpropOptions> {
 public:
  explicit Rprop(std::vector<ParamGroup> groups, const RpropOptions& defaults = RpropOptions());
  Rprop(std::vector<at::Tensor> params, const RpropOptions& defaults)
      : Rprop(std::vector<ParamGroup>{ParamGroup(std::move(params))}, defaults) {}

 protected:
  void update(size_t group, const std::vector<ParamUpdate>& updates) override;
};

}  // namespace optim
}  // namespace distoptim
