#pragma once

// Shared plumbing of the built-in optimizers: one parameter's operands for a fused update, and
// the argument checks of the list-based functional API.

#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include <distoptim/optim/functional_optimizer.h>

#include "kernels/update_task.h"
#include "step_cache.h"

namespace distoptim {
namespace optim {
namespace detail {

/// The tensors of one parameter's update, in the kernel's operand order (parameter, gradient,
/// state buffers), and its step count after this step.
struct UpdateItem {
  const at::Tensor* operands[kernels::UpdateTask::kMaxOperands] = {};
  int num_operands = 0;
  int64_t step = 0;
};

/// A state buffer an update uses: its slot in ParamState::buffers and the value a new one starts
/// with. Slot -1 stands for an operand the kernel variant does not touch.
struct StateSlot {
  int index;
  double initial_value = 0;
};

/// The item of one parameter in a stateful step: the parameter, its gradient, then the buffers
/// of `slots` in order, creating those that do not exist yet. Counts the step when `count_step`.
UpdateItem stateful_item(const FunctionalOptimizer::ParamUpdate& update,
                         std::initializer_list<StateSlot> slots, bool count_step = true);

/// The kernel of one algorithm and variant, selected at most once per dtype (a step's
/// parameters are float or double).
class KernelChoice {
 public:
  KernelChoice(kernels::Algorithm algorithm, uint32_t flags)
      : algorithm_(algorithm), flags_(flags) {}
  kernels::UpdateTask::Kernel operator()(at::ScalarType dtype);

 private:
  kernels::Algorithm algorithm_;
  uint32_t flags_;
  kernels::UpdateTask::Kernel float_kernel_ = nullptr;
  kernels::UpdateTask::Kernel double_kernel_ = nullptr;
};

/// Adds the task of one parameter of a stateful step to the step's batch: the operands of
/// stateful_item(update, slots, count_step) with `kernel`. Their addresses come from `cache`
/// while the parameter's data, size and dtype, and the identity of the buffers in `slots`, are
/// those it cached; else (the first step, a changed parameter, a buffer created or replaced)
/// they are found anew and cached. Returns the task for the caller to fill in its scalars.
kernels::UpdateTask& add_stateful_task(StepCache& cache,
                                       const FunctionalOptimizer::ParamUpdate& update,
                                       KernelChoice& kernel, std::initializer_list<StateSlot> slots,
                                       bool count_step = true);

/// The items of a list-based functional:: update: params[i], grads[i], then buffer_lists[k][i]
/// for each k (a null list is an unused operand), with steps[i] when `steps` is given.
std::vector<UpdateItem> items_from_lists(
    const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
    std::initializer_list<const std::vector<at::Tensor>*> buffer_lists,
    const std::vector<int64_t>* steps = nullptr);

/// Runs the tasks of a list-based functional:: update: `items` with `kernel`, each task's
/// scalars set by `fill(task, item.step)`.
template <class Fill>
void run_items(const std::vector<UpdateItem>& items, KernelChoice& kernel, Fill&& fill) {
  kernels::UpdateBatch batch;
  for (const UpdateItem& item : items) {
    fill(batch.add(kernel(item.operands[0]->scalar_type()), item.operands, item.num_operands),
         item.step);
  }
  batch.run();
}

/// Adds the tasks of one group's stateful step to the step's batch (see add_stateful_task),
/// each task's scalars set by `fill(task, step)` with the parameter's step count after it.
template <class Fill>
void add_stateful_tasks(StepCache& cache,
                        const std::vector<FunctionalOptimizer::ParamUpdate>& updates,
                        KernelChoice& kernel, std::initializer_list<StateSlot> slots, Fill&& fill) {
  for (const FunctionalOptimizer::ParamUpdate& update : updates) {
    kernels::UpdateTask& task = add_stateful_task(cache, update, kernel, slots);
    fill(task, update.state->step);
  }
}

/// A zero-filled buffer laid out like `param` (same strides when `param` is dense).
at::Tensor new_state_buffer(const at::Tensor& param);

/// A coalesced sparse gradient of `param` as rows of `param` viewed as [rows, row_numel]: the
/// rows (int64, unique) and their values, contiguous [nnz, row_numel]. For the one-pass row
/// updates (sparse_rows.h), which need `param` and every state buffer contiguous.
struct SparseGradientRows {
  at::Tensor rows;
  at::Tensor values;
  int64_t row_numel = 1;
};
SparseGradientRows gradient_rows(const at::Tensor& coalesced_grad);
/// Runs `rows(begin, end)` over [0, nnz) split across the intra-op threads.
void for_each_row_range(int64_t nnz, int64_t row_numel,
                        const std::function<void(int64_t, int64_t)>& rows);

/// Checks the list arguments of a functional:: update: every list as long as `params`, every
/// gradient and buffer defined and shaped like its parameter. Names the list and the index.
void check_lists(
    const char* function, const std::vector<at::Tensor>& params,
    const std::vector<at::Tensor>& grads,
    std::initializer_list<std::pair<const char*, const std::vector<at::Tensor>*>> buffers);
void check_steps(const char* function, const std::vector<at::Tensor>& params,
                 const std::vector<int64_t>& steps);

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
