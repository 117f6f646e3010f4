#include "update_common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include "huge_pages.h"

namespace distoptim {
namespace optim {
namespace detail {

at::Tensor new_state_buffer(const at::Tensor& param) {
  at::Tensor buffer = param.is_non_overlapping_and_dense()
                          ? at::empty_like(param, at::MemoryFormat::Preserve)
                          : at::empty(param.sizes(), param.options());
  // Huge pages for a large buffer before the zeros touch it: one fault per 2 MB, and the rows a
  // sparse step reaches stay within the TLB's reach (huge_pages.h).
  advise_huge_pages_before_first_touch(buffer);
  return buffer.zero_();
}

UpdateItem stateful_item(const FunctionalOptimizer::ParamUpdate& update,
                         std::initializer_list<StateSlot> slots, bool count_step) {
  UpdateItem item;
  item.operands[0] = update.param;
  item.operands[1] = update.grad;
  int k = 2;
  for (const StateSlot& slot : slots) {
    if (slot.index >= 0) {
      at::Tensor& buffer = update.state->buffers[slot.index];
      if (!buffer.defined()) {
        buffer = new_state_buffer(*update.param);
        if (slot.initial_value != 0) buffer.fill_(slot.initial_value);
      }
      item.operands[k] = &buffer;
    }
    ++k;
  }
  item.num_operands = k;
  if (count_step) ++update.state->step;
  item.step = update.state->step;
  return item;
}

kernels::UpdateTask::Kernel KernelChoice::operator()(at::ScalarType dtype) {
  if (dtype == at::kFloat) {
    if (float_kernel_ == nullptr) float_kernel_ = kernels::select_kernel(algorithm_, dtype, flags_);
    return float_kernel_;
  }
  if (dtype == at::kDouble) {
    if (double_kernel_ == nullptr) {
      double_kernel_ = kernels::select_kernel(algorithm_, dtype, flags_);
    }
    return double_kernel_;
  }
  return kernels::select_kernel(algorithm_, dtype, flags_);  // throws: no kernel for it
}

namespace {

// Whether `cached` still describes the operands of `update` for `slots`. Reads the parameter's
// and the gradient's metadata, and of the state only which tensors fill the slots.
bool cache_matches(const CachedOperands& cached, const FunctionalOptimizer::ParamUpdate& update,
                   std::initializer_list<StateSlot> slots) {
  const c10::TensorImpl* param = update.param->unsafeGetTensorImpl();
  // step() has checked that the gradient's dtype and sizes are the parameter's.
  if (!param->is_contiguous() || !update.grad->unsafeGetTensorImpl()->is_contiguous() ||
      param->numel() != cached.numel || c10::typeMetaToScalarType(param->dtype()) != cached.dtype ||
      param->data() != cached.param_data) {
    return false;
  }
  for (const StateSlot& slot : slots) {
    if (slot.index < 0) continue;
    if (update.state->buffers[slot.index].unsafeGetTensorImpl() != cached.state_impl[slot.index] ||
        cached.state_data[slot.index] == nullptr) {
      return false;
    }
  }
  return true;
}

// What the next step may take from the cache about `update`, whose buffers exist now: nothing
// unless the parameter is contiguous, so that its data, size and dtype fix its layout.
CachedOperands cache_entry(const StepCache& cache, const FunctionalOptimizer::ParamUpdate& update) {
  CachedOperands entry;
  const at::Tensor& param = *update.param;
  if (!param.is_contiguous() || param.numel() == 0) return entry;
  const std::vector<at::Tensor>& buffers = update.state->buffers;
  TORCH_INTERNAL_ASSERT(buffers.size() <= static_cast<size_t>(kMaxStateSlots));
  entry.generation = cache.generation;
  entry.param_data = param.data_ptr();
  entry.numel = param.numel();
  entry.dtype = param.scalar_type();
  for (size_t k = 0; k < buffers.size(); ++k) {
    const at::Tensor& buffer = buffers[k];
    entry.state_impl[k] = buffer.unsafeGetTensorImpl();
    if (buffer.defined() && buffer.layout() == at::kStrided && buffer.device() == param.device() &&
        buffer.scalar_type() == entry.dtype && buffer.numel() == entry.numel &&
        buffer.is_contiguous()) {
      entry.state_data[k] = buffer.data_ptr();
    }
  }
  return entry;
}

}  // namespace

kernels::UpdateTask& add_stateful_task(StepCache& cache,
                                       const FunctionalOptimizer::ParamUpdate& update,
                                       KernelChoice& kernel, std::initializer_list<StateSlot> slots,
                                       bool count_step) {
  CachedOperands& cached = cache.params[update.index];
  if (cached.generation == cache.generation && cache_matches(cached, update, slots)) {
    kernels::UpdateTask& task = cache.batch.add_direct();
    task.kernel = kernel(cached.dtype);
    task.data[0] = cached.param_data;
    task.data[1] = update.grad->data_ptr();
    int k = 2;
    for (const StateSlot& slot : slots) {
      task.data[k++] = slot.index >= 0 ? cached.state_data[slot.index] : nullptr;
    }
    task.numel = cached.numel;
    task.element_size = static_cast<int64_t>(c10::elementSize(cached.dtype));
    if (count_step) ++update.state->step;
    return task;
  }
  const UpdateItem item = stateful_item(update, slots, count_step);
  kernels::UpdateTask& task =
      cache.batch.add(kernel(update.param->scalar_type()), item.operands, item.num_operands);
  cached = cache_entry(cache, update);
  return task;
}

std::vector<UpdateItem> items_from_lists(
    const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
    std::initializer_list<const std::vector<at::Tensor>*> buffer_lists,
    const std::vector<int64_t>* steps) {
  std::vector<UpdateItem> items(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    UpdateItem& item = items[i];
    item.operands[0] = &params[i];
    item.operands[1] = &grads[i];
    int k = 2;
    for (const auto* list : buffer_lists) item.operands[k++] = list ? &(*list)[i] : nullptr;
    item.num_operands = k;
    item.step = steps ? (*steps)[i] : 0;
  }
  return items;
}

namespace {
void check_like(const char* function, const char* list, size_t i, const at::Tensor& t,
                const at::Tensor& param) {
  TORCH_CHECK_VALUE(t.defined(), function, ": ", list, "[", i, "] is undefined");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided && t.device() == param.device(), function, ": ",
                    list, "[", i, "] must be a dense tensor on ", param.device());
  TORCH_CHECK_TYPE(t.scalar_type() == param.scalar_type(), function, ": ", list, "[", i,
                   "] has dtype ", t.scalar_type(), ", params[", i, "] ", param.scalar_type());
  TORCH_CHECK_VALUE(t.sizes() == param.sizes(), function, ": ", list, "[", i, "] has shape ",
                    t.sizes(), ", params[", i, "] ", param.sizes());
}
}  // namespace

void check_lists(
    const char* function, const std::vector<at::Tensor>& params,
    const std::vector<at::Tensor>& grads,
    std::initializer_list<std::pair<const char*, const std::vector<at::Tensor>*>> buffers) {
  TORCH_CHECK_VALUE(grads.size() == params.size(), function, ": ", grads.size(), " grads for ",
                    params.size(), " params");
  for (const auto& b : buffers) {
    TORCH_CHECK_VALUE(b.second->size() == params.size(), function, ": ", b.second->size(), " ",
                      b.first, " for ", params.size(), " params");
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK_VALUE(p.defined() && p.layout() == at::kStrided && p.device().is_cpu(), function,
                      ": params[", i, "] must be a defined dense CPU tensor");
    TORCH_CHECK_TYPE(p.scalar_type() == at::kFloat || p.scalar_type() == at::kDouble, function,
                     ": params[", i, "] has dtype ", p.scalar_type(), "; supported: Float, Double");
    check_like(function, "grads", i, grads[i], p);
    for (const auto& b : buffers) check_like(function, b.first, i, (*b.second)[i], p);
  }
}

void check_steps(const char* function, const std::vector<at::Tensor>& params,
                 const std::vector<int64_t>& steps) {
  TORCH_CHECK_VALUE(steps.size() == params.size(), function, ": ", steps.size(), " steps for ",
                    params.size(), " params");
  for (size_t i = 0; i < steps.size(); ++i) {
    TORCH_CHECK_VALUE(steps[i] >= 1, function, ": steps[", i, "] = ", steps[i],
                      " (the count after this step, so >= 1)");
  }
}

SparseGradientRows gradient_rows(const at::Tensor& coalesced_grad) {
  const at::Tensor indices = coalesced_grad._indices();
  SparseGradientRows out;
  out.rows = indices[0];
  for (int64_t d = 1; d < coalesced_grad.sparse_dim(); ++d) {
    out.rows = out.rows * coalesced_grad.size(d) + indices[d];
  }
  out.rows = out.rows.contiguous();
  for (int64_t d = coalesced_grad.sparse_dim(); d < coalesced_grad.dim(); ++d) {
    out.row_numel *= coalesced_grad.size(d);
  }
  out.values = coalesced_grad._values().contiguous();
  return out;
}

void for_each_row_range(int64_t nnz, int64_t row_numel,
                        const std::function<void(int64_t, int64_t)>& rows) {
  // About 32K elements per task: enough work to pay for handing it to another thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(row_numel, 1));
  at::parallel_for(0, nnz, grain, rows);
}

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
