#pragma once

// A snapshot's collisionless tables (rpc::ShardedIdEmbeddingBag, snapshot.h): their files'
// names, their manifest entries, and what a load of each reads. Each shard's owner writes its
// live rows with their ids (RemoteOptimizer::save_id_rows) as blocks
// idtable-T.shard-S-of-N.block-B.pt; the manifest's entry for a table holds its rows_per_shard,
// embedding_dim, dtype and seed, and per shard its state's summary and each block's number of
// rows. Loading into the same number of shards, each shard reads its saved shard's blocks; into
// another, every block (ids move between shards then), keeping the ids it holds now.

#include <string>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <distoptim/rpc/id_embedding_bag.h>

#include "snapshot_files.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

/// DIRECTORY/idtable-T: the prefix of table `table`'s block files.
std::string id_table_prefix(const std::string& directory, size_t table);

/// The manifest's entry for `table`, from its shards' owners' replies to save_id_rows (one per
/// shard, in shard order), each checked as the entry it becomes. Errors: c10::ValueError naming
/// `from` for a reply that is not what save_id_rows answers.
c10::impl::GenericDict id_table_entry(const rpc::ShardedIdEmbeddingBag& table,
                                      c10::ArrayRef<c10::IValue> replies, const std::string& from);

/// What a load of one collisionless table reads, by saved shard: its block files and its state.
struct IdTableLoad {
  std::vector<std::vector<std::string>> paths;
  std::vector<StateSummary> states;
};

/// The collisionless tables of the manifest at `path` (of the snapshot in `directory`, an
/// absolute path), checked against `id_tables`: as many, each of the same dim and dtype, and,
/// loaded into another number of shards, saved shards with one step count (their rows would share
/// it). A manifest written before snapshots held collisionless tables holds none. Errors:
/// c10::ValueError naming the manifest and what differs.
std::vector<IdTableLoad> id_table_loads(
    const c10::impl::GenericDict& manifest, const std::string& path, const std::string& directory,
    const std::vector<const rpc::ShardedIdEmbeddingBag*>& id_tables);

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
