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

/// Flag bits that select a kernel variant (compile-time branches inside the kernel).
enum KernelFlag : uint32_t {
  kMaximize = 1u << 0,
  kWeightDecay = 1u << 1,
  /// SGD: momentum. Adam: amsgrad. RMSprop: centered.
  kVariantA = 1u << 2,
  /// SGD: nesterov. Adam: decoupled weight decay (AdamW). RMSprop: momentum.
  kVariantB = 1u << 3,
  /// SGD: first step with momentum (the buffer is set to the gradient, not blended).
  kVariantC = 1u << 4,
};
constexpr uint32_t kNumFlagCombinations = 1u << 5;

/// One tensor's share of an update: the operands' first elements and the scalars of its formula.
/// All operands share one memory layout and `numel` elements; the kernel touches [begin, end).
struct UpdateTask {
  using Kernel = void (*)(const UpdateTask& task, int64_t begin, int64_t end);
  /// The maximum number of operands: the parameter, its gradient and up to three state buffers.
  static constexpr int kMaxOperands = 5;
  static constexpr int kMaxScalars = 10;

  Kernel kernel = nullptr;
  void* data[kMaxOperands] = {};
  int64_t numel = 0;
  double scalars[kMaxScalars] = {};
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
  void run();
  bool empty() const { return tasks_.empty(); }

 private:
  std::vector<UpdateTask> tasks_;
  std::vector<at::Tensor> staged_;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back_;
  UpdateTask scratch_;
};

/// Runs `tasks` over LibTorch's intra-op thread pool, one parallel region for all of them.
void run_update_tasks(const std::vector<UpdateTask>& tasks);

}  // namespace kernels
}  // namespace optim
}  // namespace distoptim
