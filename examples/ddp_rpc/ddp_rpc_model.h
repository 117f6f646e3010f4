#pragma once

// The model of PyTorch's tutorial "Combining Distributed DataParallel with Distributed RPC
// Framework": an nn.EmbeddingBag on a parameter server, shared by every trainer through RPC, and
// on each trainer an nn.Linear replicated by DistributedDataParallel. Shared by the example
// (main.cpp) and the parity test against PyTorch (tests/dist_optim/ddp_rpc_parity_test.cpp).

#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include <distoptim/data_parallel.h>
#include <distoptim/rpc.h>

namespace ddp_rpc {

// The tutorial's sizes.
constexpr int64_t kNumEmbeddings = 100;
constexpr int64_t kEmbeddingDim = 16;
constexpr int64_t kOutFeatures = 8;

/// On the parameter server, before its RPC agent starts: the table every trainer's forward
/// looks up (EmbeddingBag, mode "sum"), with `weight` (kNumEmbeddings x kEmbeddingDim) as its
/// parameter. c10::ValueError for a weight of another shape, or a second call.
void serve_embedding(const at::Tensor& weight);
/// The served table's weight (the tensor the trainers' optimizer updates).
at::Tensor served_embedding_weight();

/// The tutorial's HybridModel on a trainer: the remote embedding lookup, then the local Linear
/// under DistributedDataParallel (constructing it is collective over `options.process_group`).
class HybridModel {
 public:
  HybridModel(std::string ps, torch::nn::Linear fc,
              distoptim::data_parallel::DistributedDataParallelOptions options = {});

  /// The forward pass: call it inside a distributed autograd context, whose backward pass then
  /// reaches the embedding on the server and averages the Linear's gradients over the trainers.
  at::Tensor forward(const at::Tensor& indices, const at::Tensor& offsets);

  /// References to every parameter (the server's embedding weight, then this trainer's Linear
  /// weight and bias), for a DistributedOptimizer.
  std::vector<distoptim::rpc::RRef<at::Tensor>> parameter_rrefs();

  torch::nn::Linear& fc() { return ddp_.module(); }

 private:
  std::string ps_;
  distoptim::data_parallel::DistributedDataParallel<torch::nn::Linear> ddp_;
};

/// One batch of the tutorial's get_next_batch: 20 to 50 indices cut into bags of 1 to 10, and a
/// class in [0, kOutFeatures) per bag.
struct Batch {
  at::Tensor indices;
  at::Tensor offsets;
  at::Tensor target;
};
Batch random_batch(at::Generator& generator);

}  // namespace ddp_rpc
