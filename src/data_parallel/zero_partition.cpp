// ZeroRedundancyOptimizer's partition: which rank updates which parameter.
#include <algorithm>
#include <numeric>

#include "zero_impl.h"

namespace distoptim {
namespace data_parallel {

std::vector<std::vector<int64_t>> zero_partition(
    const std::vector<std::vector<int64_t>>& group_numels, int world_size) {
  TORCH_CHECK_VALUE(world_size >= 1, "zero_partition: world_size = ", world_size,
                    " must be at least 1");
  std::vector<int64_t> sizes(world_size, 0);
  std::vector<std::vector<int64_t>> partition(world_size);
  int64_t first = 0;
  for (const auto& numels : group_numels) {
    std::vector<int64_t> order(numels.size());
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return numels[a] > numels[b]; });
    std::vector<int> owner(numels.size());
    for (int64_t i : order) {
      TORCH_CHECK_VALUE(numels[i] >= 0, "zero_partition: parameter ", first + i, " has numel ",
                        numels[i]);
      const int rank =
          static_cast<int>(std::min_element(sizes.begin(), sizes.end()) - sizes.begin());
      owner[i] = rank;
      sizes[rank] += numels[i];
    }
    for (size_t i = 0; i < numels.size(); ++i) partition[owner[i]].push_back(first + i);
    first += static_cast<int64_t>(numels.size());
  }
  return partition;
}

namespace zero_detail {

// The rank owning each parameter (see zero_partition).
std::vector<int> sorted_greedy_owners(const std::vector<at::Tensor>& params,
                                      const std::vector<std::vector<int64_t>>& group_indices,
                                      int world_size) {
  // Groups hold consecutive indices of params, in order.
  std::vector<std::vector<int64_t>> group_numels;
  for (const auto& indices : group_indices) {
    std::vector<int64_t> numels;
    for (int64_t i : indices) numels.push_back(params[i].numel());
    group_numels.push_back(std::move(numels));
  }
  std::vector<int> owner(params.size(), -1);
  const auto partition = zero_partition(group_numels, world_size);
  for (int r = 0; r < world_size; ++r) {
    for (int64_t i : partition[r]) owner[i] = r;
  }
  return owner;
}

}  // namespace zero_detail
}  // namespace data_parallel
}  // namespace distoptim
