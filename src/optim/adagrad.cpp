#include <distoptim/optim/adagrad.h>

#include "update_common.h"

namespace distoptim {
namespace optim {

namespace {

using kernels::Algorithm;
using kernels::UpdateTask;

uint32_t adagrad_flags(const AdagradOptions& o) {
  uint32_t flags = 0;
  if (o.maximize()) flags |= kernels::kMaximize;
  if (o.weight_decay() != 0) flags |= kernels::kWeightDecay;
  return flags;
}

void set_adagrad_params(UpdateTask& task, const AdagradOptions& o, int64_t step) {
  kernels::AdagradParams& args = task.params.adagrad;
  args.weight_decay = o.weight_decay();
  args.clr = o.lr() / (1 + static_cast<double>(step - 1) * o.lr_decay());
  args.eps = o.eps();
}

// items[i].operands: param, grad, sum.
void run_adagrad(const std::vector<detail::UpdateItem>& items, const AdagradOptions& o) {
  detail::KernelChoice kernel(Algorithm::kAdagrad, adagrad_flags(o));
  detail::run_items(items, kernel,
                    [&](UpdateTask& task, int64_t step) { set_adagrad_params(task, o, step); });
}

}  // namespace

namespace functional {
void adagrad(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
             const std::vector<at::Tensor>& state_sums, const std::vector<int64_t>& steps,
             const AdagradOptions& options) {
  options.validate();
  detail::check_lists("functional::adagrad", params, grads, {{"state_sums", &state_sums}});
  detail::check_steps("functional::adagrad", params, steps);
  const auto items = detail::items_from_lists(params, grads, {&state_sums}, &steps);
  run_adagrad(items, options);
}
}  // namespace functional

Adagrad::Adagrad(std::vector<ParamGroup> groups, const AdagradOptions& defaults)
    : TypedFunctionalOptimizer("adagrad", {"sum"}, defaults) {
  defaults.validate();
  for (const auto& g : groups) add_param_group(g);
}

void Adagrad::init_state(size_t group, const at::Tensor& param, ParamState& state) {
  state.buffers[0] = detail::new_state_buffer(param);
  state.buffers[0].fill_(options(group).initial_accumulator_value());
}

void Adagrad::update(size_t group, const std::vector<ParamUpdate>& updates) {
  const AdagradOptions& o = options(group);
  detail::KernelChoice kernel(Algorithm::kAdagrad, adagrad_flags(o));
  // The sum exists from construction; a state dict without it starts it as PyTorch would.
  detail::add_stateful_tasks(
      step_cache(), updates, kernel, {{0, o.initial_accumulator_value()}},
      [&](UpdateTask& task, int64_t step) { set_adagrad_params(task, o, step); });
}

}  // namespace optim
}  // namespace distoptim
