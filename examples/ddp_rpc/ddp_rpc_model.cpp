#include "ddp_rpc_model.h"

#include <memory>
#include <mutex>
#include <utility>

#include <c10/util/Exception.h>
#include <torch/nn/modules/embedding.h>

namespace ddp_rpc {

namespace {

using distoptim::rpc::RRef;

struct Served {
  std::mutex mutex;
  torch::nn::EmbeddingBag table{nullptr};  // guarded by mutex until set, constant after
};

Served& served() {
  static Served* const kInstance = new Served();  // never destroyed: RPC threads may outlive main
  return *kInstance;
}

torch::nn::EmbeddingBag table_or_throw() {
  std::lock_guard<std::mutex> lock(served().mutex);
  TORCH_CHECK(!served().table.is_empty(),
              "ddp_rpc: this worker serves no embedding (serve_embedding was not called)");
  return served().table;
}

at::Tensor embedding_forward(at::Tensor indices, at::Tensor offsets) {
  return table_or_throw()->forward(indices, offsets);
}

std::vector<RRef<at::Tensor>> embedding_parameters() {
  std::vector<RRef<at::Tensor>> rrefs;
  for (const at::Tensor& param : table_or_throw()->parameters()) rrefs.emplace_back(param);
  return rrefs;
}

DISTOPTIM_RPC_FUNCTION("ddp_rpc.embedding_forward", embedding_forward);
DISTOPTIM_RPC_FUNCTION("ddp_rpc.embedding_parameters", embedding_parameters);

}  // namespace

void serve_embedding(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.defined() && weight.dim() == 2 && weight.size(0) == kNumEmbeddings &&
                        weight.size(1) == kEmbeddingDim,
                    "ddp_rpc::serve_embedding: weight has shape ",
                    weight.defined() ? weight.sizes() : at::IntArrayRef{}, "; expected [",
                    kNumEmbeddings, ", ", kEmbeddingDim, "]");
  std::lock_guard<std::mutex> lock(served().mutex);
  TORCH_CHECK_VALUE(served().table.is_empty(), "ddp_rpc::serve_embedding: called twice");
  torch::nn::EmbeddingBag table(
      torch::nn::EmbeddingBagOptions(kNumEmbeddings, kEmbeddingDim).mode(torch::kSum));
  table->to(weight.scalar_type());
  {
    at::NoGradGuard no_grad;
    table->weight.copy_(weight);
  }
  served().table = std::move(table);
}

at::Tensor served_embedding_weight() { return table_or_throw()->weight; }

HybridModel::HybridModel(std::string ps, torch::nn::Linear fc,
                         distoptim::data_parallel::DistributedDataParallelOptions options)
    : ps_(std::move(ps)), ddp_(std::move(fc), std::move(options)) {}

at::Tensor HybridModel::forward(const at::Tensor& indices, const at::Tensor& offsets) {
  const at::Tensor looked_up = distoptim::rpc::rpc_sync<at::Tensor>(
      ps_, "ddp_rpc.embedding_forward", std::tuple{indices, offsets});
  return ddp_.forward(looked_up);
}

std::vector<RRef<at::Tensor>> HybridModel::parameter_rrefs() {
  std::vector<RRef<at::Tensor>> params =
      distoptim::rpc::rpc_sync<std::vector<RRef<at::Tensor>>>(ps_, "ddp_rpc.embedding_parameters");
  for (const at::Tensor& param : ddp_.module()->parameters()) params.emplace_back(param);
  return params;
}

Batch random_batch(at::Generator& generator) {
  auto draw = [&](int64_t low, int64_t high) {  // in [low, high)
    return at::randint(low, high, {1}, generator).item<int64_t>();
  };
  const int64_t num_indices = draw(20, 51);
  Batch batch;
  batch.indices = at::randint(0, kNumEmbeddings, {num_indices}, generator);
  std::vector<int64_t> offsets;
  for (int64_t start = 0; start < num_indices; start += draw(1, 11)) offsets.push_back(start);
  batch.offsets = at::tensor(offsets);
  batch.target = at::randint(0, kOutFeatures, {static_cast<int64_t>(offsets.size())}, generator);
  return batch;
}

}  // namespace ddp_rpc
