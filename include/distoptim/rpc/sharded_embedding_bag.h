#pragma once

// ShardedEmbeddingBag: an EmbeddingBag whose rows live on several workers (parameter servers),
// split by contiguous row ranges (TorchRec's row-wise sharding), for tables too large for one
// process.
//
//   rpc::ShardedEmbeddingBag table(rpc::ShardedEmbeddingBagOptions(10'000'000, 32, {"ps0", "ps1"})
//                                      .mode(torch::kSum));
//   dist_autograd::ContextGuard context;
//   at::Tensor pooled = table.forward(ids, offsets);   // [bags, 32]
//   ...backward...
//   DistributedOptimizer optimizer("sparse_adam", table.remote_parameters(), {{"lr", 0.01}});
//
// Forward sends each shard only the ids in its range, all shards at once (one call per shard with
// any ids), gathers the rows they return in the order of the ids and pools them here with
// LibTorch's embedding_bag, so the result is bit for bit an unsharded EmbeddingBag's with the same
// rows. Inside a distributed autograd context the calls are recorded, and backward sends each shard
// only its rows' gradient: on the shard it arrives as a sparse COO gradient of the shard's weight
// with one entry per looked-up id, as an unsharded sparse EmbeddingBag's gradient restricted to
// those rows, so every optimizer that takes sparse gradients (sgd, adagrad, sparse_adam) steps the
// shards as it would step the whole table.
//
// Why ranges: hashed categorical ids are uniform already, so ranges balance as well as hashing
// would, and a range maps to a shard with one comparison, keeps a shard's rows contiguous, and
// makes a table re-split into another number of shards a matter of slicing.
//
// Rows start as LibTorch's EmbeddingBag starts them (normal(0, 1)), drawn per block of rows from
// `seed`, so the initial table is the same whatever the number of shards.

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/enum.h>
#include <torch/nn/module.h>
#include <torch/nn/options/embedding.h>

#include <distoptim/rpc/remote_module.h>

namespace distoptim {
namespace rpc {

struct ShardedEmbeddingBagOptions {
  ShardedEmbeddingBagOptions(int64_t num_embeddings, int64_t embedding_dim,
                             std::vector<std::string> workers)
      : num_embeddings_(num_embeddings),
        embedding_dim_(embedding_dim),
        workers_(std::move(workers)) {}
  /// Rows of the whole table.
  TORCH_ARG(int64_t, num_embeddings);
  TORCH_ARG(int64_t, embedding_dim);
  /// The shards' owners, one shard per entry (a worker may hold several).
  TORCH_ARG(std::vector<std::string>, workers);
  /// How a bag's rows are pooled, as LibTorch's EmbeddingBag (default kMean, as there).
  TORCH_ARG(torch::nn::EmbeddingBagMode, mode) = torch::kMean;
  /// The last offset is the end of the last bag (as LibTorch's option).
  TORCH_ARG(bool, include_last_offset) = false;
  TORCH_ARG(c10::ScalarType, dtype) = c10::ScalarType::Float;
  /// The initial rows' seed.
  TORCH_ARG(int64_t, seed) = 0;
};

/// One shard on its owner: rows [first_row, first_row + rows) of the table. Internal to
/// ShardedEmbeddingBag (registered in every process that runs the rpc layer).
struct EmbeddingShard : torch::nn::Module {
  /// `initial`: 1, the rows a new table starts with (from the seed); 0, zeros (rows that are
  /// loaded at once, from a backup's copy: drawing them would be wasted).
  EmbeddingShard(int64_t first_row, int64_t rows, int64_t dim, int64_t dtype, int64_t seed,
                 int64_t initial);
  /// The rows of `local_ids` (shard-relative), with a sparse gradient (LibTorch's sparse
  /// embedding's). The rows are copied under an rpc::RowReadGuard, so a lookup never carries a
  /// row half-updated by a trainer's step; the backward does not keep the weight, so steps
  /// between a trainer's forward and backward (other trainers') are no error.
  at::Tensor forward(const at::Tensor& local_ids);
  /// Replaces the rows with `rows` (the weight's shape and dtype), under an
  /// rpc::InPlaceUpdateGuard. Throws c10::ValueError naming the shapes, changing nothing.
  void load_rows(const at::Tensor& rows);
  /// The table's rows this shard holds: {first, end}.
  std::vector<int64_t> row_range() const { return {first_row_, first_row_ + weight.size(0)}; }
  at::Tensor weight;

 private:
  int64_t first_row_;
};

class ShardedEmbeddingBag : public torch::nn::Module {
 public:
  /// Creates every shard on its owner (asynchronously, as RemoteModule). Throws c10::ValueError
  /// for sizes below 1, no workers, or more shards than rows.
  explicit ShardedEmbeddingBag(const ShardedEmbeddingBagOptions& options);
  /// A second handle on a table that exists (RemoteModule's init_from_module_rref, for every
  /// shard): `shards` are another handle's shard_module_rrefs(), `options` the options it was
  /// built with, so several trainers look up and train one table. `shard_keys` are that handle's
  /// shard_keys(), which a shard made anew after its owner was lost keeps (dist_optim/recovery.h):
  /// give them with the references, so that this handle too binds to the shard's next
  /// incarnation; empty, each shard's key is its reference's id (right until a shard is made
  /// anew). Each shard's owner is its reference's (the worker options.workers() names for it, or
  /// a backup that took it over: dist_optim/recovery.h). Creates nothing; asks each shard's
  /// owner which rows it holds. Throws c10::ValueError when the number of shards or keys differs
  /// from options.workers()', a shard is empty or holds other rows than the options give it, or
  /// a key is empty.
  ShardedEmbeddingBag(const ShardedEmbeddingBagOptions& options,
                      std::vector<RRef<EmbeddingShard>> shards,
                      std::vector<std::string> shard_keys = {});

  /// `input`: 1-D ids with `offsets` (each bag's start), or 2-D [bags, ids per bag] without.
  /// `per_sample_weights` as LibTorch's (sum mode only). Returns [bags, embedding_dim].
  /// Errors: c10::IndexError naming an id outside [0, num_embeddings); c10::ValueError for inputs
  /// of the wrong shape or dtype; a shard's failure as RemoteError naming its owner.
  at::Tensor forward(const at::Tensor& input, const at::Tensor& offsets = {},
                     const at::Tensor& per_sample_weights = {});

  /// One RRef per shard, to its weight, in shard order: for the DistributedOptimizer. The same
  /// references on every call (fetched from each shard's owner once, and again once the shard is
  /// rebound), so that they name the table's parameters in an optimizer built from them.
  std::vector<RRef<at::Tensor>> remote_parameters() const;
  /// One RRef per shard, to the shard module, in shard order: to send to another worker, which
  /// builds a handle on the same table from them.
  std::vector<RRef<EmbeddingShard>> shard_module_rrefs() const;
  /// The whole table, [num_embeddings, embedding_dim], gathered from the shards (each copied
  /// whole, between steps of its rows). Errors: a shard's failure as RemoteError naming its owner.
  at::Tensor weight() const;
  /// Replaces every row with `weight`'s ([num_embeddings, embedding_dim], the table's dtype): each
  /// shard gets its range, all at once. Throws c10::ValueError naming the shape or dtype before
  /// anything changes; a shard's failure (RemoteError naming its owner) leaves the others loaded.
  void load_weight(const at::Tensor& weight);
  /// The rows shard `shard` holds: [first, end).
  std::pair<int64_t, int64_t> shard_rows(size_t shard) const;
  size_t num_shards() const { return shards_.size(); }
  const ShardedEmbeddingBagOptions& options() const { return options_; }

  // After a shard's owner died and was started again under its name (dist_optim/recovery.h):
  /// A name of shard `shard` that every handle on this table, on every worker, gives: the id of
  /// the reference to its first module. A rebound shard keeps it.
  const std::string& shard_key(size_t shard) const;
  /// Every shard's shard_key, in shard order: to send with shard_module_rrefs().
  const std::vector<std::string>& shard_keys() const { return keys_; }
  /// The worker that holds shard `shard` now: the one options.workers() names for it until a
  /// backup takes it over (dist_optim/recovery.h, hot_standby).
  const std::string& shard_owner(size_t shard) const;
  /// Creates shard `shard` anew on `worker` (empty: its current owner), its rows as a new
  /// table's (from the seed; zeros without `initial_rows`, for rows loaded at once), and returns
  /// the reference to it; the handle is not changed.
  RRef<EmbeddingShard> make_shard(size_t shard, const std::string& worker = {},
                                  bool initial_rows = true) const;
  /// Binds shard `shard` to `module`, a shard of the same rows (make_shard's, or another
  /// handle's after it); its owner becomes the shard's owner. Throws c10::ValueError for an
  /// empty reference, c10::IndexError for a shard out of range, changing nothing. Not while a
  /// forward of this handle runs.
  void rebind_shard(size_t shard, RRef<EmbeddingShard> module);

 private:
  ShardedEmbeddingBagOptions options_;
  std::vector<int64_t> first_rows_;  // per shard, then the table's end
  std::vector<std::shared_ptr<RemoteModule<EmbeddingShard>>> shards_;
  std::vector<std::string> keys_;  // per shard: shard_key
  // Per shard: its weight's reference once fetched (remote_parameters).
  mutable std::mutex weights_mutex_;
  mutable std::vector<RRef<at::Tensor>> weights_;

  /// Checks the options and computes first_rows_.
  void check_and_split();
  /// Fills keys_ with `keys`, or from the shards' references when empty; sizes weights_.
  void name_shards(std::vector<std::string> keys);
};

}  // namespace rpc
}  // namespace distoptim
