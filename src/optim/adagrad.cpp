#include <distoptim/optim/adagrad.h>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/util/StringUtil.h>

#include "sparse_rows.h"
#include "update_common.h"

namespace distoptim {
namespace optim {

namespace {

using kernels::Algorithm;
using kernels::UpdateTask;

uint32_t adagrad_flags(const AdagradOptions& o) {
  uint32_t flags = 0;
  if (o.maximize()) flags |= kernels::kMaximize;
  if (o.weight_decay() != 0) flags |= kernels::kWeightDecay;
  return flags;
}

void set_adagrad_params(UpdateTask& task, const AdagradOptions& o, int64_t step) {
  kernels::AdagradParams& args = task.params.adagrad;
  args.weight_decay = o.weight_decay();
  args.clr = o.lr() / (1 + static_cast<double>(step - 1) * o.lr_decay());
  args.eps = o.eps();
}

// items[i].operands: param, grad, sum.
void run_adagrad(const std::vector<detail::UpdateItem>& items, const AdagradOptions& o) {
  detail::KernelChoice kernel(Algorithm::kAdagrad, adagrad_flags(o));
  detail::run_items(items, kernel,
                    [&](UpdateTask& task, int64_t step) { set_adagrad_params(task, o, step); });
}

}  // namespace

namespace functional {
void adagrad(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
             const std::vector<at::Tensor>& state_sums, const std::vector<int64_t>& steps,
             const AdagradOptions& options) {
  options.validate();
  detail::check_lists("functional::adagrad", params, grads, {{"state_sums", &state_sums}});
  detail::check_steps("functional::adagrad", params, steps);
  const auto items = detail::items_from_lists(params, grads, {&state_sums}, &steps);
  run_adagrad(items, options);
}
}  // namespace functional

Adagrad::Adagrad(std::vector<ParamGroup> groups, const AdagradOptions& defaults)
    : TypedFunctionalOptimizer("adagrad", {"sum"}, defaults) {
  defaults.validate();
  for (const auto& g : groups) add_param_group(g);
}

void Adagrad::init_state(size_t group, const at::Tensor& param, ParamState& state) {
  state.buffers[0] = detail::new_state_buffer(param);
  state.buffers[0].fill_(options(group).initial_accumulator_value());
}

void Adagrad::update(size_t group, const std::vector<ParamUpdate>& updates) {
  const AdagradOptions& o = options(group);
  detail::KernelChoice kernel(Algorithm::kAdagrad, adagrad_flags(o));
  // The sum exists from construction; a state dict without it starts it as PyTorch would.
  detail::add_stateful_tasks(
      step_cache(), updates, kernel, {{0, o.initial_accumulator_value()}},
      [&](UpdateTask& task, int64_t step) { set_adagrad_params(task, o, step); });
}

std::string Adagrad::sparse_gradient_refusal(size_t group) const {
  const AdagradOptions& o = options(group);
  if (o.weight_decay() == 0) return "";
  return c10::str("adagrad does not support sparse gradients with weight_decay=", o.weight_decay(),
                  " (weight_decay option is not compatible with sparse gradients)");
}

void Adagrad::update_sparse(size_t group, const std::vector<ParamUpdate>& updates) {
  const AdagradOptions& o = options(group);
  for (const auto& u : updates) {
    at::Tensor param = *u.param;
    at::Tensor& sum = u.state->buffers[0];
    if (!sum.defined()) {
      sum = detail::new_state_buffer(param);
      sum.fill_(o.initial_accumulator_value());
    }
    const int64_t step = ++u.state->step;
    const double clr = o.lr() / (1 + static_cast<double>(step - 1) * o.lr_decay());
    // The update is not linear in the gradient: duplicate rows are summed first.
    const at::Tensor grad = (o.maximize() ? u.grad->neg() : *u.grad).coalesce();
    if (grad._nnz() == 0) continue;
    if (param.is_contiguous() && sum.is_contiguous()) {
      // One pass over each named row (the last multiply and add round apart, where LibTorch's
      // add_ may fuse them: the two agree to rounding).
      const detail::SparseGradientRows rows = detail::gradient_rows(grad);
      AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "adagrad", [&] {
        detail::for_each_row_range(grad._nnz(), rows.row_numel, [&](int64_t begin, int64_t end) {
          detail::adagrad_rows<scalar_t>(
              param.data_ptr<scalar_t>(), sum.data_ptr<scalar_t>(),
              rows.values.data_ptr<scalar_t>(), rows.rows.data_ptr<int64_t>(), begin, end,
              rows.row_numel, static_cast<scalar_t>(o.eps()), static_cast<scalar_t>(-clr));
        });
      });
      continue;
    }
    const at::Tensor indices = grad._indices();
    const at::Tensor values = grad._values();
    sum.add_(at::_sparse_coo_tensor_unsafe(indices, values.pow(2), grad.sizes()));
    const at::Tensor std_values = sum.sparse_mask(grad)._values().sqrt_().add_(o.eps());
    param.add_(at::_sparse_coo_tensor_unsafe(indices, values / std_values, grad.sizes()), -clr);
  }
}

}  // namespace optim
}  // namespace distoptim
