// Saving a snapshot (snapshot.h): every owner copies its parameters, answers, and writes them;
// then the manifest. And the memory a schedule has the owners keep for their copies.

#include <distoptim/dist_optim/snapshot.h>

#include <filesystem>
#include <map>
#include <utility>

#include <ATen/core/Dict.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

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
  std::vector<rpc::RpcFuture<c10::IValue>> calls;  // each write's claim: table shards (by
                                                   // table, by shard), then collisionless
                                                   // tables' shards, then one per owner of
                                                   // other parameters
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
                               int64_t rows_per_file, bool waited_only, double disk_share) {
  TORCH_CHECK_VALUE(rows_per_file >= 0, kSaveSnapshot, ": rows_per_file is ", rows_per_file,
                    "; it must be 0 (64 MiB of rows) or more");
  const Layout layout = layout_of(optimizer, tables, id_tables, kSaveSnapshot);
  // Every step that returned is applied before the owners copy (with max_staleness > 0 some may
  // still be on their way).
  optimizer.flush();
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
  // Each owner answers once its copy is taken, with a ticket for its write (snapshot_writes.h).
  std::vector<const rpc::RRef<RemoteOptimizer>*> owners;  // per call
  std::vector<rpc::RpcFuture<c10::IValue>> copies;
  const auto ask = [&](size_t owner, const char* method, std::vector<c10::IValue> args) {
    owners.push_back(&layout.owners[owner].optimizer);
    calls->workers.push_back(layout.owners[owner].worker);
    copies.push_back(waited_method(layout.owners[owner].optimizer, method, std::move(args)));
  };
  for (size_t t = 0; t < tables.size(); ++t) {
    const rpc::ShardedEmbeddingBagOptions& options = tables[t]->options();
    const int64_t rows = rows_per_file > 0
                             ? rows_per_file
                             : default_block_rows(options.embedding_dim(), options.dtype());
    const int64_t shards = static_cast<int64_t>(tables[t]->num_shards());
    for (int64_t s = 0; s < shards; ++s) {
      const Slot& slot = layout.slots[layout.table_positions[t][s]];
      ask(slot.owner, "save_table_rows",
          {table_prefix(calls->directory, t), slot.index, s, shards, tables[t]->shard_rows(s).first,
           rows, disk_share});
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
      ask(slot.owner, "save_id_rows",
          {id_table_prefix(calls->directory, t), slot.index, rpc::to_value(modules[s]), s, shards,
           rows, disk_share});
    }
  }
  for (const auto& [owner, params] : dense_by_owner(layout)) {
    ask(owner, "save_params",
        {(fs::path(calls->directory) / params_file(owner)).string(),
         c10::List<int64_t>(params.second), c10::List<int64_t>(params.first), disk_share});
    calls->dense.emplace_back(owner, params.first);
  }
  const auto worker = [&calls](size_t i) -> const std::string& { return calls->workers[i]; };
  const Replies tickets = wait_each(copies, worker);
  if (tickets.first) {
    // The owners that copied write on: they finish before the error, so that no file of this
    // snapshot is still being written when the caller may begin another.
    for (size_t i = 0; i < copies.size(); ++i) {
      if (!tickets.ok[i]) continue;
      try {
        waited_method(*owners[i], "snapshot_written", {tickets.values[i]}).wait();
      } catch (const std::exception&) {
        // The copies' failures are the ones reported.
      }
    }
    throw_if_failed(tickets, std::string(kSaveSnapshot) + " (the owners' copies)");
  }
  // Then the trainer may step on; each write is claimed, to be waited for by finish().
  for (size_t i = 0; i < copies.size(); ++i) {
    calls->calls.push_back(
        waited_method(*owners[i], "snapshot_written", {tickets.values[i]}, waited_only));
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

}  // namespace detail

void save_snapshot(const std::string& directory, DistributedOptimizer& optimizer,
                   const std::vector<const rpc::ShardedEmbeddingBag*>& tables,
                   int64_t rows_per_file,
                   const std::vector<const rpc::ShardedIdEmbeddingBag*>& id_tables) {
  detail::begin_snapshot(directory, optimizer, tables, id_tables, rows_per_file,
                         /*waited_only=*/true, /*disk_share=*/1)
      .finish(std::nullopt);
}

}  // namespace dist_optim
}  // namespace distoptim
