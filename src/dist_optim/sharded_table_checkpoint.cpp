#include <distoptim/dist_optim/sharded_table_checkpoint.h>

#include <cstddef>
#include <filesystem>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <c10/util/Exception.h>

#include "checkpoint_file.h"

namespace distoptim {
namespace dist_optim {

namespace {

namespace fs = std::filesystem;
using c10::impl::GenericDict;

constexpr const char* kSave = "save_sharded_table";
constexpr const char* kLoad = "load_sharded_table";
constexpr const char* kManifestFormat = "distoptim.sharded_table.manifest";
constexpr const char* kShardFormat = "distoptim.sharded_table.shard";
constexpr int64_t kVersion = 1;

std::string manifest_path(const std::string& directory) {
  return (fs::path(directory) / "manifest.pt").string();
}

std::string shard_path(const std::string& directory, size_t shard, size_t shards) {
  return (fs::path(directory) / c10::str("shard-", shard, "-of-", shards, ".pt")).string();
}

// Where the state of the table's shard s lives in a DistributedOptimizer's state dict: owner
// `owner`, parameter `index` of that owner's.
struct StateSlot {
  size_t owner = 0;
  int64_t index = -1;
};

// One slot per shard; the optimizer must be built over table.remote_parameters() (positions 0 to
// shards - 1, in shard order, each on its shard's worker).
std::vector<StateSlot> state_slots(const DistributedOptimizerStateDict& dict,
                                   const rpc::ShardedEmbeddingBag& table, const char* caller) {
  const size_t shards = table.num_shards();
  const std::vector<std::string>& workers = table.options().workers();
  size_t params = 0;
  for (const auto& owner : dict.owners) params += owner.positions.size();
  TORCH_CHECK_VALUE(params == shards, caller, ": the optimizer has ", params,
                    " parameters, the table ", shards,
                    " shards (build it over table.remote_parameters() alone)");
  std::vector<StateSlot> slots(shards);
  for (size_t k = 0; k < dict.owners.size(); ++k) {
    const auto& owner = dict.owners[k];
    for (size_t i = 0; i < owner.positions.size(); ++i) {
      const int64_t position = owner.positions[i];
      TORCH_CHECK_VALUE(position >= 0 && static_cast<size_t>(position) < shards &&
                            owner.worker == workers[position],
                        caller, ": the optimizer's parameter ", position, " is on worker '",
                        owner.worker, "', which holds no shard ", position,
                        " of the table (build the optimizer over table.remote_parameters())");
      slots[position] = StateSlot{k, static_cast<int64_t>(i)};
    }
  }
  return slots;
}

GenericDict dict_of(const c10::IValue& value, const std::string& path) {
  TORCH_CHECK_VALUE(value.isGenericDict(), kLoad, ": '", path, "' holds no dict but ",
                    value.tagKind());
  return value.toGenericDict();
}

const c10::IValue& field(const GenericDict& dict, const char* key, const std::string& path) {
  auto it = dict.find(key);
  TORCH_CHECK_VALUE(it != dict.end(), kLoad, ": '", path, "' has no '", key, "'");
  return it->value();
}

int64_t int_field(const GenericDict& dict, const char* key, const std::string& path) {
  const c10::IValue& value = field(dict, key, path);
  TORCH_CHECK_VALUE(value.isInt(), kLoad, ": '", path, "': '", key, "' is ", value.tagKind(),
                    ", not an int");
  return value.toInt();
}

void check_format(const GenericDict& dict, const char* format, const std::string& path) {
  const c10::IValue& value = field(dict, "format", path);
  TORCH_CHECK_VALUE(value.isString() && value.toStringRef() == format, kLoad, ": '", path,
                    "' is not a ", format, " file");
  const int64_t version = int_field(dict, "version", path);
  TORCH_CHECK_VALUE(version == kVersion, kLoad, ": '", path, "' has version ", version,
                    "; this library reads version ", kVersion);
}

// One shard's part of a checkpoint.
struct ShardPart {
  at::Tensor rows;
  optim::OptimizerStateDict::State state;
  bool has_state = false;
};

ShardPart read_shard(const std::string& path, size_t shard, int64_t first, int64_t end, int64_t dim,
                     c10::ScalarType dtype) {
  const GenericDict dict = dict_of(optim::detail::read_pickle_file(path, kLoad), path);
  check_format(dict, kShardFormat, path);
  const int64_t index = int_field(dict, "shard", path);
  const int64_t file_first = int_field(dict, "first_row", path);
  const int64_t file_end = int_field(dict, "end_row", path);
  TORCH_CHECK_VALUE(index == static_cast<int64_t>(shard) && file_first == first && file_end == end,
                    kLoad, ": '", path, "' is shard ", index, " with rows [", file_first, ", ",
                    file_end, "); the manifest names shard ", shard, " with rows [", first, ", ",
                    end, ")");
  auto expect_rows = [&](const c10::IValue& value, const std::string& what) {
    TORCH_CHECK_VALUE(value.isTensor(), kLoad, ": '", path, "': ", what, " is not a tensor");
    const at::Tensor& t = value.toTensor();
    TORCH_CHECK_VALUE(t.layout() == c10::kStrided && t.dim() == 2 && t.size(0) == end - first &&
                          t.size(1) == dim && t.scalar_type() == dtype,
                      kLoad, ": '", path, "': ", what, " has shape ", t.sizes(), " and dtype ",
                      t.scalar_type(), "; shard ", shard, " holds ", end - first, " rows of ", dim,
                      " ", dtype);
    return t;
  };
  ShardPart part;
  part.rows = expect_rows(field(dict, "rows", path), "'rows'");
  const c10::IValue& has_state = field(dict, "has_state", path);
  TORCH_CHECK_VALUE(has_state.isBool(), kLoad, ": '", path, "': 'has_state' is no bool");
  part.has_state = has_state.toBool();
  part.state.step = int_field(dict, "step", path);
  const c10::IValue& buffers = field(dict, "buffers", path);
  TORCH_CHECK_VALUE(buffers.isGenericDict(), kLoad, ": '", path, "': 'buffers' is no dict");
  for (const auto& entry : buffers.toGenericDict()) {
    TORCH_CHECK_VALUE(entry.key().isString(), kLoad, ": '", path, "': a buffer name is no string");
    const std::string name = entry.key().toStringRef();
    part.state.buffers[name] = expect_rows(entry.value(), "buffer '" + name + "'");
  }
  return part;
}

}  // namespace

void save_sharded_table(const std::string& directory, const rpc::ShardedEmbeddingBag& table,
                        DistributedOptimizer& optimizer) {
  const DistributedOptimizerStateDict state = optimizer.state_dict();
  const std::vector<StateSlot> slots = state_slots(state, table, kSave);
  const at::Tensor weight = table.weight();
  std::error_code error;
  fs::create_directories(directory, error);
  TORCH_CHECK(!error, kSave, ": cannot create the directory '", directory, "': ", error.message());
  const size_t shards = table.num_shards();
  std::vector<int64_t> first_rows;
  for (size_t s = 0; s < shards; ++s) {
    const auto [first, end] = table.shard_rows(s);
    first_rows.push_back(first);
    GenericDict shard(c10::StringType::get(), c10::AnyType::get());
    shard.insert("format", std::string(kShardFormat));
    shard.insert("version", kVersion);
    shard.insert("shard", static_cast<int64_t>(s));
    shard.insert("first_row", first);
    shard.insert("end_row", end);
    // A copy: a slice would be saved with the whole table's storage.
    shard.insert("rows", weight.slice(0, first, end).clone());
    const auto& owner_state = state.owners[slots[s].owner].state.state;
    const auto it = owner_state.find(slots[s].index);
    shard.insert("has_state", it != owner_state.end());
    shard.insert("step", it == owner_state.end() ? int64_t{0} : it->second.step);
    c10::Dict<std::string, at::Tensor> buffers;
    if (it != owner_state.end()) {
      for (const auto& [name, buffer] : it->second.buffers) buffers.insert(name, buffer);
    }
    shard.insert("buffers", buffers);
    optim::detail::write_pickle_file(shard_path(directory, s, shards), shard, kSave);
  }
  first_rows.push_back(table.options().num_embeddings());
  GenericDict manifest(c10::StringType::get(), c10::AnyType::get());
  manifest.insert("format", std::string(kManifestFormat));
  manifest.insert("version", kVersion);
  manifest.insert("optimizer", state.optimizer);
  manifest.insert("num_embeddings", table.options().num_embeddings());
  manifest.insert("embedding_dim", table.options().embedding_dim());
  manifest.insert("dtype", static_cast<int64_t>(table.options().dtype()));
  manifest.insert("first_rows", c10::List<int64_t>(first_rows));
  optim::detail::write_pickle_file(manifest_path(directory), manifest, kSave);
}

void load_sharded_table(const std::string& directory, rpc::ShardedEmbeddingBag& table,
                        DistributedOptimizer& optimizer) {
  const std::string path = manifest_path(directory);
  const GenericDict manifest = dict_of(optim::detail::read_pickle_file(path, kLoad), path);
  check_format(manifest, kManifestFormat, path);
  const rpc::ShardedEmbeddingBagOptions& options = table.options();
  const int64_t rows = int_field(manifest, "num_embeddings", path);
  const int64_t dim = int_field(manifest, "embedding_dim", path);
  const int64_t dtype = int_field(manifest, "dtype", path);
  TORCH_CHECK_VALUE(rows == options.num_embeddings() && dim == options.embedding_dim() &&
                        dtype == static_cast<int64_t>(options.dtype()),
                    kLoad, ": '", path, "' holds a table of ", rows, " x ", dim, " (dtype ", dtype,
                    "), this table is ", options.num_embeddings(), " x ", options.embedding_dim(),
                    " (dtype ", static_cast<int64_t>(options.dtype()), ")");
  DistributedOptimizerStateDict state = optimizer.state_dict();
  const c10::IValue& name = field(manifest, "optimizer", path);
  TORCH_CHECK_VALUE(name.isString(), kLoad, ": '", path, "': 'optimizer' is no string");
  TORCH_CHECK_VALUE(name.toStringRef() == state.optimizer, kLoad, ": '", path,
                    "' holds the state of optimizer '", name.toStringRef(), "', this one is '",
                    state.optimizer, "'");
  const c10::IValue& first_value = field(manifest, "first_rows", path);
  TORCH_CHECK_VALUE(first_value.isIntList(), kLoad, ": '", path, "': 'first_rows' is no int list");
  const std::vector<int64_t> first_rows = first_value.toIntVector();
  bool ranges_ok = first_rows.size() >= 2 && first_rows.front() == 0 && first_rows.back() == rows;
  for (size_t s = 1; ranges_ok && s < first_rows.size(); ++s) {
    ranges_ok = first_rows[s - 1] < first_rows[s];
  }
  TORCH_CHECK_VALUE(ranges_ok, kLoad, ": '", path, "': shard ranges ", c10::IntArrayRef(first_rows),
                    " do not split ", rows, " rows");
  const size_t saved_shards = first_rows.size() - 1;
  std::vector<ShardPart> parts;
  for (size_t s = 0; s < saved_shards; ++s) {
    parts.push_back(read_shard(shard_path(directory, s, saved_shards), s, first_rows[s],
                               first_rows[s + 1], dim, options.dtype()));
  }
  const std::vector<StateSlot> slots = state_slots(state, table, kLoad);
  bool same_split = saved_shards == table.num_shards();
  for (size_t s = 0; same_split && s < saved_shards; ++s) {
    same_split = table.shard_rows(s).first == first_rows[s];
  }
  if (!same_split) {
    // Rows of several saved shards may land in one: they must agree on everything but rows.
    for (size_t s = 1; s < saved_shards; ++s) {
      std::set<std::string> names, first_names;
      for (const auto& entry : parts[s].state.buffers) names.insert(entry.first);
      for (const auto& entry : parts[0].state.buffers) first_names.insert(entry.first);
      TORCH_CHECK_VALUE(
          parts[s].has_state == parts[0].has_state && parts[s].state.step == parts[0].state.step &&
              names == first_names,
          kLoad, ": '", shard_path(directory, s, saved_shards), "' counted ", parts[s].state.step,
          " steps, '", shard_path(directory, 0, saved_shards), "' ", parts[0].state.step,
          " (or they hold different buffers): their rows cannot share one optimizer state, so "
          "this checkpoint loads only into ",
          saved_shards, " shards");
    }
  }
  std::vector<at::Tensor> row_parts;
  for (const ShardPart& part : parts) row_parts.push_back(part.rows);
  const at::Tensor weight = at::cat(row_parts);
  std::map<std::string, at::Tensor> buffers;
  for (const auto& entry : parts[0].state.buffers) {
    std::vector<at::Tensor> pieces;
    for (const ShardPart& part : parts) pieces.push_back(part.state.buffers.at(entry.first));
    buffers[entry.first] = at::cat(pieces);
  }
  for (size_t s = 0; s < table.num_shards(); ++s) {
    const auto [first, end] = table.shard_rows(s);
    const ShardPart& like = parts[same_split ? s : 0];
    auto& owner_state = state.owners[slots[s].owner].state.state;
    if (!like.has_state) {
      owner_state.erase(slots[s].index);
      continue;
    }
    optim::OptimizerStateDict::State shard_state;
    shard_state.step = like.state.step;
    for (const auto& entry : (same_split ? like.state.buffers : buffers)) {
      shard_state.buffers[entry.first] =
          same_split ? entry.second : entry.second.slice(0, first, end).clone();
    }
    owner_state[slots[s].index] = std::move(shard_state);
  }
  table.load_weight(weight);
  optimizer.load_state_dict(state);
}

}  // namespace dist_optim
}  // namespace distoptim
