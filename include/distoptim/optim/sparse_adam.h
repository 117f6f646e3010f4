#pragma once

#include <tuple>

#include <torch/arg.h>

#include <distoptim/optim/functional_optimizer.h>

namespace distoptim {
namespace optim {

/// Options of SparseAdam, named and defaulted as torch.optim.SparseAdam's (PyTorch 1.13).
struct SparseAdamOptions {
  using Pair = std::tuple<double, double>;
  /// The registry name of the optimizer these options are for (see registry.h).
  static constexpr const char* kOptimizer = "sparse_adam";
  /* implicit */ SparseAdamOptions(double lr = 1e-3) : lr_(lr) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(Pair, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(bool, maximize) = false;

 public:
  /// Throws c10::ValueError naming the option and its value (lr > 0, eps > 0, betas in [0, 1)).
  void validate() const;
  template <class V>
  void visit(V&& v) {
    v("lr", lr_);
    v("betas", betas_);
    v("eps", eps_);
    v("maximize", maximize_);
  }
};

/// torch.optim.SparseAdam, the lazy Adam for sparse gradients (embedding tables): only the rows a
/// gradient names move, and only their moments are updated (duplicates summed first). Dense
/// gradients are refused, as PyTorch refuses them. State: "exp_avg", "exp_avg_sq" (dense, created
/// at a parameter's first gradient) and a step count per parameter. Registry name:
/// "sparse_adam".
class SparseAdam : public TypedFunctionalOptimizer<SparseAdamOptions> {
 public:
  explicit SparseAdam(std::vector<ParamGroup> groups,
                      const SparseAdamOptions& defaults = SparseAdamOptions());
  SparseAdam(std::vector<at::Tensor> params, const SparseAdamOptions& defaults)
      : SparseAdam(std::vector<ParamGroup>{ParamGroup(std::move(params))}, defaults) {}

 protected:
  void update(size_t group, const std::vector<ParamUpdate>& updates) override;
  std::string sparse_gradient_refusal(size_t /*group*/) const override { return ""; }
  bool requires_sparse_gradients() const override { return true; }
  void update_sparse(size_t group, const std::vector<ParamUpdate>& updates) override;
  bool sparse_update_is_row_local(size_t /*group*/) const override { return true; }
};

}  // namespace optim
}  // namespace distoptim
