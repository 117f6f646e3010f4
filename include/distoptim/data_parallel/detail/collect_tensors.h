#pragma once

// Internal: the tensors in a module's output, which DistributedDataParallel::forward
// (distributed_data_parallel.h) hands to GradientSync::after_forward. Not part of the public API;
// names may change.

#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>

namespace distoptim {
namespace data_parallel {
namespace detail {

/// Appends the tensors of a module's output to `out`: a tensor, a vector of tensors, or a tuple
/// of these; any other output holds none.
inline void collect_tensors(const at::Tensor& t, std::vector<at::Tensor>& out) { out.push_back(t); }
inline void collect_tensors(const std::vector<at::Tensor>& ts, std::vector<at::Tensor>& out) {
  out.insert(out.end(), ts.begin(), ts.end());
}
template <typename... T>
void collect_tensors(const std::tuple<T...>& t, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... items) { (collect_tensors(items, out), ...); }, t);
}
template <typename T>
void collect_tensors(const T&, std::vector<at::Tensor>&) {}

}  // namespace detail
}  // namespace data_parallel
}  // namespace distoptim
