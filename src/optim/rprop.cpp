#include <distoptim/optim/rprop.h>

#include "update_common.h"

namespace distoptim {
namespace optim {

namespace {

using kernels::Algorithm;
using kernels::UpdateTask;

uint32_t rprop_flags(const RpropOptions& o) {
  return o.maximize() ? uint32_t{kernels::kMaximize} : 0u;
}

void set_rprop_params(UpdateTask& task, const RpropOptions& o) {
  kernels::RpropParams& args = task.params.rprop;
  args.etaminus = std::get<0>(o.etas());
  args.etaplus = std::get<1>(o.etas());
  args.step_size_min = std::get<0>(o.step_sizes());
  args.step_size_max = std::get<1>(o.step_sizes());
}

// items[i].operands: param, grad, prev, step_size.
void run_rprop(const std::vector<detail::UpdateItem>& items, const RpropOptions& o) {
  detail::KernelChoice kernel(Algorithm::kRprop, rprop_flags(o));
  detail::run_items(items, kernel, [&](UpdateTask& task, int64_t) { set_rprop_params(task, o); });
}

}  // namespace

namespace functional {
void rprop(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
           const std::vector<at::Tensor>& prevs, const std::vector<at::Tensor>& step_sizes,
           const RpropOptions& options) {
  options.validate();
  detail::check_lists("functional::rprop", params, grads,
                      {{"prevs", &prevs}, {"step_sizes", &step_sizes}});
  const auto items = detail::items_from_lists(params, grads, {&prevs, &step_sizes});
  run_rprop(items, options);
}
}  // namespace functional

Rprop::Rprop(std::vector<ParamGroup> groups, const RpropOptions& defaults)
    : TypedFunctionalOptimizer("rprop", {"prev", "step_size"}, defaults) {
  defaults.validate();
  for (const auto& g : groups) add_param_group(g);
}

void Rprop::update(size_t group, const std::vector<ParamUpdate>& updates) {
  const RpropOptions& o = options(group);
  detail::KernelChoice kernel(Algorithm::kRprop, rprop_flags(o));
  // prev starts at zero, step_size at the group's lr.
  detail::add_stateful_tasks(step_cache(), updates, kernel, {{0}, {1, o.lr()}},
                             [&](UpdateTask& task, int64_t) { set_rprop_params(task, o); });
}

}  // namespace optim
}  // namespace distoptim
