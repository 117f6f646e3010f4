#pragma once

#include <torch/arg.h>

#include <distoptim/optim/functional_optimizer.h>

namespace distoptim {
namespace optim {

/// Options of SGD, named and defaulted as torch.optim.SGD's (PyTorch 1.13).
struct SGDOptions {
  /// The registry name of the optimizer these options are for (see registry.h).
  static constexpr const char* kOptimizer = "sgd";
  /* implicit */ SGDOptions(double lr = 1e-3) : lr_(lr) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(double, dampening) = 0;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, nesterov) = false;
  TORCH_ARG(bool, maximize) = false;

 public:
  /// Throws c10::ValueError naming the option and its value.
  void validate() const;
  template <class V>
  void visit(V&& v) {
    v("lr", lr_);
    v("momentum", momentum_);
    v("dampening", dampening_);
    v("weight_decay", weight_decay_);
    v("nesterov", nesterov_);
    v("maximize", maximize_);
  }
};

namespace functional {
/// torch.optim.SGD's update over lists of equal length. `momentum_buffers[i]` undefined means
/// "first step": it is then created as a copy of the effective gradient (as PyTorch does).
/// Updates in place; one fused pass over memory per tensor.
void sgd(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
         std::vector<at::Tensor>& momentum_buffers, const SGDOptions& options);
}  // namespace functional

/// Stochastic gradient descent with optional momentum, Nesterov momentum, weight decay and
/// maximization. State: "momentum_buffer" (only when momentum != 0). Registry name: "sgd".
///
/// Sparse gradients as PyTorch 1.13 takes them: refused with weight decay (PyTorch fails there);
/// without momentum only the named rows move (as `param.add_(grad, -lr)`, duplicates added one
/// by one). With momentum every row with momentum moves, as in PyTorch, but the buffer stays
/// dense here: PyTorch keeps a sparse buffer whose entries grow by the gradient's every step;
/// the values are the same to rounding.
class SGD : public TypedFunctionalOptimizer<SGDOptions> {
 public:
  explicit SGD(std::vector<ParamGroup> groups, const SGDOptions& defaults = SGDOptions());
  SGD(std::vector<at::Tensor> params, const SGDOptions& defaults)
      : SGD(std::vector<ParamGroup>{ParamGroup(std::move(params))}, defaults) {}

 protected:
  void update(size_t group, const std::vector<ParamUpdate>& updates) override;
  std::string sparse_gradient_refusal(size_t group) const override;
  void update_sparse(size_t group, const std::vector<ParamUpdate>& updates) override;
  bool sparse_update_is_row_local(size_t group) const override {
    return options(group).momentum() == 0;
  }
};

}  // namespace optim
}  // namespace distoptim
