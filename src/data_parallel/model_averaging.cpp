#include <distoptim/data_parallel/model_averaging.h>

#include <exception>
#include <utility>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <distoptim/comm/errors.h>

#include "parameter_check.h"

namespace distoptim {
namespace data_parallel {

namespace {

std::string ranks_text(const std::vector<int>& ranks) { return "[" + c10::Join(", ", ranks) + "]"; }

void append_with_grad(const std::vector<at::Tensor>& params, std::vector<at::Tensor>& out) {
  for (const auto& p : params) {
    if (p.defined() && p.grad().defined()) out.push_back(p);
  }
}

std::vector<at::Tensor> all_params(
    const std::vector<torch::optim::OptimizerParamGroup>& param_groups) {
  std::vector<at::Tensor> out;
  for (const auto& group : param_groups) {
    out.insert(out.end(), group.params().begin(), group.params().end());
  }
  return out;
}

std::vector<at::Tensor> all_params(const std::vector<optim::ParamGroup>& param_groups) {
  std::vector<at::Tensor> out;
  for (const auto& group : param_groups) {
    out.insert(out.end(), group.params.begin(), group.params.end());
  }
  return out;
}

}  // namespace

std::vector<at::Tensor> get_params_to_average(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  append_with_grad(params, out);
  return out;
}

std::vector<at::Tensor> get_params_to_average(const std::vector<optim::ParamGroup>& param_groups) {
  std::vector<at::Tensor> out;
  for (const auto& group : param_groups) append_with_grad(group.params, out);
  return out;
}

std::vector<at::Tensor> get_params_to_average(
    const std::vector<torch::optim::OptimizerParamGroup>& param_groups) {
  std::vector<at::Tensor> out;
  for (const auto& group : param_groups) append_with_grad(group.params(), out);
  return out;
}

void check_params_to_average(const std::vector<at::Tensor>& params, const std::string& caller) {
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK_VALUE(p.defined(), caller, ": parameter ", i, " is an undefined tensor",
                      on_this_rank());
    TORCH_CHECK_VALUE(p.device().is_cpu(), caller, ": parameter ", i, " is on ", p.device(),
                      on_this_rank(), "; model averaging supports CPU tensors only");
    TORCH_CHECK_VALUE(p.layout() == at::kStrided, caller, ": parameter ", i, " has layout ",
                      p.layout(), on_this_rank(), "; model averaging supports dense tensors only");
    TORCH_CHECK_VALUE(at::isFloatingType(p.scalar_type()), caller, ": parameter ", i, " has dtype ",
                      p.scalar_type(), on_this_rank(),
                      "; model averaging supports floating-point tensors only");
  }
}

void average_parameters(const std::vector<at::Tensor>& params, const comm::Group& group) {
  check_params_to_average(params, "average_parameters");
  // The mean over a group of one is the tensor itself.
  if (!group.is_member() || group.size() == 1 || params.empty()) return;
  at::NoGradGuard no_grad;

  // One flat buffer per dtype, in dtype order (the same on every rank). PyTorch packs everything
  // into one buffer of the promoted dtype; per dtype keeps each parameter's own precision and
  // skips the casts, at one allreduce per dtype present (usually one).
  std::map<at::ScalarType, std::vector<size_t>> by_dtype;
  for (size_t i = 0; i < params.size(); ++i) by_dtype[params[i].scalar_type()].push_back(i);

  std::vector<at::Tensor> flats;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  const std::string failure_context =
      c10::str("average_parameters: the allreduce over group ", ranks_text(group.ranks()),
               " failed", on_this_rank(), " (parameters unchanged): ");
  try {
    for (const auto& entry : by_dtype) {
      std::vector<at::Tensor> pieces;
      pieces.reserve(entry.second.size());
      for (size_t i : entry.second) pieces.push_back(params[i].detach().reshape({-1}));
      // cat copies even a single piece: the parameters stay untouched until every allreduce
      // has succeeded.
      at::Tensor flat = at::cat(pieces);
      // Divide before summing, as PyTorch does: the same rounding as the reference.
      flat.div_(group.size());
      std::vector<at::Tensor> io = {flat};
      works.push_back(group.process_group()->allreduce(io));
      flats.push_back(flat);
    }
    // All allreduces are in flight before the first wait, so they overlap.
    for (auto& work : works) work->wait(group.timeout());
  } catch (const std::exception& e) {
    DISTOPTIM_RETHROW_WITH_CONTEXT(e, failure_context);
  }

  size_t flat_index = 0;
  for (const auto& entry : by_dtype) {
    const at::Tensor& flat = flats[flat_index++];
    int64_t offset = 0;
    for (size_t i : entry.second) {
      at::Tensor p = params[i].detach();
      const int64_t numel = p.numel();
      p.copy_(flat.narrow(0, offset, numel).view(p.sizes()));
      offset += numel;
    }
  }
}

ModelAverager::ModelAverager(const char* name, std::optional<comm::Group> process_group)
    : name_(name), process_group_(process_group ? std::move(*process_group) : comm::world()) {
  TORCH_CHECK_VALUE(process_group_.size() > 0, name_,
                    ": process_group is an empty group (a default-constructed comm::Group)",
                    on_this_rank());
}

ModelAverager::~ModelAverager() = default;

void ModelAverager::set_step(int64_t step) {
  TORCH_CHECK_VALUE(step >= 0, name_, "::set_step: step = ", step, on_this_rank(),
                    "; must be non-negative");
  step_ = step;
}

void ModelAverager::average_parameters(const std::vector<at::Tensor>& params) {
  check_params_to_average(params, std::string(name_) + "::average_parameters");
  if (const comm::Group* group = group_for_step(step_)) {
    data_parallel::average_parameters(get_params_to_average(params), *group);
  }
  ++step_;
}

void ModelAverager::average_parameters(const std::vector<optim::ParamGroup>& param_groups) {
  // Every tensor is checked, with or without a gradient: input that is bad on some ranks only
  // would otherwise fail on those ranks and leave the others waiting in the allreduce.
  average_parameters(all_params(param_groups));
}

void ModelAverager::average_parameters(
    const std::vector<torch::optim::OptimizerParamGroup>& param_groups) {
  average_parameters(all_params(param_groups));
}

PeriodicModelAverager::PeriodicModelAverager(int64_t period, int64_t warmup_steps,
                                             std::optional<comm::Group> process_group)
    : ModelAverager("PeriodicModelAverager", std::move(process_group)),
      period_(period),
      warmup_steps_(warmup_steps) {
  TORCH_CHECK_VALUE(warmup_steps >= 0, name(), ": warmup_steps = ", warmup_steps, on_this_rank(),
                    "; must be non-negative");
  TORCH_CHECK_VALUE(period >= 1, name(), ": period = ", period, on_this_rank(),
                    "; must be positive");
  if (period == 1) {
    TORCH_WARN(name(),
               ": period = 1 averages the parameters at every step, which costs no less "
               "than averaging the gradients in DistributedDataParallel's backward pass; use "
               "DistributedDataParallel alone instead");
  }
}

const comm::Group* PeriodicModelAverager::group_for_step(int64_t step) const {
  if (step < warmup_steps_ || (step - warmup_steps_) % period_ != 0) return nullptr;
  return &process_group();
}

namespace {

// Checks the hierarchy before any group is made, so a bad argument leaves every rank's group
// numbering (new_group's call count) as it was.
void check_hierarchy(const std::map<int64_t, int>& period_group_size_dict, int64_t warmup_steps,
                     int overall_size) {
  constexpr const char* kName = "HierarchicalModelAverager";
  TORCH_CHECK_VALUE(!period_group_size_dict.empty(), kName, ": period_group_size_dict is empty",
                    on_this_rank());
  const int64_t smallest_period = period_group_size_dict.begin()->first;
  TORCH_CHECK_VALUE(smallest_period >= 1, kName, ": period_group_size_dict has period ",
                    smallest_period, on_this_rank(), "; periods must be positive");
  int previous_size = 1;
  int64_t previous_period = 0;
  for (const auto& [period, size] : period_group_size_dict) {
    TORCH_CHECK_VALUE(size >= 1 && overall_size % size == 0, kName, ": period_group_size_dict[",
                      period, "] = ", size, on_this_rank(),
                      "; group sizes must divide the size of process_group, ", overall_size);
    TORCH_CHECK_VALUE(size % previous_size == 0, kName, ": period_group_size_dict[", period,
                      "] = ", size, " is not a multiple of period_group_size_dict[",
                      previous_period, "] = ", previous_size, on_this_rank(),
                      "; the groups of a larger period must contain those of a smaller one");
    previous_size = size;
    previous_period = period;
  }
  const auto& [largest_period, last_size] = *period_group_size_dict.rbegin();
  TORCH_CHECK_VALUE(last_size == overall_size, kName, ": period_group_size_dict[", largest_period,
                    "] = ", last_size, on_this_rank(),
                    "; the largest period's group size must be the size of process_group, ",
                    overall_size);
  TORCH_CHECK_VALUE(warmup_steps >= 0, kName, ": warmup_steps = ", warmup_steps, on_this_rank(),
                    "; must be non-negative");
  if (largest_period == 1) {
    TORCH_WARN(kName,
               ": the largest period in period_group_size_dict is 1: parameters are "
               "averaged at every step, which costs no less than averaging the gradients in "
               "DistributedDataParallel's backward pass; use DistributedDataParallel alone "
               "instead");
  }
}

// This rank's group among the blocks of `size` consecutive ranks of `overall`. Collective over
// the world.
comm::Group make_subgroup(const comm::Group& overall, int size) {
  const std::vector<int>& ranks = overall.ranks();
  const bool is_world = static_cast<int>(ranks.size()) == comm::get_world_size();
  if (is_world) return comm::new_subgroups(size).first;
  std::vector<std::vector<int>> blocks;
  for (size_t first = 0; first < ranks.size(); first += static_cast<size_t>(size)) {
    blocks.emplace_back(ranks.begin() + static_cast<std::ptrdiff_t>(first),
                        ranks.begin() + static_cast<std::ptrdiff_t>(first + size));
  }
  return comm::new_subgroups_by_enumeration(blocks).first;
}

}  // namespace

HierarchicalModelAverager::HierarchicalModelAverager(
    const std::map<int64_t, int>& period_group_size_dict, int64_t warmup_steps,
    std::optional<comm::Group> process_group)
    : ModelAverager("HierarchicalModelAverager", std::move(process_group)),
      warmup_steps_(warmup_steps) {
  const comm::Group& overall = this->process_group();
  check_hierarchy(period_group_size_dict, warmup_steps, overall.size());
  for (const auto& [period, size] : period_group_size_dict) {
    period_process_group_dict_.emplace(
        period, size == overall.size() ? overall : make_subgroup(overall, size));
  }
}

const comm::Group* HierarchicalModelAverager::group_for_step(int64_t step) const {
  if (step < warmup_steps_) return nullptr;
  for (auto it = period_process_group_dict_.rbegin(); it != period_process_group_dict_.rend();
       ++it) {
    if (step % it->first == 0) return &it->second;
  }
  return nullptr;
}

}  // namespace data_parallel
}  // namespace distoptim
