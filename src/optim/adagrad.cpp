#include <distoptim/optim/adagrad.h>

#include "update_common.h"

namespace distoptim {
namespace optim {

namespace {

using kernels::Algorithm;
using kernels::UpdateTask;

// items[i].operands: param, grad, sum.
void run_adagrad(const std::vector<detail::UpdateItem>& items, const AdagradOptions& o) {
  uint32_t flags = 0;
  if (o.maximize()) flags |= kernels::kMaximize;
  if (o.weight_decay() != 0) flags |= kernels::kWeightDecay;
  kernels::UpdateBatch batch;
  for (const auto& item : items) {
    const at::Tensor& p = *item.operands[0];
    UpdateTask& task = batch.add(kernels::select_kernel(Algorithm::kAdagrad, p.scalar_type(), flags),
                                 item.operands, item.num_operands);
    task.scalars[0] = o.weight_decay();
    task.scalars[1] = o.lr() / (1 + static_cast<double>(item.step - 1) * o.lr_decay());
    task.scalars[2] = o.eps();
  }
  batch.run();
}

}  // namespace

namespace functional {
void adagrad(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
             const std::vector<at::Tensor>& state_sums, const std::vector<int64_t>& steps,
             const AdagradOptions& options) {
  options.validate();
  detail::check_lists("functional::adagrad", params, grads, {{"state_sums", &state_sums}});
  detail::check_steps("functional::adagrad", params, steps);
  std::vector<detail::UpdateItem> items(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    items[i].operands[0] = &params[i];
    items[i].operands[1] = &grads[i];
    items[i].operands[2] = &state_sums[i];
    items[i].num_operands = 3;
    items[i].step = steps[i];
  }
  run_adagrad(items, options);
}
}  // namespace functional

Adagrad::Adagrad(std::vector<ParamGroup> groups, const AdagradOptions& defaults)
    : TypedFunctionalOptimizer("adagrad", {"sum"}, defaults) {
  defaults.validate();
  for (const auto& g : groups) add_param_group(g);
}

void Adagrad::init_state(size_t group, const at::Tensor& param, ParamState& state) {
  state.buffers[0] = detail::new_state_buffer(param).fill_(options(group).initial_accumulator_value());
}

void Adagrad::update(size_t group, const std::vector<ParamUpdate>& updates) {
  std::vector<detail::UpdateItem> items(updates.size());
  for (size_t i = 0; i < updates.size(); ++i) {
    auto& buffers = updates[i].state->buffers;
    // A state dict may lack the sum (e.g. loaded from an empty state): start it as PyTorch would.
    if (!buffers[0].defined()) init_state(group, *updates[i].param, *updates[i].state);
    items[i].operands[0] = updates[i].param;
    items[i].operands[1] = updates[i].grad;
    items[i].operands[2] = &buffers[0];
    items[i].num_operands = 3;
    items[i].step = ++updates[i].state->step;
  }
  run_adagrad(items, options(group));
}

}  // namespace optim
}  // namespace distoptim
