#include <distoptim/optim/adamax.h>

#include <cmath>

#include "update_common.h"

namespace distoptim {
namespace optim {

namespace {

using kernels::Algorithm;
using kernels::UpdateTask;

// items[i].operands: param, grad, exp_avg, exp_inf.
void run_adamax(const std::vector<detail::UpdateItem>& items, const AdamaxOptions& o) {
  uint32_t flags = 0;
  if (o.maximize()) flags |= kernels::kMaximize;
  if (o.weight_decay() != 0) flags |= kernels::kWeightDecay;
  const double beta1 = std::get<0>(o.betas());
  const double beta2 = std::get<1>(o.betas());
  kernels::UpdateBatch batch;
  for (const auto& item : items) {
    const at::Tensor& p = *item.operands[0];
    UpdateTask& task = batch.add(kernels::select_kernel(Algorithm::kAdamax, p.scalar_type(), flags),
                                 item.operands, item.num_operands);
    kernels::AdamaxParams& args = task.params.adamax;
    args.weight_decay = o.weight_decay();
    args.beta1 = beta1;
    args.one_minus_beta1 = 1 - beta1;
    args.beta2 = beta2;
    args.eps = o.eps();
    args.clr = o.lr() / (1 - std::pow(beta1, static_cast<double>(item.step)));
  }
  batch.run();
}

}  // namespace

namespace functional {
void adamax(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
            const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_infs,
            const std::vector<int64_t>& steps, const AdamaxOptions& options) {
  options.validate();
  detail::check_lists("functional::adamax", params, grads,
                      {{"exp_avgs", &exp_avgs}, {"exp_infs", &exp_infs}});
  detail::check_steps("functional::adamax", params, steps);
  const auto items = detail::items_from_lists(params, grads, {&exp_avgs, &exp_infs}, &steps);
  run_adamax(items, options);
}
}  // namespace functional

Adamax::Adamax(std::vector<ParamGroup> groups, const AdamaxOptions& defaults)
    : TypedFunctionalOptimizer("adamax", {"exp_avg", "exp_inf"}, defaults) {
  defaults.validate();
  for (const auto& g : groups) add_param_group(g);
}

void Adamax::update(size_t group, const std::vector<ParamUpdate>& updates) {
  std::vector<detail::UpdateItem> items;
  items.reserve(updates.size());
  for (const auto& u : updates) items.push_back(detail::stateful_item(u, {{0}, {1}}));
  run_adamax(items, options(group));
}

}  // namespace optim
}  // namespace distoptim
