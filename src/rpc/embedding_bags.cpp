// The sharded embedding bags' shared caller side (embedding_bags.h).

#include "embedding_bags.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace distoptim {
namespace rpc {
namespace detail {

namespace {

int64_t pooling_mode(const torch::nn::EmbeddingBagMode& mode) {
  if (c10::get_if<torch::enumtype::kSum>(&mode)) return 0;
  if (c10::get_if<torch::enumtype::kMean>(&mode)) return 1;
  return 2;
}

}  // namespace

Bags read_bags(const char* who, const at::Tensor& input, const at::Tensor& offsets) {
  TORCH_CHECK_VALUE(input.scalar_type() == at::kLong || input.scalar_type() == at::kInt, who,
                    ": input must hold int64 or int32 ids, got ", input.scalar_type());
  Bags bags{input.to(at::kLong), offsets};
  if (bags.ids.dim() == 2) {
    TORCH_CHECK_VALUE(!offsets.defined(), who,
                      ": a 2-D input takes no offsets (each row is a bag)");
    bags.offsets =
        at::arange(0, bags.ids.numel(), std::max<int64_t>(bags.ids.size(1), 1), at::kLong);
    bags.ids = bags.ids.reshape({-1});
  } else {
    TORCH_CHECK_VALUE(bags.ids.dim() == 1 && offsets.defined() && offsets.dim() == 1, who,
                      ": a 1-D input needs 1-D offsets (got input of shape ", input.sizes(), ")");
  }
  return bags;
}

at::Tensor pool_replies(std::vector<RpcFuture<at::Tensor>>& replies,
                        const std::vector<at::Tensor>& positions, int64_t num_ids, int64_t dim,
                        c10::ScalarType dtype, const Bags& bags,
                        const torch::nn::EmbeddingBagMode& mode,
                        const at::Tensor& per_sample_weights, bool include_last_offset) {
  at::Tensor rows;
  if (replies.empty()) {
    rows = at::zeros({0, dim}, at::TensorOptions().dtype(dtype));
  } else {
    std::vector<at::Tensor> parts;
    for (auto& reply : replies) parts.push_back(reply.wait());
    // The rows in the order of the ids: exact copies both ways (no sums), so pooling them below
    // adds exactly what an unsharded table's embedding_bag adds, in the same order.
    const at::Tensor order = at::cat(positions);
    at::Tensor inverse = at::empty_like(order);
    inverse.index_put_({order}, at::arange(num_ids, at::kLong));
    rows = at::cat(parts).index_select(0, inverse);
  }
  return std::get<0>(at::embedding_bag(rows, at::arange(num_ids, at::kLong), bags.offsets,
                                       /*scale_grad_by_freq=*/false, pooling_mode(mode),
                                       /*sparse=*/false, per_sample_weights, include_last_offset));
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
