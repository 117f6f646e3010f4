#include <distoptim/dist_optim/sharded_table_checkpoint.h>

#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <utility>
#include <vector>

#include <ATen/core/Dict.h>
#include <c10/util/Exception.h>

#include "checkpoint_file.h"
#include "owner_calls.h"
#include "table_shard_files.h"

namespace distoptim {
namespace dist_optim {

namespace {

namespace fs = std::filesystem;
using c10::impl::GenericDict;
using detail::field;
using detail::int_field;
using detail::int_list_field;
using detail::kLoadTable;
using detail::kSaveTable;
using detail::OwnerOptimizer;

constexpr const char* kManifestFormat = "distoptim.sharded_table.manifest";
// A block file's rows by default: 64 MiB of them, so that an owner loading another split reads
// at most that much beyond the rows it will own at each end of its range.
constexpr int64_t kDefaultBlockBytes = int64_t{64} << 20;

std::string manifest_path(const std::string& directory) {
  return (fs::path(directory) / "manifest.pt").string();
}

// Where shard s's rows live among a DistributedOptimizer's owners: owner `owner`, parameter
// `index` of that owner's optimizer.
struct ShardSlot {
  size_t owner = 0;
  int64_t index = -1;
};

// One slot per shard; the optimizer must be built over table.remote_parameters() (positions 0 to
// shards - 1, in shard order, each on its shard's worker).
std::vector<ShardSlot> shard_slots(const std::vector<OwnerOptimizer>& owners,
                                   const rpc::ShardedEmbeddingBag& table, const char* caller) {
  const size_t shards = table.num_shards();
  const std::vector<std::string>& workers = table.options().workers();
  size_t params = 0;
  for (const OwnerOptimizer& owner : owners) params += owner.positions.size();
  TORCH_CHECK_VALUE(params == shards, caller, ": the optimizer has ", params,
                    " parameters, the table ", shards,
                    " shards (build it over table.remote_parameters() alone)");
  std::vector<ShardSlot> slots(shards);
  for (size_t k = 0; k < owners.size(); ++k) {
    for (size_t i = 0; i < owners[k].positions.size(); ++i) {
      const int64_t position = owners[k].positions[i];
      TORCH_CHECK_VALUE(position >= 0 && static_cast<size_t>(position) < shards &&
                            owners[k].worker == workers[position],
                        caller, ": the optimizer's parameter ", position, " is on worker '",
                        owners[k].worker, "', which holds no shard ", position,
                        " of the table (build the optimizer over table.remote_parameters())");
      slots[position] = ShardSlot{k, static_cast<int64_t>(i)};
    }
  }
  return slots;
}

// What the manifest says of one saved shard.
struct SavedShard {
  bool has_state = false;
  int64_t step = 0;
  std::vector<std::string> buffers;
  std::vector<int64_t> blocks;  // each block's first row, then the shard's end
};

GenericDict shard_entry(const SavedShard& shard) {
  GenericDict entry(c10::StringType::get(), c10::AnyType::get());
  entry.insert("has_state", shard.has_state);
  entry.insert("step", shard.step);
  entry.insert("buffers", c10::List<std::string>(shard.buffers));
  entry.insert("blocks", c10::List<int64_t>(shard.blocks));
  return entry;
}

SavedShard saved_shard(const c10::IValue& value, size_t s, int64_t first, int64_t end,
                       const std::string& path) {
  TORCH_CHECK_VALUE(value.isGenericDict(), kLoadTable, ": '", path, "': shard ", s,
                    "'s entry is no dict");
  const GenericDict dict = value.toGenericDict();
  SavedShard shard;
  shard.has_state = detail::bool_field(dict, "has_state", path);
  shard.step = int_field(dict, "step", path);
  shard.buffers = detail::string_list_field(dict, "buffers", path);
  shard.blocks = int_list_field(dict, "blocks", path);
  bool blocks_ok =
      shard.blocks.size() >= 2 && shard.blocks.front() == first && shard.blocks.back() == end;
  for (size_t b = 1; blocks_ok && b < shard.blocks.size(); ++b) {
    blocks_ok = shard.blocks[b - 1] < shard.blocks[b];
  }
  TORCH_CHECK_VALUE(blocks_ok, kLoadTable, ": '", path, "': shard ", s, "'s blocks ",
                    c10::IntArrayRef(shard.blocks), " do not split its rows [", first, ", ", end,
                    ")");
  return shard;
}

std::string describe(const SavedShard& shard) {
  return shard.has_state ? c10::str("counted ", shard.step, " steps (buffers ",
                                    c10::Join(", ", shard.buffers), ")")
                         : std::string("has no optimizer state");
}

}  // namespace

void save_sharded_table(const std::string& directory, const rpc::ShardedEmbeddingBag& table,
                        DistributedOptimizer& optimizer, int64_t rows_per_file) {
  TORCH_CHECK_VALUE(rows_per_file >= 0, kSaveTable, ": rows_per_file is ", rows_per_file,
                    "; it must be 0 (64 MiB of rows) or more");
  const std::vector<OwnerOptimizer> owners = detail::OwnerAccess::owners(optimizer);
  const std::vector<ShardSlot> slots = shard_slots(owners, table, kSaveTable);
  const rpc::ShardedEmbeddingBagOptions& options = table.options();
  if (rows_per_file == 0) {
    const int64_t row_bytes =
        options.embedding_dim() * static_cast<int64_t>(c10::elementSize(options.dtype()));
    rows_per_file = std::max<int64_t>(1, kDefaultBlockBytes / row_bytes);
  }
  // The owners resolve the path themselves: an absolute one names the same directory for all.
  const std::string absolute = fs::absolute(directory).string();
  std::error_code error;
  fs::create_directories(absolute, error);
  TORCH_CHECK(!error, kSaveTable, ": cannot create the directory '", directory,
              "': ", error.message());
  // Without a manifest the directory is no checkpoint while its blocks are being replaced.
  fs::remove(manifest_path(absolute), error);
  TORCH_CHECK(!error, kSaveTable, ": cannot remove the old '", manifest_path(directory),
              "': ", error.message());
  const size_t shards = table.num_shards();
  std::vector<rpc::RpcFuture<c10::IValue>> writes;
  std::vector<int64_t> first_rows;
  for (size_t s = 0; s < shards; ++s) {
    first_rows.push_back(table.shard_rows(s).first);
    writes.push_back(
        detail::waited_method(owners[slots[s].owner].optimizer, "save_table_rows",
                              {absolute, slots[s].index, static_cast<int64_t>(s),
                               static_cast<int64_t>(shards), first_rows.back(), rows_per_file}));
  }
  first_rows.push_back(options.num_embeddings());
  const auto shard_worker = [&](size_t s) -> const std::string& { return options.workers()[s]; };
  const std::vector<c10::IValue> summaries =
      detail::wait_all(writes, shard_worker, std::string(kSaveTable) + " (the shards' files)");
  c10::impl::GenericList entries(c10::AnyType::get());
  for (size_t s = 0; s < shards; ++s) {
    // An owner's reply, checked as a manifest's entry is (it becomes one).
    entries.push_back(shard_entry(saved_shard(summaries[s], s, first_rows[s], first_rows[s + 1],
                                              "the reply of worker '" + shard_worker(s) + "'")));
  }
  GenericDict manifest(c10::StringType::get(), c10::AnyType::get());
  manifest.insert("format", std::string(kManifestFormat));
  manifest.insert("version", detail::kTableCheckpointVersion);
  manifest.insert("optimizer", optimizer.optimizer());
  manifest.insert("num_embeddings", options.num_embeddings());
  manifest.insert("embedding_dim", options.embedding_dim());
  manifest.insert("dtype", static_cast<int64_t>(options.dtype()));
  manifest.insert("first_rows", c10::List<int64_t>(first_rows));
  manifest.insert("shards", entries);
  optim::detail::write_pickle_file(manifest_path(absolute), manifest, kSaveTable);
}

void load_sharded_table(const std::string& directory, rpc::ShardedEmbeddingBag& table,
                        DistributedOptimizer& optimizer) {
  const std::string absolute = fs::absolute(directory).string();
  const std::string path = manifest_path(directory);
  const GenericDict manifest =
      detail::dict_of(optim::detail::read_pickle_file(path, kLoadTable), path);
  detail::check_format(manifest, kManifestFormat, path);
  const rpc::ShardedEmbeddingBagOptions& options = table.options();
  const int64_t rows = int_field(manifest, "num_embeddings", path);
  const int64_t dim = int_field(manifest, "embedding_dim", path);
  const int64_t dtype = int_field(manifest, "dtype", path);
  TORCH_CHECK_VALUE(rows == options.num_embeddings() && dim == options.embedding_dim() &&
                        dtype == static_cast<int64_t>(options.dtype()),
                    kLoadTable, ": '", path, "' holds a table of ", rows, " x ", dim, " (dtype ",
                    dtype, "), this table is ", options.num_embeddings(), " x ",
                    options.embedding_dim(), " (dtype ", static_cast<int64_t>(options.dtype()),
                    ")");
  const c10::IValue& name = field(manifest, "optimizer", path);
  TORCH_CHECK_VALUE(name.isString(), kLoadTable, ": '", path, "': 'optimizer' is no string");
  TORCH_CHECK_VALUE(name.toStringRef() == optimizer.optimizer(), kLoadTable, ": '", path,
                    "' holds the state of optimizer '", name.toStringRef(), "', this one is '",
                    optimizer.optimizer(), "'");
  const std::vector<int64_t> first_rows = int_list_field(manifest, "first_rows", path);
  bool ranges_ok = first_rows.size() >= 2 && first_rows.front() == 0 && first_rows.back() == rows;
  for (size_t s = 1; ranges_ok && s < first_rows.size(); ++s) {
    ranges_ok = first_rows[s - 1] < first_rows[s];
  }
  TORCH_CHECK_VALUE(ranges_ok, kLoadTable, ": '", path, "': shard ranges ",
                    c10::IntArrayRef(first_rows), " do not split ", rows, " rows");
  const size_t saved_shards = first_rows.size() - 1;
  const c10::IValue& shard_list = field(manifest, "shards", path);
  TORCH_CHECK_VALUE(shard_list.isList() && shard_list.toListRef().size() == saved_shards,
                    kLoadTable, ": '", path, "': 'shards' is not a list of ", saved_shards,
                    " entries");
  std::vector<SavedShard> saved;
  for (size_t s = 0; s < saved_shards; ++s) {
    saved.push_back(
        saved_shard(shard_list.toListRef()[s], s, first_rows[s], first_rows[s + 1], path));
  }
  const std::vector<OwnerOptimizer> owners = detail::OwnerAccess::owners(optimizer);
  const std::vector<ShardSlot> slots = shard_slots(owners, table, kLoadTable);
  bool same_split = saved_shards == table.num_shards();
  for (size_t s = 0; same_split && s < saved_shards; ++s) {
    same_split = table.shard_rows(s).first == first_rows[s];
  }
  if (!same_split) {
    // Rows of several saved shards may land in one: they must agree on everything but rows.
    for (size_t s = 1; s < saved_shards; ++s) {
      TORCH_CHECK_VALUE(saved[s].has_state == saved[0].has_state &&
                            saved[s].step == saved[0].step && saved[s].buffers == saved[0].buffers,
                        kLoadTable, ": '", path, "': shard ", s, " ", describe(saved[s]),
                        ", shard 0 ", describe(saved[0]),
                        ": their rows cannot share one optimizer state, so this "
                        "checkpoint loads only into ",
                        saved_shards, " shards");
    }
  }
  // Every owner reads and checks the blocks of its rows; only when all have, do they load them.
  std::vector<rpc::RpcFuture<c10::IValue>> stages;
  for (size_t s = 0; s < table.num_shards(); ++s) {
    const auto [first, end] = table.shard_rows(s);
    c10::impl::GenericList blocks(c10::AnyType::get());
    for (size_t t = 0; t < saved_shards; ++t) {
      const std::vector<int64_t>& firsts = saved[t].blocks;
      for (size_t b = 0; b + 1 < firsts.size(); ++b) {
        if (firsts[b + 1] <= first || firsts[b] >= end) continue;
        c10::impl::GenericList block(c10::AnyType::get());
        block.push_back(detail::block_path(absolute, t, saved_shards, b));
        block.push_back(static_cast<int64_t>(t));
        block.push_back(firsts[b]);
        block.push_back(firsts[b + 1]);
        blocks.push_back(block);
      }
    }
    const SavedShard& like = saved[same_split ? s : 0];
    stages.push_back(detail::waited_method(owners[slots[s].owner].optimizer, "stage_table_rows",
                                           {slots[s].index, first, blocks, like.has_state,
                                            like.step, c10::List<std::string>(like.buffers)}));
  }
  const auto shard_worker = [&](size_t s) -> const std::string& { return options.workers()[s]; };
  const detail::Replies staged = detail::wait_each(stages, shard_worker);
  auto each_shard = [&](const char* method) {
    std::vector<rpc::RpcFuture<c10::IValue>> calls;
    for (const ShardSlot& slot : slots) {
      calls.push_back(detail::waited_method(owners[slot.owner].optimizer, method, {slot.index}));
    }
    return calls;
  };
  if (staged.first) {
    // Nothing changed: the owners forget what they read (a failure to do so is reported less
    // than the one that stopped the load).
    detail::wait_each(each_shard("drop_table_rows"), shard_worker);
    detail::throw_if_failed(staged, std::string(kLoadTable) + " (reading the shards' files)");
  }
  detail::wait_all(each_shard("commit_table_rows"), shard_worker,
                   std::string(kLoadTable) + " (loading the shards)");
}

}  // namespace dist_optim
}  // namespace distoptim
