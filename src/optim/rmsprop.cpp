#include <distoptim/optim/rmsprop.h>

#include "update_common.h"

namespace distoptim {
namespace optim {

namespace {

using kernels::Algorithm;
using kernels::UpdateTask;

// items[i].operands: param, grad, square_avg, momentum_buffer (or null), grad_avg (or null).
void run_rmsprop(const std::vector<detail::UpdateItem>& items, const RMSpropOptions& o) {
  uint32_t flags = 0;
  if (o.maximize()) flags |= kernels::kMaximize;
  if (o.weight_decay() != 0) flags |= kernels::kWeightDecay;
  if (o.centered()) flags |= kernels::kVariantA;
  if (o.momentum() > 0) flags |= kernels::kVariantB;
  kernels::UpdateBatch batch;
  for (const auto& item : items) {
    const at::Tensor& p = *item.operands[0];
    UpdateTask& task = batch.add(kernels::select_kernel(Algorithm::kRmsprop, p.scalar_type(), flags),
                                 item.operands, item.num_operands);
    task.scalars[0] = o.weight_decay();
    task.scalars[1] = o.alpha();
    task.scalars[2] = 1 - o.alpha();
    task.scalars[3] = o.eps();
    task.scalars[4] = o.lr();
    task.scalars[5] = o.momentum();
  }
  batch.run();
}

}  // namespace

namespace functional {
void rmsprop(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
             const std::vector<at::Tensor>& square_avgs, const std::vector<at::Tensor>& grad_avgs,
             const std::vector<at::Tensor>& momentum_buffers, const RMSpropOptions& options) {
  options.validate();
  const char* name = "functional::rmsprop";
  detail::check_lists(name, params, grads, {{"square_avgs", &square_avgs}});
  if (options.centered()) detail::check_lists(name, params, grads, {{"grad_avgs", &grad_avgs}});
  if (options.momentum() > 0) {
    detail::check_lists(name, params, grads, {{"momentum_buffers", &momentum_buffers}});
  }
  std::vector<detail::UpdateItem> items(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    items[i].operands[0] = &params[i];
    items[i].operands[1] = &grads[i];
    items[i].operands[2] = &square_avgs[i];
    items[i].operands[3] = options.momentum() > 0 ? &momentum_buffers[i] : nullptr;
    items[i].operands[4] = options.centered() ? &grad_avgs[i] : nullptr;
    items[i].num_operands = 5;
  }
  run_rmsprop(items, options);
}
}  // namespace functional

RMSprop::RMSprop(std::vector<ParamGroup> groups, const RMSpropOptions& defaults)
    : TypedFunctionalOptimizer("rmsprop", {"square_avg", "momentum_buffer", "grad_avg"}, defaults) {
  defaults.validate();
  for (const auto& g : groups) add_param_group(g);
}

void RMSprop::update(size_t group, const std::vector<ParamUpdate>& updates) {
  const RMSpropOptions& o = options(group);
  const bool momentum = o.momentum() > 0;
  std::vector<detail::UpdateItem> items(updates.size());
  for (size_t i = 0; i < updates.size(); ++i) {
    const at::Tensor& p = *updates[i].param;
    auto& buffers = updates[i].state->buffers;
    // PyTorch creates all of a parameter's buffers at its first gradient; a buffer whose option
    // is switched on later (set_group_options) starts at zero then.
    if (!buffers[0].defined()) buffers[0] = detail::new_state_buffer(p);
    if (momentum && !buffers[1].defined()) buffers[1] = detail::new_state_buffer(p);
    if (o.centered() && !buffers[2].defined()) buffers[2] = detail::new_state_buffer(p);
    ++updates[i].state->step;
    items[i].operands[0] = &p;
    items[i].operands[1] = updates[i].grad;
    items[i].operands[2] = &buffers[0];
    items[i].operands[3] = momentum ? &buffers[1] : nullptr;
    items[i].operands[4] = o.centered() ? &buffers[2] : nullptr;
    items[i].num_operands = 5;
  }
  run_rmsprop(items, o);
}

}  // namespace optim
}  // namespace distoptim
