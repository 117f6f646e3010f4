#include "sparse_rows.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <distoptim/optim/kernel_isa.h>

namespace distoptim {
namespace optim {
namespace detail {

template <class T>
void sparse_adam_rows(T* param, T* exp_avg, T* exp_avg_sq, const T* values, const int64_t* rows,
                      int64_t begin, int64_t end, int64_t row_numel, T one_minus_beta1,
                      T one_minus_beta2, T eps, T neg_step_size) {
  for (int64_t k = begin; k < end; ++k) {
    const int64_t offset = rows[k] * row_numel;
    T* p = param + offset;
    T* m = exp_avg + offset;
    T* v = exp_avg_sq + offset;
    const T* g = values + k * row_numel;
    for (int64_t j = 0; j < row_numel; ++j) {
      const T m_old = m[j];
      const T m_update = (g[j] - m_old) * one_minus_beta1;
      m[j] = m_old + m_update;
      const T v_old = v[j];
      const T v_update = (g[j] * g[j] - v_old) * one_minus_beta2;
      v[j] = v_old + v_update;
      const T numer = m_update + m_old;
      const T denom = std::sqrt(v_update + v_old) + eps;
      p[j] = p[j] + (numer / denom) * neg_step_size;
    }
  }
}

template <class T>
void adagrad_rows(T* param, T* sum, const T* values, const int64_t* rows, int64_t begin,
                  int64_t end, int64_t row_numel, T eps, T neg_clr) {
  for (int64_t k = begin; k < end; ++k) {
    const int64_t offset = rows[k] * row_numel;
    T* p = param + offset;
    T* s = sum + offset;
    const T* g = values + k * row_numel;
    for (int64_t j = 0; j < row_numel; ++j) {
      const T total = s[j] + g[j] * g[j];
      s[j] = total;
      p[j] = p[j] + neg_clr * (g[j] / (std::sqrt(total) + eps));
    }
  }
}

namespace {

// Entries ahead whose parameter rows are prefetched, into L2 (the L1's few fill buffers would
// cap the misses in flight): the rows of a large table miss the cache one after another, and
// some tens of them in flight hide most of each miss (4096 rows of a 1e7-row table, in a plain
// loop on this kind of machine: 108 us with 16 rows ahead into L1, 90 us with 32 into L2).
constexpr int64_t kPrefetchAhead = 32;
constexpr int kPrefetchLocality = 2;  // prefetcht1
// Lines of a row prefetched: a long row is streamed well by the hardware prefetcher once begun.
constexpr int64_t kPrefetchLines = 4;
constexpr int64_t kLineBytes = 64;

template <class T>
__attribute__((always_inline)) inline void sgd_rows_body(T* param, const T* values,
                                                         const int64_t* rows, int64_t begin,
                                                         int64_t end, int64_t row_numel, T alpha,
                                                         int64_t row_begin, int64_t row_end,
                                                         bool all_rows) {
  const int64_t line = kLineBytes / static_cast<int64_t>(sizeof(T));
  const int64_t prefetched = std::min(row_numel, kPrefetchLines * line);
  auto prefetch_row = [&](int64_t k) {
    const T* row = param + rows[k] * row_numel;
    for (int64_t j = 0; j < prefetched; j += line) {
      __builtin_prefetch(row + j, 1, kPrefetchLocality);
    }
  };
  for (int64_t k = begin; k < std::min(end, begin + kPrefetchAhead); ++k) prefetch_row(k);
  for (int64_t k = begin; k < end; ++k) {
    if (k + kPrefetchAhead < end) prefetch_row(k + kPrefetchAhead);
    const int64_t row = rows[k];
    if (!all_rows && (row < row_begin || row >= row_end)) continue;
    T* p = param + row * row_numel;
    const T* g = values + k * row_numel;
    for (int64_t j = 0; j < row_numel; ++j) p[j] = std::fma(alpha, g[j], p[j]);
  }
}

// The same loop where the CPU has FMA: std::fma becomes one instruction (elsewhere a call into
// the C library, which rounds the same way, once).
template <class T>
__attribute__((target("avx2,fma"))) void sgd_rows_fma(T* param, const T* values,
                                                      const int64_t* rows, int64_t begin,
                                                      int64_t end, int64_t row_numel, T alpha,
                                                      int64_t row_begin, int64_t row_end,
                                                      bool all_rows) {
  sgd_rows_body(param, values, rows, begin, end, row_numel, alpha, row_begin, row_end, all_rows);
}

// The kernels' "avx2" level (kernel_isa.h) is AVX2 with FMA. Asked of the CPU, not of the level
// set_kernel_isa may force: std::fma rounds the same with or without the instruction.
bool cpu_has_fma() {
  static const bool kHasFma = [] {
    const std::vector<std::string> isas = supported_kernel_isas();
    return std::find(isas.begin(), isas.end(), "avx2") != isas.end();
  }();
  return kHasFma;
}

}  // namespace

template <class T>
void sgd_rows(T* param, const T* values, const int64_t* rows, int64_t begin, int64_t end,
              int64_t row_numel, T alpha, int64_t row_begin, int64_t row_end, bool all_rows) {
  if (cpu_has_fma()) {
    sgd_rows_fma(param, values, rows, begin, end, row_numel, alpha, row_begin, row_end, all_rows);
  } else {
    sgd_rows_body(param, values, rows, begin, end, row_numel, alpha, row_begin, row_end, all_rows);
  }
}

template void sparse_adam_rows<float>(float*, float*, float*, const float*, const int64_t*, int64_t,
                                      int64_t, int64_t, float, float, float, float);
template void sparse_adam_rows<double>(double*, double*, double*, const double*, const int64_t*,
                                       int64_t, int64_t, int64_t, double, double, double, double);
template void adagrad_rows<float>(float*, float*, const float*, const int64_t*, int64_t, int64_t,
                                  int64_t, float, float);
template void adagrad_rows<double>(double*, double*, const double*, const int64_t*, int64_t,
                                   int64_t, int64_t, double, double);

template void sgd_rows<float>(float*, const float*, const int64_t*, int64_t, int64_t, int64_t,
                              float, int64_t, int64_t, bool);
template void sgd_rows<double>(double*, const double*, const int64_t*, int64_t, int64_t, int64_t,
                               double, int64_t, int64_t, bool);

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
