// A snapshot's collisionless tables (id_table_snapshot.h).

#include "id_table_snapshot.h"

#include <filesystem>

#include <c10/util/Exception.h>

namespace distoptim {
namespace dist_optim {
namespace detail {

namespace {

using c10::impl::GenericDict;

// What the manifest says of one saved shard of a collisionless table (an owner's reply, checked
// as the entry it becomes): its state and each block's number of rows.
GenericDict saved_id_shard(const c10::IValue& value, const std::string& path) {
  TORCH_CHECK_VALUE(value.isGenericDict(), kLoadSnapshot, ": '", path,
                    "': a collisionless table's shard entry is no dict");
  const GenericDict dict = value.toGenericDict();
  const std::vector<int64_t> blocks = int_list_field(dict, "blocks", path);
  bool ok = !blocks.empty();
  for (int64_t rows : blocks) ok = ok && rows >= 0;
  TORCH_CHECK_VALUE(ok, kLoadSnapshot, ": '", path, "': a collisionless table's shard has blocks ",
                    c10::IntArrayRef(blocks));
  GenericDict entry = string_dict();
  insert_state_summary(entry, state_summary(dict, path));
  entry.insert("blocks", c10::List<int64_t>(blocks));
  return entry;
}

}  // namespace

std::string id_table_prefix(const std::string& directory, size_t table) {
  return (std::filesystem::path(directory) / ("idtable-" + std::to_string(table))).string();
}

GenericDict id_table_entry(const rpc::ShardedIdEmbeddingBag& table,
                           c10::ArrayRef<c10::IValue> replies, const std::string& from) {
  TORCH_INTERNAL_ASSERT(replies.size() == table.num_shards());
  c10::impl::GenericList shards(c10::AnyType::get());
  for (const c10::IValue& reply : replies) shards.push_back(saved_id_shard(reply, from));
  GenericDict entry = string_dict();
  entry.insert("rows_per_shard", table.options().rows_per_shard());
  entry.insert("embedding_dim", table.options().embedding_dim());
  entry.insert("dtype", static_cast<int64_t>(table.options().dtype()));
  entry.insert("seed", table.options().seed());
  entry.insert("shards", shards);
  return entry;
}

std::vector<IdTableLoad> id_table_loads(
    const GenericDict& manifest, const std::string& path, const std::string& directory,
    const std::vector<const rpc::ShardedIdEmbeddingBag*>& id_tables) {
  // A snapshot written before collisionless tables were saved has none.
  const c10::ArrayRef<c10::IValue> saved = manifest.contains("id_tables")
                                               ? list_field(manifest, "id_tables", path)
                                               : c10::ArrayRef<c10::IValue>();
  TORCH_CHECK_VALUE(saved.size() == id_tables.size(), kLoadSnapshot, ": '", path, "' holds ",
                    saved.size(), " collisionless tables; ", id_tables.size(), " were given");
  std::vector<IdTableLoad> loads;
  for (size_t t = 0; t < id_tables.size(); ++t) {
    TORCH_CHECK_VALUE(saved[t].isGenericDict(), kLoadSnapshot, ": '", path, "': id_tables ", t,
                      " is no dict");
    const GenericDict entry = saved[t].toGenericDict();
    const rpc::ShardedIdEmbeddingBagOptions& options = id_tables[t]->options();
    const int64_t dim = int_field(entry, "embedding_dim", path);
    const int64_t dtype = int_field(entry, "dtype", path);
    TORCH_CHECK_VALUE(
        dim == options.embedding_dim() && dtype == static_cast<int64_t>(options.dtype()),
        kLoadSnapshot, ": '", path, "' holds a collisionless table of dim ", dim, " (dtype ", dtype,
        "), id_tables[", t, "] has dim ", options.embedding_dim(), " (dtype ",
        static_cast<int64_t>(options.dtype()), ")");
    const c10::ArrayRef<c10::IValue> shards = list_field(entry, "shards", path);
    TORCH_CHECK_VALUE(!shards.empty(), kLoadSnapshot, ": '", path, "': id_tables ", t,
                      " has no shards");
    IdTableLoad load;
    for (size_t u = 0; u < shards.size(); ++u) {
      const GenericDict shard = saved_id_shard(shards[u], path);
      load.states.push_back(state_summary(shard, path));
      std::vector<std::string> paths;
      const int64_t blocks = static_cast<int64_t>(int_list_field(shard, "blocks", path).size());
      for (int64_t b = 0; b < blocks; ++b) {
        paths.push_back(block_path(id_table_prefix(directory, t), static_cast<int64_t>(u),
                                   static_cast<int64_t>(shards.size()), b));
      }
      load.paths.push_back(std::move(paths));
    }
    for (size_t u = 1; shards.size() != id_tables[t]->num_shards() && u < shards.size(); ++u) {
      const StateSummary &a = load.states[u], &b = load.states[0];
      TORCH_CHECK_VALUE(a.has_state == b.has_state && a.step == b.step && a.buffers == b.buffers,
                        kLoadSnapshot, ": '", path, "': shard ", u, " of id_tables ", t, " ",
                        shard_state_text(a), ", shard 0 ", shard_state_text(b),
                        ": their rows cannot share one optimizer state, so this snapshot loads "
                        "only into ",
                        shards.size(), " shards");
    }
    loads.push_back(std::move(load));
  }
  return loads;
}

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
