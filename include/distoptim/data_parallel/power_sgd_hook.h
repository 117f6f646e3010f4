#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>

#include <ATen/core/ivalue.h>
#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <distoptim/comm/process_group.h>

namespace distoptim {
namespace data_parallel {

/// PowerSGDState's hyperparameters, named and defaulted as PyTorch 1.13's PowerSGDState
/// arguments (start_powerSGD_iter spelled start_power_sgd_iter). PyTorch's
/// compression_stats_logging_frequency has no counterpart: nothing is logged, read
/// PowerSGDState::compression_stats() instead.
struct PowerSGDOptions {
  /// The rank of the low-rank factors P and Q: the lower, the stronger the compression.
  TORCH_ARG(int64_t, matrix_approximation_rank) = 1;
  /// Buckets are averaged by a plain allreduce for this many iterations, then compressed.
  TORCH_ARG(int64_t, start_power_sgd_iter) = 1000;
  /// A gradient is compressed only when (rows + columns) x rank x min_compression_rate < rows x
  /// columns; the others (biases, small layers) are allreduced as they are.
  TORCH_ARG(double, min_compression_rate) = 2;
  /// Adds each bucket's compression error of the previous iteration to its gradients.
  TORCH_ARG(bool, use_error_feedback) = true;
  /// Starts each iteration from the previous iteration's Q instead of a random one.
  TORCH_ARG(bool, warm_start) = true;
  /// Added to every column norm when orthogonalizing, so a column of zeros gives zeros, not NaN.
  TORCH_ARG(double, orthogonalization_epsilon) = 0;
  /// Seeds the draws of the random Qs, equal on every rank (NumPy's RandomState(random_seed),
  /// then torch.manual_seed of its draws, as in PyTorch: the same seed gives PyTorch's Qs).
  TORCH_ARG(int64_t, random_seed) = 0;
  /// Compresses same-shaped gradients of a bucket in one batched product each.
  TORCH_ARG(bool, batch_tensors_with_same_shape) = false;
};

/// The state of the PowerSGD communication hooks (PyTorch's PowerSGDState): the options, the
/// group, and per bucket the error feedback and the warm-started factors P and Q, with the
/// iteration count and the compression statistics.
///
/// Thread safety: one state serves one DistributedDataParallel; its hooks update it from the
/// backward thread and from the group's threads under an internal mutex, and the accessors may be
/// called from any thread. Errors: the constructor throws c10::ValueError naming an option out
/// of range, before anything else, or when this rank is not in the group.
class PowerSGDState {
 public:
  /// `process_group`: the world when not given. As in PyTorch, use_error_feedback or warm_start
  /// need start_power_sgd_iter of at least 2: DDP rebuilds its buckets after the first
  /// iteration, which would change the shape of what they remember.
  explicit PowerSGDState(std::optional<comm::Group> process_group, PowerSGDOptions options = {});
  ~PowerSGDState();
  PowerSGDState(const PowerSGDState&) = delete;
  PowerSGDState& operator=(const PowerSGDState&) = delete;

  const PowerSGDOptions& options() const { return options_; }
  const comm::Group& process_group() const { return process_group_; }
  /// Iterations done so far (counted on each backward's last bucket).
  int64_t iter() const;
  /// PyTorch's compression_stats(): (elements before / elements after compression, elements
  /// before, elements after), summed over the compressed iterations; the rate is 0 before any.
  std::tuple<double, int64_t, int64_t> compression_stats() const;

  /// What PyTorch 1.13 pickles of its PowerSGDState (all but the group): the options, the
  /// iteration count, the compression statistics, the random generator's state, and per bucket
  /// this rank's error feedback and factors P and Q (copies). A dict of strings to values, for
  /// checkpoints (CheckpointItems::power_sgd saves it with each rank's file).
  c10::IValue state_dict() const;
  /// Takes what state_dict() returned, of a state with the same options, so that training goes
  /// on as if never stopped. c10::ValueError naming the option that differs or the entry that is
  /// missing or malformed, with nothing changed. Call it before the hooks run (not concurrently).
  void load_state_dict(const c10::IValue& state);

 private:
  friend struct PowerSGDStateAccess;
  struct Memory;

  const PowerSGDOptions options_;
  const comm::Group process_group_;
  std::unique_ptr<Memory> memory_;
};

/// PyTorch's powerSGD_hook (https://arxiv.org/abs/1905.13727): after start_power_sgd_iter
/// iterations of plain averaging, each gradient M of a bucket that is worth compressing is
/// approximated as P Q^T of rank matrix_approximation_rank: P = M Q is averaged, orthogonalized,
/// Q = M^T P averaged, and M replaced by P Q^T; the other gradients are averaged as they are.
/// Every rank gets the same approximation. For DistributedDataParallel::register_comm_hook.
/// Thread safety: as the DDP it is registered with; `state` as PowerSGDState says. Throws
/// c10::ValueError when `state` is null.
std::unique_ptr<c10d::CommHookInterface> power_sgd_hook(std::shared_ptr<PowerSGDState> state);

/// PyTorch's batched_powerSGD_hook: as power_sgd_hook, but the whole bucket is compressed as one
/// square matrix (padded with zeros), so rank 1 is all that usually keeps the accuracy. As in
/// PyTorch, its orthogonalization adds no epsilon whatever orthogonalization_epsilon says. PyTorch
/// 1.13's own fails from start_powerSGD_iter on (its orthogonalization wants a batch of matrices);
/// this one orthogonalizes each factor as a batch of one, as that code means.
std::unique_ptr<c10d::CommHookInterface> batched_power_sgd_hook(
    std::shared_ptr<PowerSGDState> state);

}  // namespace data_parallel
}  // namespace distoptim
