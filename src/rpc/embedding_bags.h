#pragma once

// What the sharded embedding bags' handles (sharded_embedding_bag.h, id_embedding_bag.h) share
// on the caller's side: their inputs read as bags, and the rows the shards return put back in
// the order of the ids and pooled with LibTorch's embedding_bag, so that the result is bit for
// bit an unsharded EmbeddingBag's with the same rows.

#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/options/embedding.h>

#include <distoptim/rpc/api.h>

namespace distoptim {
namespace rpc {
namespace detail {

struct Bags {
  at::Tensor ids;      // 1-D int64
  at::Tensor offsets;  // each bag's start
};

/// `input`: 1-D ids with `offsets`, or 2-D [bags, ids per bag] without. `who` names the caller in
/// errors: c10::ValueError for inputs of the wrong shape or dtype.
Bags read_bags(const char* who, const at::Tensor& input, const at::Tensor& offsets);

/// Pools the rows shards returned: `replies[s]` holds the rows of the ids at `positions[s]` (of
/// `num_ids`), each a [ids, dim] tensor of `dtype`.
at::Tensor pool_replies(std::vector<RpcFuture<at::Tensor>>& replies,
                        const std::vector<at::Tensor>& positions, int64_t num_ids, int64_t dim,
                        c10::ScalarType dtype, const Bags& bags,
                        const torch::nn::EmbeddingBagMode& mode,
                        const at::Tensor& per_sample_weights, bool include_last_offset);

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
