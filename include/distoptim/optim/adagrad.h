#pragma once

#include <torch/arg.h>

#include <distoptim/optim/functional_optimizer.h>

namespace distoptim {
namespace optim {

/// Options of Adagrad, named and defaulted as torch.optim.Adagrad's (PyTorch 1.13).
struct AdagradOptions {
  /// The registry name of the optimizer these options are for (see registry.h).
  static constexpr const char* kOptimizer = "adagrad";
  /* implicit */ AdagradOptions(double lr = 1e-2) : lr_(lr) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(double, lr_decay) = 0;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(double, initial_accumulator_value) = 0;
  TORCH_ARG(double, eps) = 1e-10;
  TORCH_ARG(bool, maximize) = false;

 public:
  void validate() const;
  template <class V>
  void visit(V&& v) {
    v("lr", lr_);
    v("lr_decay", lr_decay_);
    v("weight_decay", weight_decay_);
    v("initial_accumulator_value", initial_accumulator_value_);
    v("eps", eps_);
    v("maximize", maximize_);
  }
};

namespace functional {
/// torch.optim.Adagrad's update; `steps[i]` is the count after this step.
void adagrad(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
             const std::vector<at::Tensor>& state_sums, const std::vector<int64_t>& steps,
             const AdagradOptions& options);
}  // namespace functional

/// Adagrad. State: "sum", created with the parameter (filled with initial_accumulator_value),
/// as PyTorch does. Registry name: "adagrad". Sparse gradients as PyTorch 1.13 takes them:
/// coalesced (duplicates summed), then only the named rows of the sum and the parameter move;
/// refused with weight decay, as PyTorch refuses them.
class Adagrad : public TypedFunctionalOptimizer<AdagradOptions> {
 public:
  explicit Adagrad(std::vector<ParamGroup> groups,
                   const AdagradOptions& defaults = AdagradOptions());
  Adagrad(std::vector<at::Tensor> params, const AdagradOptions& defaults)
      : Adagrad(std::vector<ParamGroup>{ParamGroup(std::move(params))}, defaults) {}

 protected:
  void init_state(size_t group, const at::Tensor& param, ParamState& state) override;
  void update(size_t group, const std::vector<ParamUpdate>& updates) override;
  std::string sparse_gradient_refusal(size_t group) const override;
  void update_sparse(size_t group, const std::vector<ParamUpdate>& updates) override;
  bool sparse_update_is_row_local(size_t /*group*/) const override { return true; }
};

}  // namespace optim
}  // namespace distoptim
