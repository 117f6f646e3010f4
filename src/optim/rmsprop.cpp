#include <distoptim/optim/rmsprop.h>

#include "update_common.h"

namespace distoptim {
namespace optim {

namespace {

using kernels::Algorithm;
using kernels::UpdateTask;

uint32_t rmsprop_flags(const RMSpropOptions& o) {
  uint32_t flags = 0;
  if (o.maximize()) flags |= kernels::kMaximize;
  if (o.weight_decay() != 0) flags |= kernels::kWeightDecay;
  if (o.centered()) flags |= kernels::kRmspropCentered;
  if (o.momentum() > 0) flags |= kernels::kRmspropMomentum;
  return flags;
}

void set_rmsprop_params(UpdateTask& task, const RMSpropOptions& o) {
  kernels::RmspropParams& args = task.params.rmsprop;
  args.weight_decay = o.weight_decay();
  args.alpha = o.alpha();
  args.one_minus_alpha = 1 - o.alpha();
  args.eps = o.eps();
  args.lr = o.lr();
  args.momentum = o.momentum();
}

// items[i].operands: param, grad, square_avg, momentum_buffer (or null), grad_avg (or null).
void run_rmsprop(const std::vector<detail::UpdateItem>& items, const RMSpropOptions& o) {
  detail::KernelChoice kernel(Algorithm::kRmsprop, rmsprop_flags(o));
  detail::run_items(items, kernel, [&](UpdateTask& task, int64_t) { set_rmsprop_params(task, o); });
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
  const auto items =
      detail::items_from_lists(params, grads,
                               {&square_avgs, options.momentum() > 0 ? &momentum_buffers : nullptr,
                                options.centered() ? &grad_avgs : nullptr});
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
  detail::KernelChoice kernel(Algorithm::kRmsprop, rmsprop_flags(o));
  // PyTorch creates a parameter's buffers at its first gradient; one whose option is switched
  // on later (set_group_options) starts at zero then.
  detail::add_stateful_tasks(step_cache(), updates, kernel,
                             {{0}, {o.momentum() > 0 ? 1 : -1}, {o.centered() ? 2 : -1}},
                             [&](UpdateTask& task, int64_t) { set_rmsprop_params(task, o); });
}

}  // namespace optim
}  // namespace distoptim
