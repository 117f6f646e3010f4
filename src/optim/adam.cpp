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
  return {o.lr(),
          std::get<0>(o.betas()),
          std::get<1>(o.betas()),
          o.eps(),
          o.weight_decay(),
          o.amsgrad(),
          o.maximize(),
          decoupled};
}

// items[i].operands: param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad only).
void run_adam(const std::vector<detail::UpdateItem>& items, const AdamSettings& s) {
  uint32_t flags = 0;
  if (s.maximize) flags |= kernels::kMaximize;
  if (s.weight_decay != 0 && !s.decoupled) flags |= kernels::kWeightDecay;
  if (s.amsgrad) flags |= kernels::kAdamAmsgrad;
  if (s.decoupled) flags |= kernels::kAdamDecoupled;
  kernels::UpdateBatch batch;
  for (const auto& item : items) {
    const at::Tensor& p = *item.operands[0];
    UpdateTask& task = batch.add(kernels::select_kernel(Algorithm::kAdam, p.scalar_type(), flags),
                                 item.operands, item.num_operands);
    // Scalars as torch.optim.adam computes them, in double.
    const double step = static_cast<double>(item.step);
    const double bias_correction1 = 1 - std::pow(s.beta1, step);
    const double bias_correction2 = 1 - std::pow(s.beta2, step);
    kernels::AdamParams& args = task.params.adam;
    args.weight_decay = s.weight_decay;
    args.beta1 = s.beta1;
    args.one_minus_beta1 = 1 - s.beta1;
    args.beta2 = s.beta2;
    args.one_minus_beta2 = 1 - s.beta2;
    args.step_size = s.lr / bias_correction1;
    args.bias_correction2_sqrt = std::sqrt(bias_correction2);
    args.eps = s.eps;
    args.decay = 1 - s.lr * s.weight_decay;
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
    detail::check_lists(name, params, grads,
                        {{"exp_avgs", &exp_avgs}, {"exp_avg_sqs", &exp_avg_sqs}});
  }
  detail::check_steps(name, params, steps);
  const auto items = detail::items_from_lists(
      params, grads, {&exp_avgs, &exp_avg_sqs, s.amsgrad ? &max_exp_avg_sqs : nullptr}, &steps);
  run_adam(items, s);
}

// The stateful step shared by Adam and AdamW. exp_avg and exp_avg_sq start at a parameter's
// first gradient; max_exp_avg_sq when amsgrad is on (it may be switched on later).
void update_adam(const std::vector<FunctionalOptimizer::ParamUpdate>& updates,
                 const AdamSettings& s) {
  std::vector<detail::UpdateItem> items;
  items.reserve(updates.size());
  for (const auto& u : updates) {
    items.push_back(detail::stateful_item(u, {{0}, {1}, {s.amsgrad ? 2 : -1}}));
  }
  run_adam(items, s);
}

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
  run_functional("functional::adamw", params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                 settings_of(options, true));
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

void Adam::update(size_t group, const std::vector<ParamUpdate>& updates) {
  update_adam(updates, settings_of(options(group), false));
}

void AdamW::update(size_t group, const std::vector<ParamUpdate>& updates) {
  update_adam(updates, settings_of(options(group), true));
}

}  // namespace optim
}  // namespace distoptim
