#include <distoptim/optim/adadelta.h>

#include "update_common.h"

namespace distoptim {
namespace optim {

namespace {

using kernels::Algorithm;
using kernels::UpdateTask;

uint32_t adadelta_flags(const AdadeltaOptions& o) {
  uint32_t flags = 0;
  if (o.maximize()) flags |= kernels::kMaximize;
  if (o.weight_decay() != 0) flags |= kernels::kWeightDecay;
  return flags;
}

void set_adadelta_params(UpdateTask& task, const AdadeltaOptions& o) {
  kernels::AdadeltaParams& args = task.params.adadelta;
  args.weight_decay = o.weight_decay();
  args.rho = o.rho();
  args.one_minus_rho = 1 - o.rho();
  args.eps = o.eps();
  args.lr = o.lr();
}

// items[i].operands: param, grad, square_avg, acc_delta.
void run_adadelta(const std::vector<detail::UpdateItem>& items, const AdadeltaOptions& o) {
  detail::KernelChoice kernel(Algorithm::kAdadelta, adadelta_flags(o));
  detail::run_items(items, kernel,
                    [&](UpdateTask& task, int64_t) { set_adadelta_params(task, o); });
}

}  // namespace

namespace functional {
void adadelta(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
              const std::vector<at::Tensor>& square_avgs, const std::vector<at::Tensor>& acc_deltas,
              const AdadeltaOptions& options) {
  options.validate();
  detail::check_lists("functional::adadelta", params, grads,
                      {{"square_avgs", &square_avgs}, {"acc_deltas", &acc_deltas}});
  const auto items = detail::items_from_lists(params, grads, {&square_avgs, &acc_deltas});
  run_adadelta(items, options);
}
}  // namespace functional

Adadelta::Adadelta(std::vector<ParamGroup> groups, const AdadeltaOptions& defaults)
    : TypedFunctionalOptimizer("adadelta", {"square_avg", "acc_delta"}, defaults) {
  defaults.validate();
  for (const auto& g : groups) add_param_group(g);
}

void Adadelta::update(size_t group, const std::vector<ParamUpdate>& updates) {
  const AdadeltaOptions& o = options(group);
  detail::KernelChoice kernel(Algorithm::kAdadelta, adadelta_flags(o));
  detail::add_stateful_tasks(step_cache(), updates, kernel, {{0}, {1}},
                             [&](UpdateTask& task, int64_t) { set_adadelta_params(task, o); });
}

}  // namespace optim
}  // namespace distoptim
