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
  if (o.centered()) flags |= kernels::kRmspropCentered;
  if (o.momentum() > 0) flags |= kernels::kRmspropMomentum;
  kernels::UpdateBatch batch;
  for (const auto& item : items) {
    const at::Tensor& p = *item.operands[0];
    UpdateTask& task =
        batch.add(kernels::select_kernel(Algorithm::kRmsprop, p.scalar_type(), flags),
                  item.operands, item.num_operands);
    kernels::RmspropParams& args = task.params.rmsprop;
    args.weight_decay = o.weight_decay();
    args.alpha = o.alpha();
    args.one_minus_alpha = 1 - o.alpha();
    args.eps = o.eps();
    args.lr = o.lr();
    args.momentum = o.momentum();
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
  // PyTorch creates a parameter's buffers at its first gradient; one whose option is switched
  // on later (set_group_options) starts at zero then.
  std::vector<detail::UpdateItem> items;
  items.reserve(updates.size());
  for (const auto& u : updates) {
    items.push_back(
        detail::stateful_item(u, {{0}, {o.momentum() > 0 ? 1 : -1}, {o.centered() ? 2 : -1}}));
  }
  run_rmsprop(items, o);
}

}  // namespace optim
}  // namespace distoptim
