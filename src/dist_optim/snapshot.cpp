#include <distoptim/dist_optim/snapshot.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <utility>

#include <ATen/core/Dict.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <distoptim/rpc/detail/calls.h>

#include "checkpoint_file.h"
#include "id_table_snapshot.h"
#include "owner_calls.h"
#include "snapshot_calls.h"
#include "snapshot_files.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

namespace {

namespace fs = std::filesystem;
using c10::impl::GenericDict;

constexpr const char* kManifestFormat = "distoptim.snapshot.manifest";
// A table block's rows by default: 64 MiB of them, so that an owner loading another split reads
// at most that much beyond the rows it will own at each end of its range.
constexpr int64_t kDefaultBlockBytes = int64_t{64} << 20;

std::string manifest_path(const std::string& directory) {
  return (fs::path(directory) / "manifest.pt").string();
}

std::string table_prefix(const std::string& directory, size_t table) {
  return (fs::path(directory) / ("table-" + std::to_string(table))).string();
}

std::string params_file(size_t owner) { return "params-" + std::to_string(owner) + ".pt"; }

// A table block's rows by default: 64 MiB of them.
int64_t default_block_rows(int64_t dim, c10::ScalarType dtype) {
  const int64_t row_bytes = dim * static_cast<int64_t>(c10::elementSize(dtype));
  return std::max<int64_t>(1, kDefaultBlockBytes / row_bytes);
}

// A parameter's owner and index in that owner's optimizer.
struct Slot {
  size_t owner = 0;
  int64_t index = -1;
};

// Where every parameter of `optimizer` lives, and which are a table's shards.
struct Layout {
  std::vector<OwnerOptimizer> owners;
  std::vector<Slot> slots;                            // by position
  std::vector<std::vector<int64_t>> table_positions;  // by table, by shard
  std::vector<int64_t> dense_positions;               // the others, in list order
};

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

// Where every parameter of `optimizer` lives; table_positions has the fixed-size tables, then
// the collisionless ones.
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

// The other parameters of each owner: their dense indices (order among the parameters that are
// no table's, what names them in a snapshot), and their indices in the owner's optimizer.
std::map<size_t, std::pair<std::vector<int64_t>, std::vector<int64_t>>> dense_by_owner(
    const Layout& layout) {
  std::map<size_t, std::pair<std::vector<int64_t>, std::vector<int64_t>>> out;
  for (size_t j = 0; j < layout.dense_positions.size(); ++j) {
    const Slot& slot = layout.slots[layout.dense_positions[j]];
    out[slot.owner].first.push_back(static_cast<int64_t>(j));
    out[slot.owner].second.push_back(slot.index);
  }
  return out;
}

// What the manifest says of one saved table shard.
struct SavedShard {
  StateSummary state;
  std::vector<int64_t> blocks;  // each block's first row, then the shard's end
};

SavedShard saved_shard(const c10::IValue& value, int64_t first, int64_t end,
                       const std::string& path) {
  TORCH_CHECK_VALUE(value.isGenericDict(), kLoadSnapshot, ": '", path,
                    "': a shard's entry is no dict");
  const GenericDict dict = value.toGenericDict();
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

// Checks that `first_rows` split `rows` rows.
void check_split(const std::vector<int64_t>& first_rows, int64_t rows, const std::string& path) {
  bool ok = first_rows.size() >= 2 && first_rows.front() == 0 && first_rows.back() == rows;
  for (size_t s = 1; ok && s < first_rows.size(); ++s) ok = first_rows[s - 1] < first_rows[s];
  TORCH_CHECK_VALUE(ok, kLoadSnapshot, ": '", path, "': shard ranges ",
                    c10::IntArrayRef(first_rows), " do not split ", rows, " rows");
}

}  // namespace

// A snapshot whose owners have been asked to write their files: the calls, and what the
// manifest needs besides their replies.
struct PendingSnapshot::Calls {
  std::string directory;  // absolute
  std::string optimizer;
  int64_t params = 0;
  std::vector<const rpc::ShardedEmbeddingBag*> tables;
  std::vector<const rpc::ShardedIdEmbeddingBag*> id_tables;
  std::vector<std::string> workers;                // per call, to name a failure
  std::vector<rpc::RpcFuture<c10::IValue>> calls;  // table shards (by table, by shard), then
                                                   // collisionless tables' shards, then one
                                                   // per owner of other parameters
  std::vector<std::pair<size_t, std::vector<int64_t>>> dense;  // owner, dense indices; per call
};

PendingSnapshot::PendingSnapshot(std::unique_ptr<Calls> calls) : calls_(std::move(calls)) {}
PendingSnapshot::PendingSnapshot(PendingSnapshot&&) noexcept = default;
PendingSnapshot& PendingSnapshot::operator=(PendingSnapshot&&) noexcept = default;
PendingSnapshot::~PendingSnapshot() = default;

bool PendingSnapshot::written() const {
  for (const auto& call : calls_->calls) {
    if (!call.completed()) return false;
  }
  return true;
}

PendingSnapshot begin_snapshot(const std::string& directory, DistributedOptimizer& optimizer,
                               const std::vector<const rpc::ShardedEmbeddingBag*>& tables,
                               const std::vector<const rpc::ShardedIdEmbeddingBag*>& id_tables,
                               int64_t rows_per_file, bool waited_only) {
  TORCH_CHECK_VALUE(rows_per_file >= 0, kSaveSnapshot, ": rows_per_file is ", rows_per_file,
                    "; it must be 0 (64 MiB of rows) or more");
  const Layout layout = layout_of(optimizer, tables, id_tables, kSaveSnapshot);
  auto calls = std::make_unique<PendingSnapshot::Calls>();
  // The owners resolve the path themselves: an absolute one names the same directory for all.
  calls->directory = fs::absolute(directory).string();
  calls->optimizer = optimizer.optimizer();
  calls->params = static_cast<int64_t>(layout.slots.size());
  calls->tables = tables;
  calls->id_tables = id_tables;
  std::error_code error;
  fs::create_directories(calls->directory, error);
  TORCH_CHECK(!error, kSaveSnapshot, ": cannot create the directory '", directory,
              "': ", error.message());
  // Without a manifest the directory is no snapshot while its files are being replaced.
  fs::remove(manifest_path(calls->directory), error);
  TORCH_CHECK(!error, kSaveSnapshot, ": cannot remove the old '", manifest_path(directory),
              "': ", error.message());
  for (size_t t = 0; t < tables.size(); ++t) {
    const rpc::ShardedEmbeddingBagOptions& options = tables[t]->options();
    const int64_t rows = rows_per_file > 0
                             ? rows_per_file
                             : default_block_rows(options.embedding_dim(), options.dtype());
    const int64_t shards = static_cast<int64_t>(tables[t]->num_shards());
    for (int64_t s = 0; s < shards; ++s) {
      const Slot& slot = layout.slots[layout.table_positions[t][s]];
      calls->workers.push_back(layout.owners[slot.owner].worker);
      calls->calls.push_back(waited_method(layout.owners[slot.owner].optimizer, "save_table_rows",
                                           {table_prefix(calls->directory, t), slot.index, s,
                                            shards, tables[t]->shard_rows(s).first, rows},
                                           waited_only));
    }
  }
  for (size_t t = 0; t < id_tables.size(); ++t) {
    const rpc::ShardedIdEmbeddingBagOptions& options = id_tables[t]->options();
    const int64_t rows = rows_per_file > 0
                             ? rows_per_file
                             : default_block_rows(options.embedding_dim(), options.dtype());
    const std::vector<rpc::RRef<rpc::IdEmbeddingShard>> modules =
        id_tables[t]->shard_module_rrefs();
    const int64_t shards = static_cast<int64_t>(modules.size());
    for (int64_t s = 0; s < shards; ++s) {
      const Slot& slot = layout.slots[layout.table_positions[tables.size() + t][s]];
      calls->workers.push_back(layout.owners[slot.owner].worker);
      calls->calls.push_back(waited_method(layout.owners[slot.owner].optimizer, "save_id_rows",
                                           {id_table_prefix(calls->directory, t), slot.index,
                                            rpc::to_value(modules[s]), s, shards, rows},
                                           waited_only));
    }
  }
  for (const auto& [owner, params] : dense_by_owner(layout)) {
    calls->workers.push_back(layout.owners[owner].worker);
    calls->calls.push_back(
        waited_method(layout.owners[owner].optimizer, "save_params",
                      {(fs::path(calls->directory) / params_file(owner)).string(),
                       c10::List<int64_t>(params.second), c10::List<int64_t>(params.first)},
                      waited_only));
    calls->dense.emplace_back(owner, params.first);
  }
  return PendingSnapshot(std::move(calls));
}

void PendingSnapshot::finish(std::optional<int64_t> step) {
  const Calls& c = *calls_;
  const auto worker = [&c](size_t i) -> const std::string& { return c.workers[i]; };
  const std::vector<c10::IValue> replies =
      wait_all(c.calls, worker, std::string(kSaveSnapshot) + " (the owners' files)");
  const std::string from = "the owners' replies";
  size_t call = 0;
  c10::impl::GenericList tables(c10::AnyType::get());
  for (size_t t = 0; t < c.tables.size(); ++t) {
    const rpc::ShardedEmbeddingBagOptions& options = c.tables[t]->options();
    std::vector<int64_t> first_rows;
    c10::impl::GenericList shards(c10::AnyType::get());
    for (size_t s = 0; s < c.tables[t]->num_shards(); ++s) {
      const auto [first, end] = c.tables[t]->shard_rows(s);
      first_rows.push_back(first);
      // An owner's reply, checked as the manifest's entry it becomes.
      const SavedShard shard = saved_shard(replies[call++], first, end, from);
      GenericDict entry = string_dict();
      insert_state_summary(entry, shard.state);
      entry.insert("blocks", c10::List<int64_t>(shard.blocks));
      shards.push_back(entry);
    }
    first_rows.push_back(options.num_embeddings());
    GenericDict table = string_dict();
    table.insert("num_embeddings", options.num_embeddings());
    table.insert("embedding_dim", options.embedding_dim());
    table.insert("dtype", static_cast<int64_t>(options.dtype()));
    table.insert("first_rows", c10::List<int64_t>(first_rows));
    table.insert("shards", shards);
    tables.push_back(table);
  }
  c10::impl::GenericList id_tables(c10::AnyType::get());
  for (const rpc::ShardedIdEmbeddingBag* table : c.id_tables) {
    id_tables.push_back(id_table_entry(
        *table, c10::ArrayRef<c10::IValue>(replies).slice(call, table->num_shards()), from));
    call += table->num_shards();
  }
  // Other parameters by their order among them (dense index), each with its file.
  std::map<int64_t, GenericDict> dense_entries;
  for (const auto& [owner, positions] : c.dense) {
    const c10::IValue& reply = replies[call++];
    TORCH_CHECK_VALUE(reply.isList() && reply.toListRef().size() == positions.size(), kSaveSnapshot,
                      ": worker '", c.workers[call - 1], "' answered ", reply.tagKind(), " for ",
                      positions.size(), " parameters");
    for (size_t i = 0; i < positions.size(); ++i) {
      const c10::IValue& summary = reply.toListRef()[i];
      TORCH_CHECK_VALUE(summary.isGenericDict(), kSaveSnapshot, ": worker '", c.workers[call - 1],
                        "' answered no dict for a parameter");
      GenericDict entry = string_dict();
      insert_state_summary(entry, state_summary(summary.toGenericDict(), from));
      entry.insert("file", params_file(owner));
      const int64_t dense_index = positions[i];
      entry.insert("dense_index", dense_index);
      dense_entries.emplace(dense_index, entry);
    }
  }
  c10::impl::GenericList dense(c10::AnyType::get());
  for (auto& entry : dense_entries) dense.push_back(entry.second);
  GenericDict manifest = string_dict();
  manifest.insert("format", std::string(kManifestFormat));
  manifest.insert("version", kSnapshotVersion);
  manifest.insert("optimizer", c.optimizer);
  // Whose optimizer state it holds: a recovery by another trainer takes the values alone.
  manifest.insert("trainer", rpc::get_worker_info().name);
  manifest.insert("params", c.params);
  manifest.insert("step", step.value_or(-1));
  manifest.insert("tables", tables);
  manifest.insert("id_tables", id_tables);
  manifest.insert("dense", dense);
  optim::detail::write_pickle_file(manifest_path(c.directory), manifest, kSaveSnapshot);
}

std::map<std::string, int64_t> reserve_snapshot_copies(
    DistributedOptimizer& optimizer, const std::vector<const rpc::ShardedEmbeddingBag*>& tables,
    const std::vector<const rpc::ShardedIdEmbeddingBag*>& id_tables) {
  const Layout layout = layout_of(optimizer, tables, id_tables, kSaveSnapshot);
  std::map<size_t, std::vector<int64_t>> indices_by_owner;
  for (size_t t = 0; t < tables.size(); ++t) {
    for (int64_t position : layout.table_positions[t]) {
      const Slot& slot = layout.slots[position];
      indices_by_owner[slot.owner].push_back(slot.index);
    }
  }
  for (const auto& [owner, params] : dense_by_owner(layout)) {
    std::vector<int64_t>& indices = indices_by_owner[owner];
    indices.insert(indices.end(), params.second.begin(), params.second.end());
  }
  std::vector<std::string> workers;
  std::vector<rpc::RpcFuture<c10::IValue>> calls;
  for (const auto& [owner, indices] : indices_by_owner) {
    workers.push_back(layout.owners[owner].worker);
    calls.push_back(waited_method(layout.owners[owner].optimizer, "reserve_copies",
                                  {c10::List<int64_t>(indices)}));
  }
  const Replies replies =
      wait_each(calls, [&workers](size_t i) -> const std::string& { return workers[i]; });
  if (!replies.failures.empty()) {
    LOG(WARNING) << "SnapshotSchedule: the memory of the snapshots' copies was not kept on"
                 << replies.failures << "; their first snapshot maps it";
  }
  std::map<std::string, int64_t> reserved;
  for (size_t i = 0; i < calls.size(); ++i) {
    if (replies.ok[i] && replies.values[i].isInt()) {
      reserved[workers[i]] = replies.values[i].toInt();
    }
  }
  return reserved;
}

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

void save_snapshot(const std::string& directory, DistributedOptimizer& optimizer,
                   const std::vector<const rpc::ShardedEmbeddingBag*>& tables,
                   int64_t rows_per_file,
                   const std::vector<const rpc::ShardedIdEmbeddingBag*>& id_tables) {
  detail::begin_snapshot(directory, optimizer, tables, id_tables, rows_per_file,
                         /*waited_only=*/true)
      .finish(std::nullopt);
}

void load_snapshot(const std::string& directory, DistributedOptimizer& optimizer,
                   const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                   const std::vector<const rpc::ShardedIdEmbeddingBag*>& id_tables) {
  detail::load_snapshot_into(directory, optimizer, tables, /*only_worker=*/{},
                             detail::SnapshotPart::kEverything, id_tables);
}

}  // namespace dist_optim
}  // namespace distoptim
