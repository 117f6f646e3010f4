#include <distoptim/optim/adamax.h>

#include <cmath>

#include "update_common.h"

namespace distoptim {
namespace optim {

namespace {

using kernels::Algorithm;
using kernels::UpdateTask;

uint32_t adamax_flags(const AdamaxOptions& o) {
  uint32_t flags = 0;
  if (o.maximize()) flags |= kernels::kMaximize;
  if (o.weight_decay() != 0) flags |= kernels::kWeightDecay;
  return flags;
}

void set_adamax_params(UpdateTask& task, const AdamaxOptions& o, int64_t step) {
  const double beta1 = std::get<0>(o.betas());
  const double beta2 = std::get<1>(o.betas());
  kernels::AdamaxParams& args = task.params.adamax;
  args.weight_decay = o.weight_decay();
  args.beta1 = beta1;
  args.one_minus_beta1 = 1 - beta1;
  args.beta2 = beta2;
  args.eps = o.eps();
  args.clr = o.lr() / (1 - std::pow(beta1, static_cast<double>(step)));
}

// items[i].operands: param, grad, exp_avg, exp_inf.
void run_adamax(const std::vector<detail::UpdateItem>& items, const AdamaxOptions& o) {
  detail::KernelChoice kernel(Algorithm::kAdamax, adamax_flags(o));
  detail::run_items(items, kernel,
                    [&](UpdateTask& task, int64_t step) { set_adamax_params(task, o, step); });
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
  const AdamaxOptions& o = options(group);
  detail::KernelChoice kernel(Algorithm::kAdamax, adamax_flags(o));
  detail::add_stateful_tasks(
      step_cache(), updates, kernel, {{0}, {1}},
      [&](UpdateTask& task, int64_t step) { set_adamax_params(task, o, step); });
}

}  // namespace optim
}  // namespace distoptim
