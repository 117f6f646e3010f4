#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace distoptim {
namespace optim {
namespace kernels {

/// The update rules the fused kernels implement.
enum class Algorithm { kSgd, kAdam, kAdagrad, kAdadelta, kAdamax, kRmsprop, kRprop };

/// Flag bits that select a kernel variant (compile-time branches inside the kernel). The first
/// two mean the same for every algorithm; the others are named per algorithm below.
enum KernelFlag : uint32_t {
  kMaximize = 1u << 0,
  /// L2 weight decay folded into the gradient (d = g + weight_decay * p).
  kWeightDecay = 1u << 1,
};
/// SGD's variants.
enum SgdFlag : uint32_t {
  kSgdMomentum = 1u << 2,
  /// Needs kSgdMomentum.
  kSgdNesterov = 1u << 3,
  /// The first step with momentum: the buffer is set to the gradient, not blended. Needs
  /// kSgdMomentum.
  kSgdFirstStep = 1u << 4,
};
/// Adam's and AdamW's variants.
enum AdamFlag : uint32_t {
  kAdamAmsgrad = 1u << 2,
  /// AdamW's decoupled weight decay (p *= 1 - lr * weight_decay); excludes kWeightDecay.
  kAdamDecoupled = 1u << 3,
};
/// RMSprop's variants.
enum RmspropFlag : uint32_t {
  kRmspropCentered = 1u << 2,
  kRmspropMomentum = 1u << 3,
};
constexpr uint32_t kNumFlagCombinations = 1u << 5;

// The scalars of each algorithm's formula, as torch.optim computes them in double; the kernels
// round them to the tensor's dtype as ATen does.

/// torch.optim.SGD. Operands: p, g, momentum_buffer.
struct SgdParams {
  double lr;
  double weight_decay;
  double momentum;
  double one_minus_dampening;
};
/// torch.optim.Adam / AdamW. Operands: p, g, exp_avg, exp_avg_sq, max_exp_avg_sq.
struct AdamParams {
  double weight_decay;
  double beta1;
  double one_minus_beta1;
  double beta2;
  double one_minus_beta2;
  /// lr / bias_correction1.
  double step_size;
  double bias_correction2_sqrt;
  double eps;
  /// AdamW's decay factor, 1 - lr * weight_decay.
  double decay;
};
/// torch.optim.Adagrad. Operands: p, g, sum.
struct AdagradParams {
  double weight_decay;
  /// lr / (1 + (step - 1) * lr_decay).
  double clr;
  double eps;
};
/// torch.optim.Adadelta. Operands: p, g, square_avg, acc_delta.
struct AdadeltaParams {
  double weight_decay;
  double rho;
  double one_minus_rho;
  double eps;
  double lr;
};
/// torch.optim.Adamax. Operands: p, g, exp_avg, exp_inf.
struct AdamaxParams {
  double weight_decay;
  double beta1;
  double one_minus_beta1;
  double beta2;
  double eps;
  /// lr / (1 - beta1^step).
  double clr;
};
/// torch.optim.RMSprop. Operands: p, g, square_avg, momentum_buffer, grad_avg.
struct RmspropParams {
  double weight_decay;
  double alpha;
  double one_minus_alpha;
  double eps;
  double lr;
  double momentum;
};
/// torch.optim.Rprop. Operands: p, g, prev, step_size.
struct RpropParams {
  double etaminus;
  double etaplus;
  double step_size_min;
  double step_size_max;
};
/// One task's scalars: the member of its algorithm.
union KernelParams {
  SgdParams sgd;
  AdamParams adam;
  AdagradParams adagrad;
  AdadeltaParams adadelta;
  AdamaxParams adamax;
  RmspropParams rmsprop;
  RpropParams rprop;
};

/// Whether `flags` name a variant `algorithm` can run: the flags are its own and consistent
/// (SGD's Nesterov and first step need momentum; AdamW decays the weights itself, not through
/// the gradient; Rprop has no weight decay). Only these variants are compiled.
constexpr bool is_reachable(Algorithm algorithm, uint32_t flags) {
  constexpr uint32_t kCommon = kMaximize | kWeightDecay;
  switch (algorithm) {
    case Algorithm::kSgd:
      return (flags & ~(kCommon | kSgdMomentum | kSgdNesterov | kSgdFirstStep)) == 0 &&
             ((flags & (kSgdNesterov | kSgdFirstStep)) == 0 || (flags & kSgdMomentum) != 0);
    case Algorithm::kAdam:
      return (flags & ~(kCommon | kAdamAmsgrad | kAdamDecoupled)) == 0 &&
             (flags & (kWeightDecay | kAdamDecoupled)) != (kWeightDecay | kAdamDecoupled);
    case Algorithm::kRmsprop:
      return (flags & ~(kCommon | kRmspropCentered | kRmspropMomentum)) == 0;
    case Algorithm::kRprop:
      return (flags & ~kMaximize) == 0;
    case Algorithm::kAdagrad:
    case Algorithm::kAdadelta:
    case Algorithm::kAdamax:
      return (flags & ~kCommon) == 0;
  }
  return false;
}

/// One tensor's share of an update: the operands' first elements and the scalars of its formula.
/// All operands share one memory layout and `numel` elements; the kernel touches [begin, end).
struct UpdateTask {
  using Kernel = void (*)(const UpdateTask& task, int64_t begin, int64_t end);
  /// The maximum number of operands: the parameter, its gradient and up to three state buffers.
  static constexpr int kMaxOperands = 5;

  Kernel kernel = nullptr;
  void* data[kMaxOperands] = {};
  int64_t numel = 0;
  /// Bytes per element of every operand (4 for float, 8 for double).
  int64_t element_size = 0;
  KernelParams params = {};
};

/// The kernel for `algorithm` over `dtype` (float or double) with `flags`, from the instruction
/// set chosen for this process (see kernel_isa.h).
UpdateTask::Kernel select_kernel(Algorithm algorithm, at::ScalarType dtype, uint32_t flags);

/// Per instruction set: the same kernels compiled with different target flags.
namespace isa_default {
UpdateTask::Kernel select(Algorithm algorithm, at::ScalarType dtype, uint32_t flags);
}
namespace isa_avx2 {
UpdateTask::Kernel select(Algorithm algorithm, at::ScalarType dtype, uint32_t flags);
}
namespace isa_avx512 {
UpdateTask::Kernel select(Algorithm algorithm, at::ScalarType dtype, uint32_t flags);
}

/// Collects the tasks of one optimizer step and runs them in a single parallel pass, split by
/// element count so large tensors are shared between threads and small ones are batched.
///
/// Operands whose layout differs from the parameter's (a gradient with other strides, a
/// non-dense parameter) are staged through temporaries that `run` copies back afterwards.
class UpdateBatch {
 public:
  /// Adds the update of one parameter. `operands[0]` is the parameter, `operands[1]` its
  /// gradient (read only), the rest state buffers (read and written); a null operand is one
  /// the kernel variant does not touch. Returns the task so the
  /// caller can fill in its scalars. Empty tensors add nothing and return a scratch task.
  UpdateTask& add(UpdateTask::Kernel kernel, const at::Tensor* const* operands, int num_operands);
  /// Adds a task whose operands the caller fills in: addresses it knows share one layout and
  /// hold `numel` > 0 elements each.
  UpdateTask& add_direct() {
    tasks_.emplace_back();
    return tasks_.back();
  }
  /// Runs the tasks added since the last run and forgets them (keeping the memory, so a batch
  /// that lives from step to step allocates nothing once warm).
  void run();
  bool empty() const { return tasks_.empty(); }

 private:
  std::vector<UpdateTask> tasks_;
  std::vector<int64_t> starts_;
  std::vector<at::Tensor> staged_;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back_;
  UpdateTask scratch_;
};

/// Runs `tasks` over LibTorch's intra-op thread pool, one parallel region for all of them.
void run_update_tasks(const std::vector<UpdateTask>& tasks);
/// The same with the caller's scratch vector for the tasks' offsets.
void run_update_tasks(const std::vector<UpdateTask>& tasks, std::vector<int64_t>& starts);

}  // namespace kernels
}  // namespace optim
}  // namespace distoptim
