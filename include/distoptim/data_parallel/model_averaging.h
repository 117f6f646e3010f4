#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <distoptim/comm/process_group.h>
#include <distoptim/optim/functional_optimizer.h>

namespace distoptim {
namespace data_parallel {

/// The parameters a model averager averages (PyTorch's utils.get_params_to_average): those of
/// `params`, or of every group in order, that have a gradient. Parameters without one (frozen, or
/// not used yet) are left as they are.
std::vector<at::Tensor> get_params_to_average(const std::vector<at::Tensor>& params);
std::vector<at::Tensor> get_params_to_average(const std::vector<optim::ParamGroup>& param_groups);
std::vector<at::Tensor> get_params_to_average(
    const std::vector<torch::optim::OptimizerParamGroup>& param_groups);

/// Throws c10::ValueError, the message starting with `caller` and naming the parameter's index,
/// what is wrong with it and this rank, unless every tensor of `params` is defined, on the CPU,
/// dense (strided) and floating point: what averaging needs.
void check_params_to_average(const std::vector<at::Tensor>& params, const std::string& caller);

/// Replaces every tensor of `params` by its mean over `group` (PyTorch's utils.average_parameters):
/// the tensors of each dtype are packed into one flat buffer, divided by the group size and
/// summed by one allreduce; the results are copied back in place, so parameters keep their
/// storage, strides and identity (optimizer state stays attached to them). A rank outside
/// `group` returns at once, its tensors untouched. An empty `params` does nothing.
///
/// Collective over `group`: every member calls it with tensors of the same number, shapes and
/// dtypes in the same order, or the allreduce fails (or, for some mismatches, times out).
/// Blocking: waits at most the group's timeout. Errors: bad tensors as check_params_to_average,
/// before any communication; a failed allreduce throws distoptim::DistributedError naming the
/// group and the rank, with every tensor left unchanged (results are written only after every
/// allreduce has completed). Gradients are neither read nor changed.
void average_parameters(const std::vector<at::Tensor>& params, const comm::Group& group);

/// The base of the model averagers (PyTorch's ModelAverager): a step counter and a rule for
/// which process group, if any, averages the parameters at each step.
///
/// `average_parameters` checks its input, averages over `group_for_step(step())` if that is not
/// null, then increments `step()`: one call per training iteration, after the optimizer step.
/// The averaged parameters are those with a gradient (get_params_to_average), as in PyTorch.
///
/// Thread safety: none; calls on one averager must not overlap. Collectiveness: every rank of
/// the process group calls `average_parameters` at every iteration with the same parameters (see
/// the free function average_parameters). Errors: bad input throws c10::ValueError naming the
/// argument, its value and the rank, before anything changes; a failed allreduce throws
/// distoptim::DistributedError and leaves parameters and `step()` unchanged.
class ModelAverager {
 public:
  virtual ~ModelAverager();

  /// Averages `params` if this step calls for it, then increments `step()`.
  void average_parameters(const std::vector<at::Tensor>& params);
  /// The parameters of every group, as PyTorch's `average_parameters(optimizer.param_groups)`.
  void average_parameters(const std::vector<optim::ParamGroup>& param_groups);
  void average_parameters(const std::vector<torch::optim::OptimizerParamGroup>& param_groups);

  /// The number of `average_parameters` calls so far, or as set by `set_step`.
  int64_t step() const { return step_; }
  /// Sets the step counter (as when resuming from a checkpoint). c10::ValueError if negative.
  void set_step(int64_t step);

  /// The group of all ranks that take part in averaging (by default the world).
  const comm::Group& process_group() const { return process_group_; }

  /// The group that averages at step `step`, or null when no averaging happens at that step.
  /// The pointer stays valid as long as the averager.
  virtual const comm::Group* group_for_step(int64_t step) const = 0;

 protected:
  /// `name` starts error messages. `process_group` defaults to comm::world() (which throws when
  /// no default group is initialized); it must not be an empty (default-constructed) Group.
  ModelAverager(const char* name, std::optional<comm::Group> process_group);

  const char* name() const { return name_; }

 private:
  const char* name_;
  comm::Group process_group_;
  int64_t step_ = 0;
};

/// Averages parameters over the process group every `period` steps once `warmup_steps` steps
/// have passed (PyTorch's PeriodicModelAverager): at steps `warmup_steps`,
/// `warmup_steps + period`, ... Together with the post-local-SGD communication hook and
/// PostLocalSGDOptimizer it runs post-local SGD.
///
///   PeriodicModelAverager averager(/*period=*/4, /*warmup_steps=*/100);
///   for (...) { ...; optimizer.step(); averager.average_parameters(model->parameters()); }
///
/// Errors: `period` < 1 or `warmup_steps` < 0 throw c10::ValueError; `period` == 1 warns
/// (TORCH_WARN), as in PyTorch: DDP alone is cheaper then. Threading and collectiveness: as
/// ModelAverager; construction is local (no communication).
class PeriodicModelAverager : public ModelAverager {
 public:
  explicit PeriodicModelAverager(int64_t period, int64_t warmup_steps = 0,
                                 std::optional<comm::Group> process_group = std::nullopt);

  int64_t period() const { return period_; }
  int64_t warmup_steps() const { return warmup_steps_; }

  const comm::Group* group_for_step(int64_t step) const override;

 private:
  int64_t period_;
  int64_t warmup_steps_;
};

/// Hierarchical model averaging (PyTorch's HierarchicalModelAverager, hierarchical SGD): groups of
/// several sizes average at several periods. `period_group_size_dict` maps a period to the size
/// of the groups that average every that many steps; the last (largest) period's size must be
/// the size of `process_group`. After `warmup_steps`, at each step whose counter is divisible by
/// some period, only the groups of the largest such period average (they contain the smaller
/// ones). For example, with {{2, 2}, {4, 4}} on 4 ranks, steps 2, 6, 10, ... average within
/// ranks {0, 1} and {2, 3}, steps 4, 8, ... over all four. As in PyTorch, the divisibility is of
/// the step counter itself, not of the steps since the warm-up.
///
/// Groups of size k are the consecutive ranks of `process_group` in blocks of k: for the world,
/// comm::new_subgroups(k), which works on CPU (PyTorch's needs CUDA).
///
/// Construction is collective over the world: every rank constructs the averager with the same
/// arguments (each group size below the process group's size makes its subgroups with
/// new_group); it waits at most the rendezvous timeout for the others.
/// Errors (c10::ValueError naming the argument, the value and the rank, before any group is
/// made): an empty dict, a period < 1, a group size that does not divide the process group's
/// size or is not a multiple of the previous period's size (the groups must nest; PyTorch does
/// not check this), a last size other than the process group's size, `warmup_steps` < 0. A
/// largest period of 1 warns, as in PyTorch. Threading: as ModelAverager.
class HierarchicalModelAverager : public ModelAverager {
 public:
  explicit HierarchicalModelAverager(const std::map<int64_t, int>& period_group_size_dict,
                                     int64_t warmup_steps = 0,
                                     std::optional<comm::Group> process_group = std::nullopt);

  int64_t warmup_steps() const { return warmup_steps_; }
  /// This rank's group for each period (PyTorch's period_process_group_dict); the largest
  /// period's is the process group itself.
  const std::map<int64_t, comm::Group>& period_process_group_dict() const {
    return period_process_group_dict_;
  }

  const comm::Group* group_for_step(int64_t step) const override;

 private:
  int64_t warmup_steps_;
  std::map<int64_t, comm::Group> period_process_group_dict_;
};

}  // namespace data_parallel
}  // namespace distoptim
