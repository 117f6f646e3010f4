#pragma once

// The click-through example's model, one model that every trainer trains:
//
//   raw ids [n, 26] --> one table shared by the 26 features, split over the parameter servers:
//                       a collisionless ShardedIdEmbeddingBag (each id a row of its own, up to
//                       `rows` live ids, the least recently used dropped first) by default, or
//                       a ShardedEmbeddingBag of `rows` rows the ids are hashed into (the
//                       hashing trick: ids share rows) --> 26 embeddings per sample, [n, 26 * dim]
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

/// Which table the ids go to.
enum class TableKind {
  kId,     // collisionless: rpc::ShardedIdEmbeddingBag
  kFixed,  // hashed into a fixed number of rows: rpc::ShardedEmbeddingBag
};

struct ModelOptions {
  std::vector<std::string> servers;  // the table's shards, one per server; the MLP on the first
  TableKind table = TableKind::kId;
  /// The table's rows: the bound on live ids (kId: rows / servers per server), or the rows the
  /// ids are hashed into (kFixed). The same parameter memory either way.
  int64_t rows = 1 << 20;
  int64_t dim = 32;
  int64_t seed = 0;
  /// kId: sightings of an id before it gets a row of its own.
  int64_t admit_after = 1;
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
  /// for a worker that hands them out itself (the first server under --elastic): the fixed
  /// table's shards (empty for kId), the collisionless table's (empty for kFixed), the table's
  /// shard_keys(), the MLP, its module_key(). The keys name the shards and the MLP across their
  /// owners' restarts, so that a handle made from references handed out after a server was
  /// restored binds to the server's next incarnation too.
  using References =
      std::tuple<std::vector<distoptim::rpc::RRef<distoptim::rpc::EmbeddingShard>>,
                 std::vector<distoptim::rpc::RRef<distoptim::rpc::IdEmbeddingShard>>,
                 std::vector<std::string>, distoptim::rpc::RRef<ClickMlp>, std::string>;
  References references() const;
  /// A handle on the model `references` name.
  static std::unique_ptr<ClickModel> from_references(const ModelOptions& options,
                                                     References references);

  /// ids [n, 26] (each feature's raw id), dense [n, 13] -> logits [n]. Recorded by distributed
  /// autograd inside a context; under at::NoGradGuard a plain evaluation.
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& dense);
  /// While one lives, the table is in eval mode (kId: lookups only read, so an evaluation admits
  /// no id, counts no sighting and keeps no row from eviction).
  class Evaluating {
   public:
    explicit Evaluating(ClickModel& model);
    ~Evaluating();
    Evaluating(const Evaluating&) = delete;
    Evaluating& operator=(const Evaluating&) = delete;

   private:
    ClickModel& model_;
  };

  /// The table's shards' weights, then the MLP's parameters: for the DistributedOptimizer.
  std::vector<distoptim::rpc::RRef<at::Tensor>> table_parameters() const;
  std::vector<distoptim::rpc::RRef<at::Tensor>> mlp_parameters() const;
  /// The table's and the MLP's handles (for snapshots and for binding to a server started
  /// again): the table among `fixed_tables()` (kFixed) or `id_tables()` (kId), the other empty.
  std::vector<distoptim::rpc::ShardedEmbeddingBag*> fixed_tables() const;
  std::vector<distoptim::rpc::ShardedIdEmbeddingBag*> id_tables() const;
  distoptim::rpc::RemoteModule<ClickMlp>& mlp() { return *mlp_; }
  /// The rows that hold an id now, over all servers (kId: the shards' live_rows counters, one
  /// call per server), or the table's rows (kFixed: every row is in use).
  int64_t live_rows() const;

 private:
  ClickModel(const ModelOptions& options, References references);

  ModelOptions options_;
  std::unique_ptr<distoptim::rpc::ShardedEmbeddingBag> fixed_table_;  // kFixed
  std::unique_ptr<distoptim::rpc::ShardedIdEmbeddingBag> id_table_;   // kId
  std::shared_ptr<distoptim::rpc::RemoteModule<ClickMlp>> mlp_;
};

}  // namespace click_through
