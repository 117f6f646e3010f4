// Loading a snapshot (snapshot.h): every owner reads and checks what it will hold and keeps it;
// only once every owner has, does each load it.

#include <distoptim/dist_optim/snapshot.h>

#include <filesystem>
#include <map>
#include <utility>

#include <ATen/core/Dict.h>
#include <c10/util/Exception.h>

#include "checkpoint_file.h"
#include "id_table_snapshot.h"
#include "owner_calls.h"
#include "snapshot_calls.h"
#include "snapshot_files.h"
#include "snapshot_layout.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

namespace {

namespace fs = std::filesystem;
using c10::impl::GenericDict;

// Checks that `first_rows` split `rows` rows.
void check_split(const std::vector<int64_t>& first_rows, int64_t rows, const std::string& path) {
  bool ok = first_rows.size() >= 2 && first_rows.front() == 0 && first_rows.back() == rows;
  for (size_t s = 1; ok && s < first_rows.size(); ++s) ok = first_rows[s - 1] < first_rows[s];
  TORCH_CHECK_VALUE(ok, kLoadSnapshot, ": '", path, "': shard ranges ",
                    c10::IntArrayRef(first_rows), " do not split ", rows, " rows");
}

}  // namespace

void load_snapshot_into(const std::string& directory, DistributedOptimizer& optimizer,
                        const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                        const std::string& only_worker, SnapshotPart part,
                        const std::vector<const rpc::ShardedIdEmbeddingBag*>& id_tables) {
  const std::string absolute = fs::absolute(directory).string();
  const std::string path = manifest_path(directory);
  const GenericDict manifest = dict_of(optim::detail::read_pickle_file(path, kLoadSnapshot), path);
  check_format(manifest, kManifestFormat, path);
  const c10::IValue& name = field(manifest, "optimizer", path);
  TORCH_CHECK_VALUE(name.isString(), kLoadSnapshot, ": '", path, "': 'optimizer' is no string");
  TORCH_CHECK_VALUE(name.toStringRef() == optimizer.optimizer(), kLoadSnapshot, ": '", path,
                    "' holds the state of optimizer '", name.toStringRef(), "', this one is '",
                    optimizer.optimizer(), "'");
  const std::vector<const rpc::ShardedEmbeddingBag*> const_tables(tables.begin(), tables.end());
  const Layout layout = layout_of(optimizer, const_tables, id_tables, kLoadSnapshot);
  const c10::ArrayRef<c10::IValue> saved_tables =
      list_field(manifest, "tables", path, static_cast<int64_t>(tables.size()));
  const c10::ArrayRef<c10::IValue> saved_dense =
      list_field(manifest, "dense", path, static_cast<int64_t>(layout.dense_positions.size()));
  // Every owner's reads, and then its loads, by (owner, index).
  std::vector<rpc::RpcFuture<c10::IValue>> stages;
  std::vector<std::string> workers;
  std::vector<Slot> staged;
  auto stage = [&](const Slot& slot, const char* method, std::vector<c10::IValue> args) {
    if (!only_worker.empty() && layout.owners[slot.owner].worker != only_worker) return;
    workers.push_back(layout.owners[slot.owner].worker);
    staged.push_back(slot);
    stages.push_back(waited_method(layout.owners[slot.owner].optimizer, method, std::move(args)));
  };
  // Everything in the manifest is checked before any owner is asked to read.
  struct TableLoad {
    std::vector<int64_t> first_rows;
    std::vector<SavedShard> saved;
    bool same_split = false;
  };
  std::vector<TableLoad> loads;
  for (size_t t = 0; t < tables.size(); ++t) {
    TORCH_CHECK_VALUE(saved_tables[t].isGenericDict(), kLoadSnapshot, ": '", path, "': table ", t,
                      " is no dict");
    const GenericDict saved = saved_tables[t].toGenericDict();
    const rpc::ShardedEmbeddingBagOptions& options = tables[t]->options();
    const int64_t rows = int_field(saved, "num_embeddings", path);
    const int64_t dim = int_field(saved, "embedding_dim", path);
    const int64_t dtype = int_field(saved, "dtype", path);
    TORCH_CHECK_VALUE(rows == options.num_embeddings() && dim == options.embedding_dim() &&
                          dtype == static_cast<int64_t>(options.dtype()),
                      kLoadSnapshot, ": '", path, "' holds a table of ", rows, " x ", dim,
                      " (dtype ", dtype, "), this table is ", options.num_embeddings(), " x ",
                      options.embedding_dim(), " (dtype ", static_cast<int64_t>(options.dtype()),
                      ")", tables.size() > 1 ? c10::str(" (tables[", t, "])") : std::string());
    TableLoad load;
    load.first_rows = int_list_field(saved, "first_rows", path);
    check_split(load.first_rows, rows, path);
    const size_t saved_shards = load.first_rows.size() - 1;
    const c10::ArrayRef<c10::IValue> shards =
        list_field(saved, "shards", path, static_cast<int64_t>(saved_shards));
    for (size_t s = 0; s < saved_shards; ++s) {
      load.saved.push_back(
          saved_shard(shards[s], load.first_rows[s], load.first_rows[s + 1], path));
    }
    load.same_split = saved_shards == tables[t]->num_shards();
    for (size_t s = 0; load.same_split && s < saved_shards; ++s) {
      load.same_split = tables[t]->shard_rows(s).first == load.first_rows[s];
    }
    for (size_t s = 1; !load.same_split && s < saved_shards; ++s) {
      // Rows of several saved shards may land in one: they must agree on everything but rows.
      const StateSummary &a = load.saved[s].state, &b = load.saved[0].state;
      TORCH_CHECK_VALUE(a.has_state == b.has_state && a.step == b.step && a.buffers == b.buffers,
                        kLoadSnapshot, ": '", path, "': shard ", s, " ", shard_state_text(a),
                        ", shard 0 ", shard_state_text(b),
                        ": their rows cannot share one optimizer state, so this snapshot loads "
                        "only into ",
                        saved_shards, " shards");
    }
    loads.push_back(std::move(load));
  }
  std::vector<std::pair<std::string, StateSummary>> dense(saved_dense.size());
  for (size_t j = 0; j < saved_dense.size(); ++j) {
    TORCH_CHECK_VALUE(saved_dense[j].isGenericDict(), kLoadSnapshot, ": '", path,
                      "': a parameter's entry is no dict");
    const GenericDict entry = saved_dense[j].toGenericDict();
    TORCH_CHECK_VALUE(int_field(entry, "dense_index", path) == static_cast<int64_t>(j),
                      kLoadSnapshot, ": '", path, "': 'dense' is not in order");
    const c10::IValue& file = field(entry, "file", path);
    TORCH_CHECK_VALUE(
        file.isString() && fs::path(file.toStringRef()).filename() == file.toStringRef(),
        kLoadSnapshot, ": '", path, "': a parameter's 'file' is no file name");
    dense[j] = {(fs::path(absolute) / file.toStringRef()).string(), state_summary(entry, path)};
  }
  const std::vector<IdTableLoad> id_loads = id_table_loads(manifest, path, absolute, id_tables);
  for (size_t t = 0; t < tables.size(); ++t) {
    const TableLoad& load = loads[t];
    const size_t saved_shards = load.first_rows.size() - 1;
    for (size_t s = 0; s < tables[t]->num_shards(); ++s) {
      const auto [first, end] = tables[t]->shard_rows(s);
      c10::impl::GenericList blocks(c10::AnyType::get());
      for (size_t u = 0; u < saved_shards; ++u) {
        const std::vector<int64_t>& firsts = load.saved[u].blocks;
        for (size_t b = 0; b + 1 < firsts.size(); ++b) {
          if (firsts[b + 1] <= first || firsts[b] >= end) continue;
          c10::impl::GenericList block(c10::AnyType::get());
          block.push_back(block_path(table_prefix(absolute, t), u, saved_shards, b));
          block.push_back(static_cast<int64_t>(u));
          block.push_back(firsts[b]);
          block.push_back(firsts[b + 1]);
          blocks.push_back(block);
        }
      }
      GenericDict state = string_dict();
      insert_state_summary(state, load.saved[load.same_split ? s : 0].state);
      const Slot& slot = layout.slots[layout.table_positions[t][s]];
      stage(slot, "stage_table_rows", {slot.index, first, blocks, state});
    }
  }
  for (size_t t = 0; t < id_tables.size(); ++t) {
    const IdTableLoad& load = id_loads[t];
    const std::vector<rpc::RRef<rpc::IdEmbeddingShard>> modules =
        id_tables[t]->shard_module_rrefs();
    const int64_t shards = static_cast<int64_t>(modules.size());
    const bool same_split = load.paths.size() == modules.size();
    std::vector<std::string> every_block;
    for (const std::vector<std::string>& paths : load.paths) {
      every_block.insert(every_block.end(), paths.begin(), paths.end());
    }
    // A collisionless table's state rows are its ids' (the rows change hands): with the ids
    // they load into the rows the ids get; alone (a trainer that did not restore the shard),
    // into the rows the ids hold now.
    for (int64_t s = 0; s < shards; ++s) {
      // Over the same split each shard holds the ids its saved shard held; over another, any.
      GenericDict state = string_dict();
      insert_state_summary(state, load.states[same_split ? s : 0]);
      const Slot& slot = layout.slots[layout.table_positions[tables.size() + t][s]];
      stage(slot, "stage_id_rows",
            {slot.index, rpc::to_value(modules[s]), s, shards,
             c10::List<std::string>(same_split ? load.paths[s] : every_block), state});
    }
  }
  for (size_t j = 0; j < dense.size(); ++j) {
    GenericDict state = string_dict();
    insert_state_summary(state, dense[j].second);
    const Slot& slot = layout.slots[layout.dense_positions[j]];
    stage(slot, "stage_param", {slot.index, dense[j].first, static_cast<int64_t>(j), state});
  }
  const auto worker = [&workers](size_t i) -> const std::string& { return workers[i]; };
  const Replies read = wait_each(stages, worker);
  auto each_staged = [&](const char* method) {
    std::vector<rpc::RpcFuture<c10::IValue>> calls;
    for (const Slot& slot : staged) {
      calls.push_back(waited_method(layout.owners[slot.owner].optimizer, method, {slot.index}));
    }
    return calls;
  };
  if (read.first) {
    // Nothing changed: the owners forget what they read (a failure to do so is reported less
    // than the one that stopped the load).
    wait_each(each_staged("drop_staged"), worker);
    throw_if_failed(read, std::string(kLoadSnapshot) + " (reading the owners' files)");
  }
  const char* commit = part == SnapshotPart::kState    ? "commit_staged_state"
                       : part == SnapshotPart::kValues ? "commit_staged_value"
                                                       : "commit_staged";
  wait_all(each_staged(commit), worker,
           std::string(kLoadSnapshot) + (part == SnapshotPart::kState
                                             ? " (loading the optimizer's state)"
                                             : " (loading the parameters)"));
}

std::string snapshot_trainer(const std::string& directory) {
  const std::string path = manifest_path(directory);
  const GenericDict manifest = dict_of(optim::detail::read_pickle_file(path, kLoadSnapshot), path);
  check_format(manifest, kManifestFormat, path);
  if (!manifest.contains("trainer")) return {};
  const c10::IValue& trainer = manifest.at("trainer");
  TORCH_CHECK_VALUE(trainer.isString(), kLoadSnapshot, ": '", path, "': 'trainer' is no string");
  return trainer.toStringRef();
}

}  // namespace detail

void load_snapshot(const std::string& directory, DistributedOptimizer& optimizer,
                   const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                   const std::vector<const rpc::ShardedIdEmbeddingBag*>& id_tables) {
  detail::load_snapshot_into(directory, optimizer, tables, /*only_worker=*/{},
                             detail::SnapshotPart::kEverything, id_tables);
}

}  // namespace dist_optim
}  // namespace distoptim
