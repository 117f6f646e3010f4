#include <distoptim/optim/rprop.h>

#include "update_common.h"

namespace distoptim {
namespace optim {

namespace {

using kernels::Algorithm;
using kernels::UpdateTask;

// items[i].operands: param, grad, prev, step_size.
void run_rprop(const std::vector<detail::UpdateItem>& items, const RpropOptions& o) {
  const uint32_t flags = o.maximize() ? uint32_t{kernels::kMaximize} : 0u;
  kernels::UpdateBatch batch;
  for (const auto& item : items) {
    const at::Tensor& p = *item.operands[0];
    UpdateTask& task = batch.add(kernels::select_kernel(Algorithm::kRprop, p.scalar_type(), flags),
                                 item.operands, item.num_operands);
    kernels::RpropParams& args = task.params.rprop;
    args.etaminus = std::get<0>(o.etas());
    args.etaplus = std::get<1>(o.etas());
    args.step_size_min = std::get<0>(o.step_sizes());
    args.step_size_max = std::get<1>(o.step_sizes());
  }
  batch.run();
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
  std::vector<detail::UpdateItem> items;
  items.reserve(updates.size());
  // prev starts at zero, step_size at the group's lr.
  for (const auto& u : updates) items.push_back(detail::stateful_item(u, {{0}, {1, o.lr()}}));
  run_rprop(items, o);
}

}  // namespace optim
}  // namespace distoptim
