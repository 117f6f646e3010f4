#include "update_task.h"

#include <algorithm>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

namespace distoptim {
namespace optim {
namespace kernels {

namespace {

// Elements per thread below which splitting a step costs more than it gains (a few microseconds
// of work at memory speed).
constexpr int64_t kGrainElements = 32768;

// How much of the next task's operands a thread prefetches while it runs the current one: each
// operand is its own allocation, where the hardware prefetcher starts afresh (and never crosses
// a page), so a run of small tensors waits on memory at every start. Only the first lines of
// each operand are prefetched, into L2, for the hardware prefetcher to take over from: measured
// on 2000 tensors of 1000 floats (Adam, one thread, operands allocated tensor by tensor), this
// took the kernels from 2.26 to 1.85 ms, where prefetching whole tensors (16 KB of each, into
// L1 and for writing) gained nothing and 4 KB of each into L2 made it slower (2.72 ms).
constexpr int64_t kPrefetchBytes = 512;

// Prefetches the first `count` elements of `task`'s operands, up to kPrefetchBytes of each,
// into L2.
void prefetch_operands(const UpdateTask& task, int64_t count) {
  const int64_t bytes = std::min(count * task.element_size, kPrefetchBytes);
  for (int k = 0; k < UpdateTask::kMaxOperands; ++k) {
    const char* data = static_cast<const char*>(task.data[k]);
    if (data == nullptr) continue;
    for (int64_t offset = 0; offset < bytes; offset += 64) {
      __builtin_prefetch(data + offset, /*rw=*/0, /*locality=*/2);
    }
  }
}

bool same_layout(const at::Tensor& a, const at::Tensor& reference, bool reference_dense) {
  return reference_dense && a.strides() == reference.strides() && a.is_non_overlapping_and_dense();
}

}  // namespace

UpdateTask& UpdateBatch::add(UpdateTask::Kernel kernel, const at::Tensor* const* operands,
                             int num_operands) {
  const at::Tensor& param = *operands[0];
  if (param.numel() == 0) {
    scratch_ = UpdateTask();
    return scratch_;
  }
  UpdateTask task;
  task.kernel = kernel;
  task.numel = param.numel();
  task.element_size = static_cast<int64_t>(param.element_size());
  // Every operand must share one linear layout: the parameter's own when it is dense, else
  // contiguous. Operands that differ are staged through a temporary of that layout.
  const bool param_dense = param.is_non_overlapping_and_dense();
  for (int k = 0; k < num_operands; ++k) {
    if (operands[k] == nullptr) continue;  // an operand this kernel variant does not use
    const at::Tensor& operand = *operands[k];
    if (same_layout(operand, param, param_dense)) {
      task.data[k] = operand.data_ptr();
      continue;
    }
    at::Tensor staged =
        param_dense ? at::empty_like(param) : at::empty(param.sizes(), param.options());
    staged.copy_(operand);
    task.data[k] = staged.data_ptr();
    // The gradient (k == 1) is read only; everything else is written and must be copied back.
    if (k != 1) write_back_.emplace_back(operand, staged);
    staged_.push_back(std::move(staged));
  }
  tasks_.push_back(task);
  return tasks_.back();
}

void UpdateBatch::run() {
  run_update_tasks(tasks_, starts_);
  for (auto& item : write_back_) item.first.copy_(item.second);
  tasks_.clear();
  staged_.clear();
  write_back_.clear();
}

void run_update_tasks(const std::vector<UpdateTask>& tasks) {
  std::vector<int64_t> starts;
  run_update_tasks(tasks, starts);
}

void run_update_tasks(const std::vector<UpdateTask>& tasks, std::vector<int64_t>& starts) {
  if (tasks.empty()) return;
  // starts[i] is the global index of task i's first element.
  starts.resize(tasks.size() + 1);
  starts[0] = 0;
  for (size_t i = 0; i < tasks.size(); ++i) starts[i + 1] = starts[i] + tasks[i].numel;
  const int64_t total = starts.back();
  at::parallel_for(0, total, kGrainElements, [&](int64_t begin, int64_t end) {
    // The last task starting at or before `begin`.
    size_t t = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    while (begin < end && t < tasks.size()) {
      const int64_t task_end = starts[t + 1];
      if (task_end > begin) {
        const int64_t stop = std::min(end, task_end);
        if (t + 1 < tasks.size() && task_end < end) {
          prefetch_operands(tasks[t + 1], std::min(end, starts[t + 2]) - task_end);
        }
        tasks[t].kernel(tasks[t], begin - starts[t], stop - starts[t]);
        begin = stop;
      }
      ++t;
    }
  });
}

}  // namespace kernels
}  // namespace optim
}  // namespace distoptim
