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

uint32_t adam_flags(const AdamSettings& s) {
  uint32_t flags = 0;
  if (s.maximize) flags |= kernels::kMaximize;
  if (s.weight_decay != 0 && !s.decoupled) flags |= kernels::kWeightDecay;
  if (s.amsgrad) flags |= kernels::kAdamAmsgrad;
  if (s.decoupled) flags |= kernels::kAdamDecoupled;
  return flags;
}

// A task's scalars at step `step`, as torch.optim.adam computes them, in double. The parameters
// of a group are usually at the same step: the last one's scalars are reused.
class AdamScalars {
 public:
  explicit AdamScalars(const AdamSettings& s) : s_(s) {}
  const kernels::AdamParams& at_step(int64_t step) {
    if (step == step_) return args_;
    step_ = step;
    const double bias_correction1 = 1 - std::pow(s_.beta1, static_cast<double>(step));
    const double bias_correction2 = 1 - std::pow(s_.beta2, static_cast<double>(step));
    args_.weight_decay = s_.weight_decay;
    args_.beta1 = s_.beta1;
    args_.one_minus_beta1 = 1 - s_.beta1;
    args_.beta2 = s_.beta2;
    args_.one_minus_beta2 = 1 - s_.beta2;
    args_.step_size = s_.lr / bias_correction1;
    args_.bias_correction2_sqrt = std::sqrt(bias_correction2);
    args_.eps = s_.eps;
    args_.decay = 1 - s_.lr * s_.weight_decay;
    return args_;
  }

 private:
  const AdamSettings& s_;
  int64_t step_ = -1;
  kernels::AdamParams args_ = {};
};

// items[i].operands: param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad only).
void run_adam(const std::vector<detail::UpdateItem>& items, const AdamSettings& s) {
  detail::KernelChoice kernel(Algorithm::kAdam, adam_flags(s));
  AdamScalars scalars(s);
  detail::run_items(items, kernel, [&](UpdateTask& task, int64_t step) {
    task.params.adam = scalars.at_step(step);
  });
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
void update_adam(detail::StepCache& cache,
                 const std::vector<FunctionalOptimizer::ParamUpdate>& updates,
                 const AdamSettings& s) {
  detail::KernelChoice kernel(Algorithm::kAdam, adam_flags(s));
  AdamScalars scalars(s);
  detail::add_stateful_tasks(
      cache, updates, kernel, {{0}, {1}, {s.amsgrad ? 2 : -1}},
      [&](UpdateTask& task, int64_t step) { task.params.adam = scalars.at_step(step); });
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
  update_adam(step_cache(), updates, settings_of(options(group), false));
}

void AdamW::update(size_t group, const std::vector<ParamUpdate>& updates) {
  update_adam(step_cache(), updates, settings_of(options(group), true));
}

}  // namespace optim
}  // namespace distoptim
