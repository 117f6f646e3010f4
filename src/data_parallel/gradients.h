#pragma once

#include <ATen/core/Tensor.h>

namespace distoptim {
namespace data_parallel {

// Drops `param`'s gradient (set_to_none) or zeroes it in place. A gradient that is a view of a
// DistributedDataParallel's bucket (gradient_as_bucket_view) stays that view: LibTorch's
// Optimizer::zero_grad detaches in place, which autograd refuses for a view, so as PyTorch's
// Python Optimizer.zero_grad only a gradient with a graph is detached.
inline void clear_gradient(const at::Tensor& param, bool set_to_none) {
  at::Tensor& grad = param.mutable_grad();
  if (!grad.defined()) return;
  if (set_to_none) {
    grad = at::Tensor();
    return;
  }
  if (grad.grad_fn() != nullptr) {
    grad.detach_();
  } else {
    grad.requires_grad_(false);
  }
  grad.zero_();
}

}  // namespace data_parallel
}  // namespace distoptim
