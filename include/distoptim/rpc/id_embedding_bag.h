#pragma once

// A collisionless embedding table keyed by 64-bit ids, for id spaces that grow with the data
// (recommendation features): each server holds an id -> row map and gives an id a row of its own
// once the id has been seen admit_after times, drops rows not looked up for expire_after lookups
// (or expire_after_seconds seconds), and at its bound on rows drops the least recently used first
// (src/rpc/id_rows.h).
//
//   rpc::ShardedIdEmbeddingBag table(
//       rpc::ShardedIdEmbeddingBagOptions(1'000'000, 32, {"ps0", "ps1"}).admit_after(2));
//   dist_autograd::ContextGuard context;
//   at::Tensor pooled = table.forward(raw_ids, offsets);   // any int64 ids; [bags, 32]
//   ...backward...
//   DistributedOptimizer optimizer("adagrad", table.remote_parameters(), {{"lr", 0.05}});
//
// ShardedIdEmbeddingBag is the handle, shaped like ShardedEmbeddingBag: an id's server is
// jump consistent hashing's bucket of the id (Lamping and Veach), so a table of N + 1 servers
// places 1/(N + 1) of the ids on the new one and leaves every other id where it was; forward
// sends each server only its ids, all servers at once, and pools the rows here as LibTorch's
// EmbeddingBag would.
//
// IdEmbeddingShard is one server's part: storage for `capacity` rows plus row 0, the shared
// default row (zeros), which every id without a row of its own reads and which no gradient moves.
// A row handed to an id starts at the id's initial value, a function of the id and the seed
// alone (normal(0, 1), drawn by a counter-based generator keyed by the seed at the id's own
// subsequence), so a table gives the same model on any number of servers and after any eviction.
//
// Gradients: a lookup's backward is a sparse COO gradient of the shard's weight with one entry
// per looked-up id whose row, at backward time, is still the one its lookup read: an id that read
// the default row, or whose row was since dropped or handed to another id, contributes nothing.
// A row handed to a new id is noted for every optimizer over the table on its owner (one per
// trainer: rpc/detail/reassigned_rows.h), each of which resets that row of its own state
// (Adagrad's sum, Adam's moments) before its next step of the table. A step leaves out of a
// gradient the rows handed to new ids since the backward pass that moved them began on the owner
// (another trainer's lookup may evict one meanwhile): dist_autograd's contexts keep each pass's
// position in the hand-outs for the DistributedOptimizer's step (rpc/detail/reassigned_rows.h).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/enum.h>
#include <torch/nn/module.h>
#include <torch/nn/options/embedding.h>

#include <distoptim/rpc/remote_module.h>

namespace distoptim {
namespace rpc {

/// One server's shard of a collisionless table. Internal to the sharded table's handle, and
/// usable on its own in one process.
struct IdEmbeddingShard : torch::nn::Module {
  /// `capacity` rows at most (>= 1) of `dim` (>= 1) values of `dtype` (float32 or float64, as a
  /// c10::ScalarType's number); an id's row after its admit_after-th sighting (>= 1); rows not
  /// looked up for expire_after lookups of this shard dropped (0: never), or, instead, for
  /// expire_after_seconds seconds (0: never; at most one of the two); at most max_pending ids
  /// counted towards admission (0: capacity). Throws c10::ValueError naming an argument out of
  /// range.
  IdEmbeddingShard(int64_t capacity, int64_t dim, int64_t dtype, int64_t seed, int64_t admit_after,
                   int64_t expire_after, int64_t max_pending, double expire_after_seconds = 0);
  ~IdEmbeddingShard() override;

  /// The rows of `ids` (1-D int64, any values), [ids, dim], with the sparse gradient above. Each
  /// call is one tick of the shard's clock (expiry counts them). Rows are copied under an
  /// rpc::RowReadGuard, so no row is read half-updated by a step or half-initialized.
  at::Tensor forward(const at::Tensor& ids);

  /// The rows of `ids` as they are, [ids, dim], without a gradient: an id without a row reads
  /// the default row. No sighting counted, no row's recency moved, no tick of the clock: an
  /// evaluation's lookup (ShardedIdEmbeddingBag in eval mode). Under an rpc::RowReadGuard.
  at::Tensor read(const at::Tensor& ids) const;
  /// The row that holds `id` in `weight` (1 and up), 0 when it has none: no sighting counted.
  int64_t row_of(int64_t id) const;
  /// The value a row handed to `id` starts at: [dim], the table's dtype.
  at::Tensor initial_row(int64_t id) const;
  /// Live rows, admitted, expired, evicted, lookups answered by the default row, ids counted
  /// towards admission: `<name>` -> count.
  std::map<std::string, int64_t> counters() const;

  /// For snapshots (dist_optim/snapshot.h): calls `read(ids, rows)` with the ids that hold rows,
  /// ascending (1-D int64), and their rows of `weight` (1 and up), while no id gains or loses a
  /// row (lookups of ids with rows go on).
  void read_live_rows(
      const std::function<void(const at::Tensor& ids, const at::Tensor& rows)>& read) const;
  /// For a load of one optimizer's state alone (dist_optim/recovery.h: a trainer that did not
  /// restore the shard): calls `read(rows)` with the rows of `ids` (1-D int64) in `weight`, 0 for
  /// an id without one, while no id gains or loses a row (lookups of ids with rows go on).
  void read_rows_of(const at::Tensor& ids,
                    const std::function<void(const at::Tensor& rows)>& read) const;
  /// For a snapshot's load: drops every row and every id counted towards admission, gives each of
  /// `ids` (1-D int64, distinct, at most the capacity) a row as if just looked up, and calls
  /// `write(rows)` with their rows of `weight` while no lookup runs: the caller writes the rows'
  /// values and state (and must not throw). c10::ValueError, changing nothing, for ids that are
  /// more than the capacity or repeat.
  void replace_rows(const at::Tensor& ids,
                    const std::function<void(const at::Tensor& rows)>& write);
  /// The bound on rows.
  int64_t capacity() const { return weight.size(0) - 1; }

  /// [capacity + 1, dim]: row 0 the default row, then the rows ids hold.
  at::Tensor weight;

  /// Which row holds each id (opaque: src/rpc/id_rows.h); a lookup's backward keeps it.
  struct Rows;

 private:
  int64_t seed_;
  std::shared_ptr<Rows> rows_;
  // The shard's clock: one tick per lookup, or, when rows expire after seconds, microseconds
  // since the shard was made (and still one tick at least per lookup: the least recently used
  // rows stay ordered by lookup).
  std::atomic<int64_t> clock_{0};
  bool clock_in_microseconds_ = false;
  std::chrono::steady_clock::time_point made_ = std::chrono::steady_clock::now();

  int64_t tick();
};

struct ShardedIdEmbeddingBagOptions {
  ShardedIdEmbeddingBagOptions(int64_t rows_per_shard, int64_t embedding_dim,
                               std::vector<std::string> workers)
      : rows_per_shard_(rows_per_shard),
        embedding_dim_(embedding_dim),
        workers_(std::move(workers)) {}
  /// Each server's bound on rows (IdEmbeddingShard's capacity).
  TORCH_ARG(int64_t, rows_per_shard);
  TORCH_ARG(int64_t, embedding_dim);
  /// The shards' owners, one shard per entry (a worker may hold several).
  TORCH_ARG(std::vector<std::string>, workers);
  /// Sightings of an id before it gets a row (1: at once).
  TORCH_ARG(int64_t, admit_after) = 1;
  /// A row not looked up for this many lookups of its shard is dropped (0: never).
  TORCH_ARG(int64_t, expire_after) = 0;
  /// Or: a row not looked up for this many seconds is dropped (0: never; at most one of the two).
  TORCH_ARG(double, expire_after_seconds) = 0;
  /// Ids each shard counts towards admission at most (0: rows_per_shard).
  TORCH_ARG(int64_t, max_pending) = 0;
  /// How a bag's rows are pooled, as LibTorch's EmbeddingBag (default kMean, as there).
  TORCH_ARG(torch::nn::EmbeddingBagMode, mode) = torch::kMean;
  /// The last offset is the end of the last bag (as LibTorch's option).
  TORCH_ARG(bool, include_last_offset) = false;
  TORCH_ARG(c10::ScalarType, dtype) = c10::ScalarType::Float;
  /// The initial rows' seed.
  TORCH_ARG(int64_t, seed) = 0;
};

class ShardedIdEmbeddingBag : public torch::nn::Module {
 public:
  /// Creates every shard on its owner. Throws c10::ValueError naming an option out of range
  /// (before anything is created) or no workers.
  explicit ShardedIdEmbeddingBag(const ShardedIdEmbeddingBagOptions& options);
  /// A second handle on a table that exists: `shards` are another handle's shard_module_rrefs(),
  /// `options` the options it was built with, `shard_keys` that handle's shard_keys() (empty:
  /// each shard's reference's id, right until a shard is made anew; as ShardedEmbeddingBag's).
  /// Creates nothing. Throws c10::ValueError when the number of shards or keys differs from
  /// options.workers()', a reference is empty or a key is empty.
  ShardedIdEmbeddingBag(const ShardedIdEmbeddingBagOptions& options,
                        std::vector<RRef<IdEmbeddingShard>> shards,
                        std::vector<std::string> shard_keys = {});

  /// `input`: 1-D int64 (or int32) ids, any values, with `offsets` (each bag's start), or 2-D
  /// [bags, ids per bag] without. `per_sample_weights` as LibTorch's (sum mode only). Returns
  /// [bags, embedding_dim]. Errors: c10::ValueError for inputs of the wrong shape or dtype; a
  /// shard's failure as RemoteError naming its owner. In eval mode (`eval()`, as any LibTorch
  /// module) a lookup only reads (IdEmbeddingShard::read): an evaluation admits no id, counts no
  /// sighting and keeps no row from expiry or eviction; its result has no gradient.
  at::Tensor forward(const at::Tensor& input, const at::Tensor& offsets = {},
                     const at::Tensor& per_sample_weights = {});

  /// The shard that holds `id`: its jump consistent hash over num_shards() buckets.
  size_t shard_of(int64_t id) const;
  /// The shard that holds `id` in a table of `num_shards` (>= 1) shards.
  static size_t shard_of(int64_t id, size_t num_shards);
  /// One RRef per shard, to its weight, in shard order: for the DistributedOptimizer. The same
  /// references on every call.
  std::vector<RRef<at::Tensor>> remote_parameters() const;
  /// One RRef per shard, to the shard module, in shard order: for another worker's handle.
  std::vector<RRef<IdEmbeddingShard>> shard_module_rrefs() const;
  /// Each shard's IdEmbeddingShard::counters(), in shard order.
  std::vector<std::map<std::string, int64_t>> shard_counters() const;
  size_t num_shards() const { return shards_.size(); }
  const ShardedIdEmbeddingBagOptions& options() const { return options_; }

  // After a shard's owner died and was started again under its name (dist_optim/recovery.h), as
  // ShardedEmbeddingBag's:
  /// A name of shard `shard` that every handle on this table gives: the id of the reference to
  /// its first module, kept when the shard is rebound. c10::IndexError for a shard out of range.
  const std::string& shard_key(size_t shard) const;
  /// Every shard's shard_key, in shard order: to send with shard_module_rrefs().
  const std::vector<std::string>& shard_keys() const { return keys_; }
  /// The worker that holds shard `shard` now.
  const std::string& shard_owner(size_t shard) const;
  /// Creates shard `shard` anew, empty (no id holds a row), on `worker` (empty: its current
  /// owner) and returns the reference to it; the handle is not changed.
  RRef<IdEmbeddingShard> make_shard(size_t shard, const std::string& worker = {}) const;
  /// Binds shard `shard` to `module` (make_shard's, or another handle's after it); its owner
  /// becomes the shard's owner. c10::ValueError for an empty reference, c10::IndexError for a
  /// shard out of range, changing nothing. Not while a forward of this handle runs.
  void rebind_shard(size_t shard, RRef<IdEmbeddingShard> module);

 private:
  ShardedIdEmbeddingBagOptions options_;
  std::vector<std::shared_ptr<RemoteModule<IdEmbeddingShard>>> shards_;
  std::vector<std::string> keys_;  // per shard: shard_key
  mutable std::mutex weights_mutex_;
  mutable std::vector<RRef<at::Tensor>> weights_;  // per shard, once fetched

  void check_options() const;
  void check_shard(size_t shard, const char* caller) const;
};

}  // namespace rpc
}  // namespace distoptim
