#include <distoptim/data_parallel/post_local_sgd_optimizer.h>

#include <string>
#include <utility>

#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <distoptim/comm/process_group.h>

#include "gradients.h"
#include "parameter_check.h"

namespace distoptim {
namespace data_parallel {

PostLocalSGDOptimizer::PostLocalSGDOptimizer(std::shared_ptr<torch::optim::Optimizer> optim,
                                             std::shared_ptr<ModelAverager> averager)
    : optim_(std::move(optim)), averager_(std::move(averager)) {
  TORCH_CHECK_VALUE(optim_ != nullptr, "PostLocalSGDOptimizer: optim is null", on_this_rank());
  TORCH_CHECK_VALUE(averager_ != nullptr, "PostLocalSGDOptimizer: averager is null",
                    on_this_rank());
}

void PostLocalSGDOptimizer::zero_grad() {
  for (auto& group : optim_->param_groups()) {
    for (const auto& p : group.params()) clear_gradient(p, /*set_to_none=*/false);
  }
}

at::Tensor PostLocalSGDOptimizer::step(torch::optim::Optimizer::LossClosure closure) {
  // Checked before the local step, so bad parameters leave everything as it was (the averager
  // would only find them after the update).
  std::vector<at::Tensor> params;
  for (const auto& group : optim_->param_groups()) {
    params.insert(params.end(), group.params().begin(), group.params().end());
  }
  check_params_to_average(params, "PostLocalSGDOptimizer::step");
  at::Tensor loss = optim_->step(std::move(closure));
  averager_->average_parameters(optim_->param_groups());
  return loss;
}

torch::serialize::OutputArchive PostLocalSGDOptimizer::state_dict() const {
  torch::serialize::OutputArchive archive;
  save(archive);
  return archive;
}

void PostLocalSGDOptimizer::load_state_dict(torch::serialize::InputArchive& state_dict) {
  load(state_dict);
}

void PostLocalSGDOptimizer::save(torch::serialize::OutputArchive& archive) const {
  optim_->save(archive);
  archive.write(kStepKey, c10::IValue(averager_->step()));
}

void PostLocalSGDOptimizer::load(torch::serialize::InputArchive& archive) {
  c10::IValue saved_step;
  const bool has_step = archive.try_read(kStepKey, saved_step);
  if (has_step) {
    TORCH_CHECK_VALUE(saved_step.isInt() && saved_step.toInt() >= 0,
                      "PostLocalSGDOptimizer::load_state_dict: entry '", kStepKey, "' is ",
                      saved_step, on_this_rank(), "; expected a non-negative int");
  }
  optim_->load(archive);
  if (has_step) {
    averager_->set_step(saved_step.toInt());
  } else {
    TORCH_WARN("PostLocalSGDOptimizer::load_state_dict: the state dict has no '", kStepKey,
               "' entry (the averager's step counter); setting the averager's step to 0");
    averager_->set_step(0);
  }
}

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const PostLocalSGDOptimizer& optimizer) {
  optimizer.save(archive);
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           PostLocalSGDOptimizer& optimizer) {
  optimizer.load(archive);
  return archive;
}

}  // namespace data_parallel
}  // namespace distoptim
