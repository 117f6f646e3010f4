#pragma once

// Internal: the options Adam and AdamW share (adam.h). Not part of the public API; names may
// change.

#include <tuple>

namespace distoptim {
namespace optim {

// A TORCH_ARG whose setter returns the derived options struct (TORCH_ARG's returns the class
// that declares it), so that a chain on AdamWOptions stays an AdamWOptions.
#define DISTOPTIM_ADAM_ARG(T, name)                  \
 public:                                             \
  Derived& name(const T& new_##name) {               \
    name##_ = new_##name;                            \
    return static_cast<Derived&>(*this);             \
  }                                                  \
  const T& name() const noexcept { return name##_; } \
  T& name() noexcept { return name##_; }             \
                                                     \
 private:                                            \
  T name##_

namespace detail {

/// The options Adam and AdamW share, named as torch.optim.Adam's and torch.optim.AdamW's
/// (PyTorch 1.13); only weight_decay's default differs. `Derived` is the options struct.
template <class Derived>
struct AdamOptionsBase {
  using Pair = std::tuple<double, double>;
  DISTOPTIM_ADAM_ARG(double, lr);
  DISTOPTIM_ADAM_ARG(Pair, betas) = std::make_tuple(0.9, 0.999);
  DISTOPTIM_ADAM_ARG(double, eps) = 1e-8;
  DISTOPTIM_ADAM_ARG(double, weight_decay);
  DISTOPTIM_ADAM_ARG(bool, amsgrad) = false;
  DISTOPTIM_ADAM_ARG(bool, maximize) = false;

 public:
  template <class V>
  void visit(V&& v) {
    v("lr", lr_);
    v("betas", betas_);
    v("eps", eps_);
    v("weight_decay", weight_decay_);
    v("amsgrad", amsgrad_);
    v("maximize", maximize_);
  }

 protected:
  AdamOptionsBase(double lr, double weight_decay) : lr_(lr), weight_decay_(weight_decay) {}
};

}  // namespace detail

#undef DISTOPTIM_ADAM_ARG

}  // namespace optim
}  // namespace distoptim
