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
    task.scalars[0] = std::get<0>(o.etas());
    task.scalars[1] = std::get<1>(o.etas());
    task.scalars[2] = std::get<0>(o.step_sizes());
    task.scalars[3] = std::get<1>(o.step_sizes());
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
  std::vector<detail::UpdateItem> items(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    items[i].operands[0] = &params[i];
    items[i].operands[1] = &grads[i];
    items[i].operands[2] = &prevs[i];
    items[i].operands[3] = &step_sizes[i];
    items[i].num_operands = 4;
  }
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
  std::vector<detail::UpdateItem> items(updates.size());
  for (size_t i = 0; i < updates.size(); ++i) {
    const at::Tensor& p = *updates[i].param;
    auto& buffers = updates[i].state->buffers;
    if (!buffers[0].defined()) {
      buffers[0] = detail::new_state_buffer(p);
      buffers[1] = detail::new_state_buffer(p).fill_(o.lr());
    }
    ++updates[i].state->step;
    items[i].operands[0] = &p;
    items[i].operands[1] = updates[i].grad;
    items[i].operands[2] = &buffers[0];
    items[i].operands[3] = &buffers[1];
    items[i].num_operands = 4;
  }
  run_rprop(items, o);
}

}  // namespace optim
}  // namespace distoptim
