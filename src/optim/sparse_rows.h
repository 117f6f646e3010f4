#pragma once

// The row updates of sparse gradients (SparseAdam, Adagrad, SGD) as one pass over each named
// row: plain loops over raw memory, compiled with the kernels' flags (no fused multiply-add, so
// every operation rounds as LibTorch's separate operations do; SGD's one fused multiply-add is
// written out, as LibTorch's axpy rounds it). `rows` are the rows of the parameter viewed as
// [rows, row_numel], and `values` their gradients, [nnz, row_numel]; every buffer is contiguous.
// SparseAdam's and Adagrad's rows are unique (a coalesced gradient's) and the caller splits
// [begin, end) across threads; SGD's may repeat (see sgd_rows).

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

/// torch.optim.SGD's sparse update without momentum, param.add_(grad, alpha), as LibTorch 1.13's
/// dense += sparse computes it for a gradient with dense dimensions: entry k in order,
/// param[rows[k]] = fma(alpha, values[k], param[rows[k]]) (its axpy, OpenBLAS's, fuses the
/// multiply and add). A row named twice takes its entries one after another, uncoalesced, as
/// LibTorch does. Only the entries whose row lies in [row_begin, row_end) are applied, so
/// threads may split the rows of a gradient with repeats; `all_rows` says the range is every
/// row, skipping the test. Rows a few entries ahead are prefetched so their misses overlap.
template <class T>
void sgd_rows(T* param, const T* values, const int64_t* rows, int64_t begin, int64_t end,
              int64_t row_numel, T alpha, int64_t row_begin, int64_t row_end, bool all_rows);

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
