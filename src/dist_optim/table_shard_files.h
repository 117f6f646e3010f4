#pragma once

// The files of a sharded table's checkpoint (sharded_table_checkpoint.h) that each shard's owner
// writes and reads itself: its rows and their optimizer state in blocks of at most a given number
// of rows, one file per block, so that an owner loading another split reads only the blocks that
// overlap the rows it will own. Also the checked reading of the fields of any of the checkpoint's
// dicts, which the manifest shares.
//
// A block file is a LibTorch pickle of a dict (Python's torch.load reads it) written atomically
// and checked on load as every checkpoint file of the library is (optim::detail's
// write_pickle_file / read_pickle_file: headers, every record's CRC-32): format, version, shard,
// first_row, end_row (the table's rows it holds), rows, has_state, step and buffers (each
// optimizer buffer's rows, by name).

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <distoptim/optim/functional_optimizer.h>

namespace distoptim {
namespace dist_optim {
namespace detail {

constexpr const char* kSaveTable = "save_sharded_table";
constexpr const char* kLoadTable = "load_sharded_table";
/// Version 2: shards written by their owners in blocks, the shards' state in the manifest.
constexpr int64_t kTableCheckpointVersion = 2;

/// Some rows of a table and their optimizer state, copied out of a shard or read from blocks.
struct TableRows {
  at::Tensor rows;  // [rows, dim]
  bool has_state = false;
  optim::OptimizerStateDict::State state;  // buffers of as many rows, by name
};

/// DIRECTORY/shard-S-of-N.block-B.pt
std::string block_path(const std::string& directory, int64_t shard, int64_t shards, int64_t block);

/// Writes `part`, rows [first_row, first_row + part.rows.size(0)) of the table and shard `shard`
/// of `shards`, as blocks of at most `rows_per_file` rows in `directory` (which must exist).
/// Returns the first row of each block, then the shard's end. Errors: c10::Error naming the file
/// that could not be written (kSaveTable's).
std::vector<int64_t> write_shard_blocks(const std::string& directory, int64_t shard, int64_t shards,
                                        int64_t first_row, const TableRows& part,
                                        int64_t rows_per_file);

/// One block file a load reads: who wrote it and which rows of the table it holds.
struct BlockFile {
  std::string path;
  int64_t shard = 0;
  int64_t first_row = 0;
  int64_t end_row = 0;
};

/// Reads rows [first_row, end_row) of the table from `blocks`, which hold them in row order,
/// each block read, checked and copied into the result before the next is read (so this process
/// holds the result and one block). Every block must hold what the manifest said of its shard:
/// `has_state`, `step` and the buffers `buffer_names`. Errors: c10::Error / c10::ValueError
/// (kLoadTable's) naming the file and what is wrong with it.
TableRows read_block_rows(const std::vector<BlockFile>& blocks, int64_t first_row, int64_t end_row,
                          int64_t dim, c10::ScalarType dtype, bool has_state, int64_t step,
                          const std::vector<std::string>& buffer_names);

/// The checked reading of a checkpoint dict's fields: errors are c10::ValueError
/// "load_sharded_table: 'PATH' ..." naming the field.
c10::impl::GenericDict dict_of(const c10::IValue& value, const std::string& path);
const c10::IValue& field(const c10::impl::GenericDict& dict, const char* key,
                         const std::string& path);
int64_t int_field(const c10::impl::GenericDict& dict, const char* key, const std::string& path);
bool bool_field(const c10::impl::GenericDict& dict, const char* key, const std::string& path);
std::vector<int64_t> int_list_field(const c10::impl::GenericDict& dict, const char* key,
                                    const std::string& path);
std::vector<std::string> string_list_field(const c10::impl::GenericDict& dict, const char* key,
                                           const std::string& path);
/// The dict's format is `format` and its version this library's.
void check_format(const c10::impl::GenericDict& dict, const char* format, const std::string& path);

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
