#pragma once

// A collisionless embedding table keyed by 64-bit ids, for id spaces that grow with the data
// (recommendation features): each server holds an id -> row map and gives an id a row of its own
// once the id has been seen admit_after times, drops rows not looked up for expire_after lookups,
// and at its bound on rows drops the least recently used first (src/rpc/id_rows.h).
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
// A row handed to a new id is noted for the owner's optimizer (rpc/detail/reassigned_rows.h),
// which resets that row of its state (Adagrad's sum, Adam's moments) before its next step of the
// table. What a step does to a row that changed hands between a backward and that step is not
// checked (the row's protection is that eviction takes the least recently used rows first).

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

namespace distoptim {
namespace rpc {

/// One server's shard of a collisionless table. Internal to the sharded table's handle, and
/// usable on its own in one process.
struct IdEmbeddingShard : torch::nn::Module {
  /// `capacity` rows at most (>= 1) of `dim` (>= 1) values of `dtype` (float32 or float64, as a
  /// c10::ScalarType's number); an id's row after its admit_after-th sighting (>= 1); rows not
  /// looked up for expire_after lookups of this shard dropped (0: never); at most max_pending ids
  /// counted towards admission (0: capacity). Throws c10::ValueError naming an argument out of
  /// range.
  IdEmbeddingShard(int64_t capacity, int64_t dim, int64_t dtype, int64_t seed, int64_t admit_after,
                   int64_t expire_after, int64_t max_pending);
  ~IdEmbeddingShard() override;

  /// The rows of `ids` (1-D int64, any values), [ids, dim], with the sparse gradient above. Each
  /// call is one tick of the shard's clock (expiry counts them). Rows are copied under an
  /// rpc::RowReadGuard, so no row is read half-updated by a step or half-initialized.
  at::Tensor forward(const at::Tensor& ids);

  /// The row that holds `id` in `weight` (1 and up), 0 when it has none: no sighting counted.
  int64_t row_of(int64_t id) const;
  /// The value a row handed to `id` starts at: [dim], the table's dtype.
  at::Tensor initial_row(int64_t id) const;
  /// Live rows, admitted, expired, evicted, lookups answered by the default row, ids counted
  /// towards admission: `<name>` -> count.
  std::map<std::string, int64_t> counters() const;

  /// [capacity + 1, dim]: row 0 the default row, then the rows ids hold.
  at::Tensor weight;

  /// Which row holds each id (opaque: src/rpc/id_rows.h); a lookup's backward keeps it.
  struct Rows;

 private:
  int64_t seed_;
  std::shared_ptr<Rows> rows_;
  std::atomic<int64_t> clock_{0};
};

}  // namespace rpc
}  // namespace distoptim
