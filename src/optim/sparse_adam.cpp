#include <distoptim/optim/sparse_adam.h>

#include <cmath>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>

#include "sparse_rows.h"
#include "update_common.h"

namespace distoptim {
namespace optim {

SparseAdam::SparseAdam(std::vector<ParamGroup> groups, const SparseAdamOptions& defaults)
    : TypedFunctionalOptimizer("sparse_adam", {"exp_avg", "exp_avg_sq"}, defaults) {
  defaults.validate();
  for (const auto& g : groups) add_param_group(g);
}

void SparseAdam::update(size_t /*group*/, const std::vector<ParamUpdate>& /*updates*/) {
  TORCH_INTERNAL_ASSERT(false, "sparse_adam: a dense gradient passed the step's checks");
}

void SparseAdam::update_sparse(size_t group, const std::vector<ParamUpdate>& updates) {
  const SparseAdamOptions& o = options(group);
  const double beta1 = std::get<0>(o.betas());
  const double beta2 = std::get<1>(o.betas());
  for (const auto& u : updates) {
    at::Tensor param = *u.param;
    at::Tensor& exp_avg = u.state->buffers[0];
    at::Tensor& exp_avg_sq = u.state->buffers[1];
    if (!exp_avg.defined()) exp_avg = detail::new_state_buffer(param);
    if (!exp_avg_sq.defined()) exp_avg_sq = detail::new_state_buffer(param);
    const int64_t step = ++u.state->step;
    // The update is not linear in the gradient: duplicate rows are summed first.
    const at::Tensor grad = (o.maximize() ? u.grad->neg() : *u.grad).coalesce();
    if (grad._nnz() == 0) continue;
    const double neg_step_size = -(o.lr() * std::sqrt(1 - std::pow(beta2, double(step))) /
                                   (1 - std::pow(beta1, double(step))));
    if (param.is_contiguous() && exp_avg.is_contiguous() && exp_avg_sq.is_contiguous()) {
      // One pass over each named row, with the operations below in the same order.
      const detail::SparseGradientRows rows = detail::gradient_rows(grad);
      AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "sparse_adam", [&] {
        detail::for_each_row_range(grad._nnz(), rows.row_numel, [&](int64_t begin, int64_t end) {
          detail::sparse_adam_rows<scalar_t>(
              param.data_ptr<scalar_t>(), exp_avg.data_ptr<scalar_t>(),
              exp_avg_sq.data_ptr<scalar_t>(), rows.values.data_ptr<scalar_t>(),
              rows.rows.data_ptr<int64_t>(), begin, end, rows.row_numel,
              static_cast<scalar_t>(1 - beta1), static_cast<scalar_t>(1 - beta2),
              static_cast<scalar_t>(o.eps()), static_cast<scalar_t>(neg_step_size));
        });
      });
      continue;
    }
    const at::Tensor indices = grad._indices();
    const at::Tensor values = grad._values();
    auto rows = [&](const at::Tensor& row_values) {
      return at::_sparse_coo_tensor_unsafe(indices, row_values, grad.sizes());
    };
    // The moments of the named rows only, in torch.optim.SparseAdam's order of operations:
    // old += (1 - b) * (new - old).
    const at::Tensor old_exp_avg = exp_avg.sparse_mask(grad)._values();
    at::Tensor exp_avg_update = values.sub(old_exp_avg).mul_(1 - beta1);
    exp_avg.add_(rows(exp_avg_update));
    const at::Tensor old_exp_avg_sq = exp_avg_sq.sparse_mask(grad)._values();
    at::Tensor exp_avg_sq_update = values.pow(2).sub_(old_exp_avg_sq).mul_(1 - beta2);
    exp_avg_sq.add_(rows(exp_avg_sq_update));

    const at::Tensor numer = exp_avg_update.add_(old_exp_avg);
    const at::Tensor denom = exp_avg_sq_update.add_(old_exp_avg_sq).sqrt_().add_(o.eps());
    param.add_(rows(numer.div_(denom).mul(neg_step_size)));
  }
}

}  // namespace optim
}  // namespace distoptim
