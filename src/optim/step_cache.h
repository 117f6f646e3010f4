#pragma once

// What a FunctionalOptimizer keeps from one step to the next so that a step over many small
// tensors costs little more than its memory traffic: the addresses of each parameter's operands
// and one batch that collects the tasks of every group.
//
// Finding a tensor's data means reading its TensorImpl and then its StorageImpl, cache lines that
// are cold after a forward and backward pass. A step reads them for the parameter (which the user
// owns and may change between steps) and for the gradient (new every step), but not for the state
// buffers, which only the optimizer replaces: their addresses are kept here, and any change to
// them (load_state_dict, a buffer created later) makes the entry stale.

#include <cstdint>
#include <vector>

#include <c10/core/TensorImpl.h>

#include <distoptim/optim/detail/step_cache.h>

#include "kernels/update_task.h"

namespace distoptim {
namespace optim {
namespace detail {

/// The most state buffers one parameter's update uses (the kernel's operands after the parameter
/// and its gradient).
constexpr int kMaxStateSlots = kernels::UpdateTask::kMaxOperands - 2;

/// One parameter's operands as the step that cached them found them.
struct CachedOperands {
  /// StepCache::generation when cached; 0 when nothing is (or can be) cached.
  uint64_t generation = 0;
  /// The parameter's data, element count and dtype. A parameter is cached only while it is
  /// contiguous, so these three fix every address of it.
  void* param_data = nullptr;
  int64_t numel = 0;
  at::ScalarType dtype = at::ScalarType::Undefined;
  /// By slot of ParamState::buffers: the buffer's TensorImpl (null while undefined) and data
  /// (null when it cannot be used directly: undefined, or not contiguous like the parameter).
  const c10::TensorImpl* state_impl[kMaxStateSlots] = {};
  void* state_data[kMaxStateSlots] = {};
};

struct StepCache {
  /// The tasks of every group of one step, run in one parallel region when they are all in.
  kernels::UpdateBatch batch;
  /// By parameter index.
  std::vector<CachedOperands> params;
  /// By parameter index: the storage data under which huge pages were last asked for, when the
  /// parameter took a sparse gradient (huge_pages.h); another address is advised anew.
  std::vector<const void*> huge_pages_advised;
  /// Bumped whenever the optimizer replaces state buffers wholesale (load_state_dict), so an
  /// entry never matches a new buffer that happens to reuse an old one's address.
  uint64_t generation = 1;
};

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
