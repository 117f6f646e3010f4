#pragma once

// What saving and loading a snapshot (snapshot.h) share: its files' names, where each of a
// DistributedOptimizer's parameters lives (which owner, which of its optimizer's parameters, which
// are a table's shards), and the manifest's entry of a saved table shard, checked.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <c10/core/ScalarType.h>

#include <distoptim/dist_optim/distributed_optimizer.h>
#include <distoptim/rpc/id_embedding_bag.h>
#include <distoptim/rpc/sharded_embedding_bag.h>

#include "owner_calls.h"
#include "snapshot_files.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

constexpr const char* kManifestFormat = "distoptim.snapshot.manifest";

std::string manifest_path(const std::string& directory);
/// The prefix of table `table`'s block files in `directory`.
std::string table_prefix(const std::string& directory, size_t table);
/// The file of owner `owner`'s parameters that are no table's shard.
std::string params_file(size_t owner);
/// A table block's rows by default: 64 MiB of them, so that an owner loading another split reads
/// at most that much beyond the rows it will own at each end of its range.
int64_t default_block_rows(int64_t dim, c10::ScalarType dtype);

/// A parameter's owner and index in that owner's optimizer.
struct Slot {
  size_t owner = 0;
  int64_t index = -1;
};

/// Where every parameter of an optimizer lives, and which are a table's shards.
struct Layout {
  std::vector<OwnerOptimizer> owners;
  std::vector<Slot> slots;                            // by position
  std::vector<std::vector<int64_t>> table_positions;  // by table, by shard
  std::vector<int64_t> dense_positions;               // the others, in list order
};

/// Where every parameter of `optimizer` lives (asking each table shard's owner which of its
/// parameters the shard is); table_positions has the fixed-size tables, then the collisionless
/// ones. c10::ValueError, named after `caller`, for a null table, a shard that is no parameter of
/// the optimizer, or a table given twice.
Layout layout_of(DistributedOptimizer& optimizer,
                 const std::vector<const rpc::ShardedEmbeddingBag*>& tables,
                 const std::vector<const rpc::ShardedIdEmbeddingBag*>& id_tables,
                 const char* caller);

/// What the manifest says of one saved table shard.
struct SavedShard {
  StateSummary state;
  std::vector<int64_t> blocks;  // each block's first row, then the shard's end
};

/// The manifest's entry `value` of a shard of rows [first, end), checked (c10::ValueError naming
/// `path`).
SavedShard saved_shard(const c10::IValue& value, int64_t first, int64_t end,
                       const std::string& path);

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
