#include "snapshot_layout.h"

#include <algorithm>
#include <filesystem>
#include <set>

#include <ATen/core/Dict.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <distoptim/rpc/detail/calls.h>

namespace distoptim {
namespace dist_optim {
namespace detail {

namespace {

namespace fs = std::filesystem;

constexpr int64_t kDefaultBlockBytes = int64_t{64} << 20;

// The shards' weights of every table, fixed-size tables first, each with its name in errors.
struct TableShards {
  std::string name;
  std::vector<rpc::RRef<at::Tensor>> weights;
};

std::vector<TableShards> shards_of(const std::vector<const rpc::ShardedEmbeddingBag*>& tables,
                                   const std::vector<const rpc::ShardedIdEmbeddingBag*>& id_tables,
                                   const char* caller) {
  std::vector<TableShards> out;
  for (size_t t = 0; t < tables.size(); ++t) {
    TORCH_CHECK_VALUE(tables[t] != nullptr, caller, ": tables[", t, "] is null");
    out.push_back({c10::str("tables[", t, "]"), tables[t]->remote_parameters()});
  }
  for (size_t t = 0; t < id_tables.size(); ++t) {
    TORCH_CHECK_VALUE(id_tables[t] != nullptr, caller, ": id_tables[", t, "] is null");
    out.push_back({c10::str("id_tables[", t, "]"), id_tables[t]->remote_parameters()});
  }
  return out;
}

}  // namespace

std::string manifest_path(const std::string& directory) {
  return (fs::path(directory) / "manifest.pt").string();
}

std::string table_prefix(const std::string& directory, size_t table) {
  return (fs::path(directory) / ("table-" + std::to_string(table))).string();
}

std::string params_file(size_t owner) { return "params-" + std::to_string(owner) + ".pt"; }

int64_t default_block_rows(int64_t dim, c10::ScalarType dtype) {
  const int64_t row_bytes = dim * static_cast<int64_t>(c10::elementSize(dtype));
  return std::max<int64_t>(1, kDefaultBlockBytes / row_bytes);
}

Layout layout_of(DistributedOptimizer& optimizer,
                 const std::vector<const rpc::ShardedEmbeddingBag*>& tables,
                 const std::vector<const rpc::ShardedIdEmbeddingBag*>& id_tables,
                 const char* caller) {
  const std::vector<TableShards> all_tables = shards_of(tables, id_tables, caller);
  Layout layout;
  layout.owners = OwnerAccess::owners(optimizer);
  std::map<std::string, size_t> owner_of;
  for (size_t k = 0; k < layout.owners.size(); ++k) {
    owner_of[layout.owners[k].worker] = k;
    for (size_t i = 0; i < layout.owners[k].positions.size(); ++i) {
      const int64_t position = layout.owners[k].positions[i];
      if (layout.slots.size() <= static_cast<size_t>(position)) layout.slots.resize(position + 1);
      layout.slots[position] = Slot{k, static_cast<int64_t>(i)};
    }
  }
  // Each shard's owner says which of its optimizer's parameters the shard's weight is: a
  // reference to a tensor names a new reference each time it is fetched, the tensor is one.
  std::vector<std::pair<size_t, size_t>> asked;  // table, shard
  std::vector<std::string> workers;
  std::vector<rpc::RpcFuture<c10::IValue>> indices;
  for (size_t t = 0; t < all_tables.size(); ++t) {
    const std::vector<rpc::RRef<at::Tensor>>& shards = all_tables[t].weights;
    for (size_t s = 0; s < shards.size(); ++s) {
      const std::string worker = shards[s].owner_name();
      auto it = owner_of.find(worker);
      TORCH_CHECK_VALUE(it != owner_of.end(), caller, ": shard ", s, " of ", all_tables[t].name,
                        " (on worker '", worker, "') is not a parameter of the optimizer");
      asked.emplace_back(t, s);
      workers.push_back(worker);
      indices.push_back(waited_method(layout.owners[it->second].optimizer, "index_of",
                                      rpc::detail::to_values(shards[s])));
    }
  }
  const auto worker = [&workers](size_t i) -> const std::string& { return workers[i]; };
  const std::vector<c10::IValue> found =
      wait_all(indices, worker, std::string(caller) + " (finding the tables' shards)");
  layout.table_positions.resize(all_tables.size());
  std::set<int64_t> in_tables;
  for (size_t a = 0; a < asked.size(); ++a) {
    const auto [t, s] = asked[a];
    const int64_t index = found[a].isInt() ? found[a].toInt() : -1;
    const std::vector<int64_t>& positions = layout.owners[owner_of.at(workers[a])].positions;
    TORCH_CHECK_VALUE(index >= 0 && static_cast<size_t>(index) < positions.size(), caller,
                      ": shard ", s, " of ", all_tables[t].name, " (on worker '", workers[a],
                      "') is not a parameter of the optimizer");
    const int64_t position = positions[index];
    TORCH_CHECK_VALUE(in_tables.insert(position).second, caller, ": ", all_tables[t].name,
                      " shares its shard ", s, " with an earlier table (a table given twice)");
    layout.table_positions[t].push_back(position);
  }
  for (size_t p = 0; p < layout.slots.size(); ++p) {
    if (!in_tables.count(p)) layout.dense_positions.push_back(p);
  }
  return layout;
}

SavedShard saved_shard(const c10::IValue& value, int64_t first, int64_t end,
                       const std::string& path) {
  TORCH_CHECK_VALUE(value.isGenericDict(), kLoadSnapshot, ": '", path,
                    "': a shard's entry is no dict");
  const c10::impl::GenericDict dict = value.toGenericDict();
  SavedShard shard{state_summary(dict, path), int_list_field(dict, "blocks", path)};
  bool blocks_ok =
      shard.blocks.size() >= 2 && shard.blocks.front() == first && shard.blocks.back() == end;
  for (size_t b = 1; blocks_ok && b < shard.blocks.size(); ++b) {
    blocks_ok = shard.blocks[b - 1] < shard.blocks[b];
  }
  TORCH_CHECK_VALUE(blocks_ok, kLoadSnapshot, ": '", path, "': a shard's blocks ",
                    c10::IntArrayRef(shard.blocks), " do not split its rows [", first, ", ", end,
                    ")");
  return shard;
}

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
