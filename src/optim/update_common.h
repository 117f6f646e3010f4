#pragma once

// Shared plumbing of the built-in optimizers: one parameter's operands for a fused update, and
// the argument checks of the list-based functional API.

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "kernels/update_task.h"

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

/// A zero-filled buffer laid out like `param` (same strides when `param` is dense).
at::Tensor new_state_buffer(const at::Tensor& param);

/// Checks the list arguments of a functional:: update: every list as long as `params`, every
/// gradient and buffer defined and shaped like its parameter. Names the list and the index.
void check_lists(const char* function, const std::vector<at::Tensor>& params,
                 const std::vector<at::Tensor>& grads,
                 std::initializer_list<std::pair<const char*, const std::vector<at::Tensor>*>> buffers);
void check_steps(const char* function, const std::vector<at::Tensor>& params,
                 const std::vector<int64_t>& steps);

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
