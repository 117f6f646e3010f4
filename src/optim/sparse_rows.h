#pragma once

// The row updates of sparse gradients (SparseAdam, Adagrad) as one pass over each named row:
// plain loops over raw memory, compiled with the kernels' flags (no fused multiply-add, so every
// operation rounds as LibTorch's separate operations do). `rows` are the rows of the parameter
// viewed as [rows, row_numel], unique (a coalesced gradient's), and `values` their gradients,
// [nnz, row_numel]; every buffer is contiguous. The caller splits [begin, end) across threads.

#include <cstdint>

namespace distoptim {
namespace optim {
namespace detail {

/// torch.optim.SparseAdam's update of rows [begin, end): the moments move toward the gradient,
/// param += (m / (sqrt(v) + eps)) * neg_step_size, in SparseAdam's order of operations.
template <class T>
void sparse_adam_rows(T* param, T* exp_avg, T* exp_avg_sq, const T* values, const int64_t* rows,
                      int64_t begin, int64_t end, int64_t row_numel, T one_minus_beta1,
                      T one_minus_beta2, T eps, T neg_step_size);

/// torch.optim.Adagrad's sparse update of rows [begin, end): sum += g * g,
/// param += neg_clr * (g / (sqrt(sum) + eps)).
template <class T>
void adagrad_rows(T* param, T* sum, const T* values, const int64_t* rows, int64_t begin,
                  int64_t end, int64_t row_numel, T eps, T neg_clr);

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
