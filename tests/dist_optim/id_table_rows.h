#pragma once

// What a collisionless table's shard holds, read on its owner by the tests of such tables.

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>

#include <distoptim/rpc/id_embedding_bag.h>
#include <distoptim/rpc/rref.h>

namespace distoptim {
namespace id_table_test {

/// On the shard's owner: the live ids among `ids`, ascending, the rows of the weight that hold
/// them, and those rows' values (copied). Each test registers it as an rpc function of its own.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> live_rows(
    rpc::RRef<rpc::IdEmbeddingShard> shard, const at::Tensor& ids) {
  const auto& local = shard.local_value();
  std::vector<int64_t> sorted(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> live, rows;
  for (int64_t id : sorted) {
    if (const int64_t row = local->row_of(id); row != 0) {
      live.push_back(id);
      rows.push_back(row);
    }
  }
  const at::Tensor row_index = at::tensor(rows, at::kLong);
  at::NoGradGuard no_grad;
  return {at::tensor(live, at::kLong), row_index, local->weight.index_select(0, row_index).clone()};
}

}  // namespace id_table_test
}  // namespace distoptim
