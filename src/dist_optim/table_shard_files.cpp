#include "table_shard_files.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "checkpoint_file.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

namespace {

using c10::impl::GenericDict;

constexpr const char* kBlockFormat = "distoptim.sharded_table.block";

// A block's dict; its tensors are copies, so that the pickle does not carry the whole shard's
// storage with each slice.
GenericDict block_dict(int64_t shard, int64_t first, int64_t end, int64_t shard_first,
                       const TableRows& part) {
  GenericDict block(c10::StringType::get(), c10::AnyType::get());
  block.insert("format", std::string(kBlockFormat));
  block.insert("version", kTableCheckpointVersion);
  block.insert("shard", shard);
  block.insert("first_row", first);
  block.insert("end_row", end);
  block.insert("rows", part.rows.slice(0, first - shard_first, end - shard_first).clone());
  block.insert("has_state", part.has_state);
  block.insert("step", part.state.step);
  c10::Dict<std::string, at::Tensor> buffers;
  for (const auto& [name, buffer] : part.state.buffers) {
    buffers.insert(name, buffer.slice(0, first - shard_first, end - shard_first).clone());
  }
  block.insert("buffers", buffers);
  return block;
}

// The tensor of a block's `value`: [end - first, dim] of `dtype`, strided.
const at::Tensor& block_tensor(const c10::IValue& value, const std::string& what,
                               const BlockFile& block, int64_t dim, c10::ScalarType dtype) {
  TORCH_CHECK_VALUE(value.isTensor(), kLoadTable, ": '", block.path, "': ", what,
                    " is not a tensor");
  const at::Tensor& t = value.toTensor();
  const int64_t rows = block.end_row - block.first_row;
  TORCH_CHECK_VALUE(t.layout() == c10::kStrided && t.dim() == 2 && t.size(0) == rows &&
                        t.size(1) == dim && t.scalar_type() == dtype,
                    kLoadTable, ": '", block.path, "': ", what, " has shape ", t.sizes(),
                    " and dtype ", t.scalar_type(), "; the block holds ", rows, " rows of ", dim,
                    " ", dtype);
  return t;
}

}  // namespace

std::string block_path(const std::string& directory, int64_t shard, int64_t shards, int64_t block) {
  return (std::filesystem::path(directory) /
          c10::str("shard-", shard, "-of-", shards, ".block-", block, ".pt"))
      .string();
}

std::vector<int64_t> write_shard_blocks(const std::string& directory, int64_t shard, int64_t shards,
                                        int64_t first_row, const TableRows& part,
                                        int64_t rows_per_file) {
  TORCH_INTERNAL_ASSERT(rows_per_file > 0);
  const int64_t end_row = first_row + part.rows.size(0);
  std::vector<int64_t> firsts;
  for (int64_t first = first_row; first < end_row; first += rows_per_file) {
    const int64_t end = std::min(end_row, first + rows_per_file);
    optim::detail::write_pickle_file(
        block_path(directory, shard, shards, static_cast<int64_t>(firsts.size())),
        block_dict(shard, first, end, first_row, part), kSaveTable);
    firsts.push_back(first);
  }
  firsts.push_back(end_row);
  return firsts;
}

TableRows read_block_rows(const std::vector<BlockFile>& blocks, int64_t first_row, int64_t end_row,
                          int64_t dim, c10::ScalarType dtype, bool has_state, int64_t step,
                          const std::vector<std::string>& buffer_names) {
  TORCH_INTERNAL_ASSERT(!blocks.empty() && blocks.front().first_row <= first_row &&
                        blocks.back().end_row >= end_row);
  TableRows out;
  out.rows = at::empty({end_row - first_row, dim}, at::TensorOptions().dtype(dtype));
  out.has_state = has_state;
  out.state.step = has_state ? step : 0;
  if (has_state) {
    for (const std::string& name : buffer_names) out.state.buffers[name] = at::empty_like(out.rows);
  }
  for (const BlockFile& block : blocks) {
    const GenericDict dict =
        dict_of(optim::detail::read_pickle_file(block.path, kLoadTable), block.path);
    check_format(dict, kBlockFormat, block.path);
    const int64_t shard = int_field(dict, "shard", block.path);
    const int64_t first = int_field(dict, "first_row", block.path);
    const int64_t end = int_field(dict, "end_row", block.path);
    TORCH_CHECK_VALUE(shard == block.shard && first == block.first_row && end == block.end_row,
                      kLoadTable, ": '", block.path, "' is a block of shard ", shard,
                      " with rows [", first, ", ", end, "); the manifest names a block of shard ",
                      block.shard, " with rows [", block.first_row, ", ", block.end_row, ")");
    const bool file_has_state = bool_field(dict, "has_state", block.path);
    const int64_t file_step = int_field(dict, "step", block.path);
    const c10::IValue& buffers = field(dict, "buffers", block.path);
    TORCH_CHECK_VALUE(buffers.isGenericDict(), kLoadTable, ": '", block.path,
                      "': 'buffers' is no dict");
    std::vector<std::string> names;
    for (const auto& entry : buffers.toGenericDict()) {
      TORCH_CHECK_VALUE(entry.key().isString(), kLoadTable, ": '", block.path,
                        "': a buffer name is no string");
      names.push_back(entry.key().toStringRef());
    }
    std::vector<std::string> expected_names = has_state ? buffer_names : std::vector<std::string>{};
    std::sort(names.begin(), names.end());
    std::sort(expected_names.begin(), expected_names.end());
    TORCH_CHECK_VALUE(
        file_has_state == has_state && (!has_state || file_step == step) && names == expected_names,
        kLoadTable, ": '", block.path, "' holds ",
        file_has_state ? "the state of step " + std::to_string(file_step)
                       : std::string("no optimizer state"),
        " with buffers ", c10::Join(", ", names), "; the manifest says shard ", block.shard,
        " has ",
        has_state ? "the state of step " + std::to_string(step) : std::string("no optimizer state"),
        " with buffers ", c10::Join(", ", expected_names));
    // The rows of this block that [first_row, end_row) takes.
    const int64_t from = std::max(first, first_row), to = std::min(end, end_row);
    if (from >= to) continue;
    auto take = [&](const at::Tensor& source, at::Tensor& target) {
      target.slice(0, from - first_row, to - first_row)
          .copy_(source.slice(0, from - first, to - first));
    };
    take(block_tensor(field(dict, "rows", block.path), "'rows'", block, dim, dtype), out.rows);
    for (const auto& entry : buffers.toGenericDict()) {
      const std::string& name = entry.key().toStringRef();
      take(block_tensor(entry.value(), "buffer '" + name + "'", block, dim, dtype),
           out.state.buffers.at(name));
    }
  }
  return out;
}

GenericDict dict_of(const c10::IValue& value, const std::string& path) {
  TORCH_CHECK_VALUE(value.isGenericDict(), kLoadTable, ": '", path, "' holds no dict but ",
                    value.tagKind());
  return value.toGenericDict();
}

const c10::IValue& field(const GenericDict& dict, const char* key, const std::string& path) {
  auto it = dict.find(key);
  TORCH_CHECK_VALUE(it != dict.end(), kLoadTable, ": '", path, "' has no '", key, "'");
  return it->value();
}

int64_t int_field(const GenericDict& dict, const char* key, const std::string& path) {
  const c10::IValue& value = field(dict, key, path);
  TORCH_CHECK_VALUE(value.isInt(), kLoadTable, ": '", path, "': '", key, "' is ", value.tagKind(),
                    ", not an int");
  return value.toInt();
}

bool bool_field(const GenericDict& dict, const char* key, const std::string& path) {
  const c10::IValue& value = field(dict, key, path);
  TORCH_CHECK_VALUE(value.isBool(), kLoadTable, ": '", path, "': '", key, "' is ", value.tagKind(),
                    ", not a bool");
  return value.toBool();
}

std::vector<int64_t> int_list_field(const GenericDict& dict, const char* key,
                                    const std::string& path) {
  const c10::IValue& value = field(dict, key, path);
  if (value.isIntList()) return value.toIntVector();
  // A list that crossed the wire arrives as a list of values.
  TORCH_CHECK_VALUE(value.isList(), kLoadTable, ": '", path, "': '", key, "' is ", value.tagKind(),
                    ", not an int list");
  std::vector<int64_t> out;
  for (const c10::IValue& item : value.toListRef()) {
    TORCH_CHECK_VALUE(item.isInt(), kLoadTable, ": '", path, "': '", key, "' holds ",
                      item.tagKind(), ", not an int");
    out.push_back(item.toInt());
  }
  return out;
}

std::vector<std::string> string_list_field(const GenericDict& dict, const char* key,
                                           const std::string& path) {
  const c10::IValue& value = field(dict, key, path);
  TORCH_CHECK_VALUE(value.isList(), kLoadTable, ": '", path, "': '", key, "' is ", value.tagKind(),
                    ", not a list");
  std::vector<std::string> out;
  for (const c10::IValue& item : value.toListRef()) {
    TORCH_CHECK_VALUE(item.isString(), kLoadTable, ": '", path, "': '", key, "' holds ",
                      item.tagKind(), ", not a string");
    out.push_back(item.toStringRef());
  }
  return out;
}

void check_format(const GenericDict& dict, const char* format, const std::string& path) {
  const c10::IValue& value = field(dict, "format", path);
  TORCH_CHECK_VALUE(value.isString() && value.toStringRef() == format, kLoadTable, ": '", path,
                    "' is not a ", format, " file");
  const int64_t version = int_field(dict, "version", path);
  TORCH_CHECK_VALUE(version == kTableCheckpointVersion, kLoadTable, ": '", path, "' has version ",
                    version, "; this library reads version ", kTableCheckpointVersion);
}

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
