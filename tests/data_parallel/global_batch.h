#pragma once

// The data of the data-parallel tests: one global batch per iteration that every rank can
// build from a seed, each rank training on its own rows, and a single process on all of them.

#include <cstdint>

#include <torch/torch.h>

namespace distoptim {
namespace data_parallel {

/// Rows of the global batch each rank trains on.
constexpr int64_t kRowsPerRank = 4;

/// Inputs of 6 features and targets of 4 (float64) for `world_size` ranks; rank r trains on
/// rows [4r, 4r + 4).
struct Batch {
  at::Tensor x, y;
  Batch(int64_t seed, int world_size) {
    torch::manual_seed(seed);
    x = torch::randn({kRowsPerRank * world_size, 6}, torch::kFloat64);
    y = torch::randn({kRowsPerRank * world_size, 4}, torch::kFloat64);
  }
  at::Tensor local_x(int rank) const { return x.narrow(0, kRowsPerRank * rank, kRowsPerRank); }
  at::Tensor local_y(int rank) const { return y.narrow(0, kRowsPerRank * rank, kRowsPerRank); }
};

}  // namespace data_parallel
}  // namespace distoptim
