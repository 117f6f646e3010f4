#pragma once

// Quasi-hyperbolic momentum (Ma & Yarats, 2019), the custom optimizer of the "distributed
// optimizer with TorchScript support" recipe, written as a distoptim user would: against the
// public headers only, registered by name, usable wherever a built-in is.
//
// Update, per parameter p with gradient g (the recipe's qhm_update):
//   weight_decay_type "grad":   g = g + weight_decay * p
//   weight_decay_type "direct": p = p * (1 - lr * weight_decay)
//   buf = momentum * buf + (1 - momentum) * g
//   p = p - lr * nu * buf - lr * (1 - nu) * g
// The recipe's FunctionalQHM re-creates the momentum buffer as zeros at every step, which turns
// the momentum off; here the buffer persists across steps as QHM intends. The recipe also adds
// the weight decay into the caller's gradient in place; here the gradient is never written.

#include <string>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/arg.h>

#include <distoptim/optim/functional_optimizer.h>
#include <distoptim/optim/registry.h>

namespace qhm {

struct QHMOptions {
  /* implicit */ QHMOptions(double lr = 1e-3) : lr_(lr) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum) = 0.9;
  TORCH_ARG(double, nu) = 0.7;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(std::string, weight_decay_type) = "grad";

 public:
  void validate() const {
    TORCH_CHECK_VALUE(lr() >= 0, "QHM option lr = ", lr(), ": must be >= 0");
    TORCH_CHECK_VALUE(momentum() >= 0, "QHM option momentum = ", momentum(), ": must be >= 0");
    TORCH_CHECK_VALUE(weight_decay() >= 0, "QHM option weight_decay = ", weight_decay(),
                      ": must be >= 0");
    TORCH_CHECK_VALUE(weight_decay_type() == "grad" || weight_decay_type() == "direct",
                      "QHM option weight_decay_type = \"", weight_decay_type(),
                      "\": must be \"grad\" or \"direct\"");
  }
  template <class V>
  void visit(V&& v) {
    v("lr", lr_);
    v("momentum", momentum_);
    v("nu", nu_);
    v("weight_decay", weight_decay_);
    v("weight_decay_type", weight_decay_type_);
  }
};

/// QHM as a functional optimizer. State: "momentum_buffer", created at a parameter's first
/// gradient.
class QHM : public distoptim::optim::TypedFunctionalOptimizer<QHMOptions> {
 public:
  explicit QHM(std::vector<distoptim::optim::ParamGroup> groups,
               const QHMOptions& defaults = QHMOptions())
      : TypedFunctionalOptimizer("qhm", {"momentum_buffer"}, defaults) {
    defaults.validate();
    for (const auto& g : groups) add_param_group(g);
  }

 protected:
  void update(size_t group, const std::vector<ParamUpdate>& updates) override {
    const QHMOptions& o = options(group);
    at::NoGradGuard no_grad;
    for (const auto& u : updates) {
      at::Tensor p = *u.param;
      at::Tensor d_p = *u.grad;
      at::Tensor& buf = u.state->buffers[0];
      if (!buf.defined()) buf = new_state_buffer(p);
      ++u.state->step;
      if (o.weight_decay() != 0) {
        if (o.weight_decay_type() == "grad") {
          d_p = d_p.add(p, o.weight_decay());
        } else {
          p.mul_(1.0 - o.lr() * o.weight_decay());
        }
      }
      buf.mul_(o.momentum()).add_(d_p, 1.0 - o.momentum());
      p.add_(buf, -o.lr() * o.nu());
      p.add_(d_p, -o.lr() * (1.0 - o.nu()));
    }
  }
};

/// Registers "qhm" in distoptim's optimizer registry (once; later calls do nothing).
inline void register_qhm() {
  if (!distoptim::optim::is_optimizer_registered("qhm")) {
    distoptim::optim::register_optimizer("qhm", distoptim::optim::typed_factory<QHM, QHMOptions>());
  }
}

}  // namespace qhm
