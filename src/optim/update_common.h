#pragma once

// Shared plumbing of the built-in optimizers: one parameter's operands for a fused update, and
// the argument checks of the list-based functional API.

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include <distoptim/optim/functional_optimizer.h>

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

/// A state buffer an update uses: its slot in ParamState::buffers and the value a new one starts
/// with. Slot -1 stands for an operand the kernel variant does not touch.
struct StateSlot {
  int index;
  double initial_value = 0;
};

/// The item of one parameter in a stateful step: the parameter, its gradient, then the buffers
/// of `slots` in order, creating those that do not exist yet. Counts the step.
UpdateItem stateful_item(const FunctionalOptimizer::ParamUpdate& update,
                         std::initializer_list<StateSlot> slots);

/// The items of a list-based functional:: update: params[i], grads[i], then buffer_lists[k][i]
/// for each k (a null list is an unused operand), with steps[i] when `steps` is given.
std::vector<UpdateItem> items_from_lists(
    const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
    std::initializer_list<const std::vector<at::Tensor>*> buffer_lists,
    const std::vector<int64_t>* steps = nullptr);

/// A zero-filled buffer laid out like `param` (same strides when `param` is dense).
at::Tensor new_state_buffer(const at::Tensor& param);

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
