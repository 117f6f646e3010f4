#include <distoptim/optim/adam.h>

#include <cmath>

#include "update_common.h"

namespace distoptim {
namespace optim {

namespace {

using kernels::Algorithm;
using kernels::UpdateTask;

// The Adam family's settings, common to AdamOptions and AdamWOptions.
struct AdamSettings {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad, maximize, decoupled;
};

template <class Options>
AdamSettings settings_of(const Options& o, bool decoupled) {
  return {o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(),
          o.amsgrad(), o.maximize(), decoupled};
}

// items[i].operands: param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad only).
void run_adam(const std::vector<detail::UpdateItem>& items, const AdamSettings& s) {
  uint32_t flags = 0;
  if (s.maximize) flags |= kernels::kMaximize;
  if (s.weight_decay != 0 && !s.decoupled) flags |= kernels::kWeightDecay;
  if (s.amsgrad) flags |= kernels::kVariantA;
  if (s.decoupled) flags |= kernels::kVariantB;
  kernels::UpdateBatch batch;
  for (const auto& item : items) {
    const at::Tensor& p = *item.operands[0];
    UpdateTask& task = batch.add(kernels::select_kernel(Algorithm::kAdam, p.scalar_type(), flags),
                                 item.operands, item.num_operands);
    // Scalars as torch.optim.adam computes them, in double.
    const double step = static_cast<double>(item.step);
    const double bias_correction1 = 1 - std::pow(s.beta1, step);
    const double bias_correction2 = 1 - std::pow(s.beta2, step);
    task.scalars[0] = s.weight_decay;
    task.scalars[1] = s.beta1;
    task.scalars[2] = 1 - s.beta1;
    task.scalars[3] = s.beta2;
    task.scalars[4] = 1 - s.beta2;
    task.scalars[5] = s.lr / bias_correction1;
    task.scalars[6] = std::sqrt(bias_correction2);
    task.scalars[7] = s.eps;
    task.scalars[8] = 1 - s.lr * s.weight_decay;
  }
  batch.run();
}

void run_functional(const char* name, const std::vector<at::Tensor>& params,
                    const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& exp_avgs,
                    const std::vector<at::Tensor>& exp_avg_sqs,
                    const std::vector<at::Tensor>& max_exp_avg_sqs,
                    const std::vector<int64_t>& steps, const AdamSettings& s) {
  if (s.amsgrad) {
    detail::check_lists(name, params, grads,
                        {{"exp_avgs", &exp_avgs},
                         {"exp_avg_sqs", &exp_avg_sqs},
                         {"max_exp_avg_sqs", &max_exp_avg_sqs}});
  } else {
    detail::check_lists(name, params, grads, {{"exp_avgs", &exp_avgs}, {"exp_avg_sqs", &exp_avg_sqs}});
  }
  detail::check_steps(name, params, steps);
  std::vector<detail::UpdateItem> items(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    auto& item = items[i];
    item.operands[0] = &params[i];
    item.operands[1] = &grads[i];
    item.operands[2] = &exp_avgs[i];
    item.operands[3] = &exp_avg_sqs[i];
    item.operands[4] = s.amsgrad ? &max_exp_avg_sqs[i] : nullptr;
    item.num_operands = s.amsgrad ? 5 : 4;
    item.step = steps[i];
  }
  run_adam(items, s);
}

// The stateful step shared by Adam and AdamW: creates state at a parameter's first gradient.
void update_state(const std::vector<FunctionalOptimizer::ParamUpdate>& updates,
                  const AdamSettings& s, std::vector<detail::UpdateItem>& items);

}  // namespace

namespace functional {
void adam(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
          const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
          const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<int64_t>& steps,
          const AdamOptions& options) {
  options.validate();
  run_functional("functional::adam", params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                 settings_of(options, false));
}

void adamw(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
           const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
           const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<int64_t>& steps,
           const AdamWOptions& options) {
  options.validate();
  run_functional("functional::adamw", params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                 steps, settings_of(options, true));
}
}  // namespace functional

Adam::Adam(std::vector<ParamGroup> groups, const AdamOptions& defaults)
    : TypedFunctionalOptimizer("adam", {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, defaults) {
  defaults.validate();
  for (const auto& g : groups) add_param_group(g);
}

AdamW::AdamW(std::vector<ParamGroup> groups, const AdamWOptions& defaults)
    : TypedFunctionalOptimizer("adamw", {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, defaults) {
  defaults.validate();
  for (const auto& g : groups) add_param_group(g);
}

namespace {
void update_state(const std::vector<FunctionalOptimizer::ParamUpdate>& updates,
                  const AdamSettings& s, std::vector<detail::UpdateItem>& items) {
  items.resize(updates.size());
  for (size_t i = 0; i < updates.size(); ++i) {
    const at::Tensor& p = *updates[i].param;
    auto& buffers = updates[i].state->buffers;
    if (!buffers[0].defined()) {
      buffers[0] = detail::new_state_buffer(p);
      buffers[1] = detail::new_state_buffer(p);
    }
    // amsgrad may be switched on later (set_group_options): its buffer starts then.
    if (s.amsgrad && !buffers[2].defined()) buffers[2] = detail::new_state_buffer(p);
    auto& item = items[i];
    item.operands[0] = &p;
    item.operands[1] = updates[i].grad;
    item.operands[2] = &buffers[0];
    item.operands[3] = &buffers[1];
    item.operands[4] = &buffers[2];
    item.num_operands = s.amsgrad ? 5 : 4;
    item.step = ++updates[i].state->step;
  }
}
}  // namespace

void Adam::update(size_t group, const std::vector<ParamUpdate>& updates) {
  const AdamSettings s = settings_of(options(group), false);
  std::vector<detail::UpdateItem> items;
  update_state(updates, s, items);
  run_adam(items, s);
}

void AdamW::update(size_t group, const std::vector<ParamUpdate>& updates) {
  const AdamSettings s = settings_of(options(group), true);
  std::vector<detail::UpdateItem> items;
  update_state(updates, s, items);
  run_adam(items, s);
}

}  // namespace optim
}  // namespace distoptim
