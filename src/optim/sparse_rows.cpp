#include "sparse_rows.h"

#include <cmath>

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

template void sparse_adam_rows<float>(float*, float*, float*, const float*, const int64_t*, int64_t,
                                      int64_t, int64_t, float, float, float, float);
template void sparse_adam_rows<double>(double*, double*, double*, const double*, const int64_t*,
                                       int64_t, int64_t, int64_t, double, double, double, double);
template void adagrad_rows<float>(float*, float*, const float*, const int64_t*, int64_t, int64_t,
                                  int64_t, float, float);
template void adagrad_rows<double>(double*, double*, const double*, const int64_t*, int64_t,
                                   int64_t, int64_t, double, double);

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
