#pragma once

// Checkpoints of an embedding table split over parameter servers (rpc::ShardedEmbeddingBag) and of
// the DistributedOptimizer that trains it, written by the shards' owners, that load into the table
// split over another number of shards (TorchRec's resharding on load):
//
//   save_sharded_table("ckpt/step-1000", table, optimizer);   // 3 shards
//   ...
//   rpc::ShardedEmbeddingBag table(options.workers({"ps0", "ps1"}));
//   DistributedOptimizer optimizer("adagrad", table.remote_parameters(), options);
//   load_sharded_table("ckpt/step-1000", table, optimizer);   // 2 shards, same trajectory
//
// The snapshot (snapshot.h) of an optimizer over one table alone: save_snapshot and
// load_snapshot with `{&table}`, checking first that the optimizer holds the table's shards and
// nothing else. Each shard's owner writes and reads its own rows, all owners at once, so no
// process holds more than its own shard; loading into another split, each owner reads only the
// blocks that overlap its rows. Layout, consistency and what reshards: snapshot.h's.
//
// Thread safety: neither may overlap a step of `optimizer` or another save or load of the table.

#include <cstdint>
#include <string>

#include <distoptim/dist_optim/distributed_optimizer.h>
#include <distoptim/rpc/sharded_embedding_bag.h>

namespace distoptim {
namespace dist_optim {

/// Writes `table`'s rows and `optimizer`'s state of them to `directory` (created if needed),
/// each shard by its owner, in blocks of at most `rows_per_file` rows (0: 64 MiB of rows).
/// `optimizer` must be one built over `table.remote_parameters()` (in any param groups, nothing
/// else). Errors: c10::ValueError naming the mismatch for another optimizer, before anything is
/// written; then save_snapshot's.
void save_sharded_table(const std::string& directory, const rpc::ShardedEmbeddingBag& table,
                        DistributedOptimizer& optimizer, int64_t rows_per_file = 0);

/// Loads the checkpoint in `directory` into `table` and `optimizer` (built as for save), whatever
/// the number of shards of either. Errors: c10::ValueError naming the mismatch for another
/// optimizer, then load_snapshot's (every file read and checked before anything changes).
void load_sharded_table(const std::string& directory, rpc::ShardedEmbeddingBag& table,
                        DistributedOptimizer& optimizer);

}  // namespace dist_optim
}  // namespace distoptim
