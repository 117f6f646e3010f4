#pragma once

// The click-through example's model, one model that every trainer trains:
//
//   ids [n, 26] --hashed--> one ShardedEmbeddingBag (rows x dim, rows split over the parameter
//                           servers) --> 26 embeddings per sample, concatenated [n, 26 * dim]
//   dense [n, 13] ------------------------------------------------------------+
//                                                    ClickMlp on the first server (a RemoteModule):
//                                                    concat -> 256 -> ReLU -> 64 -> ReLU -> 1 logit
//
// The first trainer creates the table's shards and the MLP; every other trainer receives their
// RRefs (share / receive below) and builds handles on the same objects, so all trainers read and
// update one set of parameters, as in PyTorch's parameter-server tutorials.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <distoptim/rpc.h>

namespace click_through {

/// On a parameter server: the dense part of the model, from the embeddings and the dense
/// features to the logit.
struct ClickMlp : torch::nn::Module {
  ClickMlp(int64_t embedding_width, int64_t dense, int64_t seed);
  /// embeddings [n, embedding_width], dense [n, dense] -> logits [n].
  at::Tensor forward(at::Tensor embeddings, at::Tensor dense);

  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, out{nullptr};
};

struct ModelOptions {
  std::vector<std::string> servers;  // the table's shards, one per server; the MLP on the first
  int64_t rows = 1 << 20;
  int64_t dim = 32;
  int64_t seed = 0;
};

/// A trainer's handle on the model.
class ClickModel {
 public:
  /// Creates the model: the table's shards on the servers and the MLP on the first one. Waits
  /// until they exist.
  explicit ClickModel(const ModelOptions& options);
  /// A handle on the model another worker created and shared: waits up to `timeout` for it.
  static std::unique_ptr<ClickModel> receive(const ModelOptions& options,
                                             std::chrono::milliseconds timeout);
  /// Sends this model's references to worker `trainer`, whose receive() takes them.
  void share(const std::string& trainer) const;

  /// The references of the table's shards and of the MLP with their keys (what share() sends),
  /// for a worker that hands them out itself (the first server under --elastic): the shards, the
  /// table's shard_keys(), the MLP, its module_key(). The keys name the shards and the MLP across
  /// their owners' restarts, so that a handle made from references handed out after a server
  /// was restored binds to the server's next incarnation too.
  using References =
      std::tuple<std::vector<distoptim::rpc::RRef<distoptim::rpc::EmbeddingShard>>,
                 std::vector<std::string>, distoptim::rpc::RRef<ClickMlp>, std::string>;
  References references() const;
  /// A handle on the model `references` name.
  static std::unique_ptr<ClickModel> from_references(const ModelOptions& options,
                                                     References references);

  /// ids [n, 26] (each feature's raw id), dense [n, 13] -> logits [n]. Recorded by distributed
  /// autograd inside a context; under at::NoGradGuard a plain evaluation.
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& dense);

  /// The table's shards' weights, then the MLP's parameters: for the DistributedOptimizer.
  std::vector<distoptim::rpc::RRef<at::Tensor>> table_parameters() const;
  std::vector<distoptim::rpc::RRef<at::Tensor>> mlp_parameters() const;
  /// The table's and the MLP's handles (for snapshots and for binding to a server started
  /// again).
  distoptim::rpc::ShardedEmbeddingBag& table() { return *table_; }
  distoptim::rpc::RemoteModule<ClickMlp>& mlp() { return *mlp_; }

 private:
  ClickModel(const ModelOptions& options, References references);

  ModelOptions options_;
  std::unique_ptr<distoptim::rpc::ShardedEmbeddingBag> table_;
  std::shared_ptr<distoptim::rpc::RemoteModule<ClickMlp>> mlp_;
};

}  // namespace click_through
