#pragma once

// The files of a snapshot (snapshot.h) that the parameters' owners write and read themselves: a
// table's shard in blocks of at most a given number of rows, one file per block, so that an
// owner loading another split reads only the blocks that overlap the rows it will own; and one
// file per owner with its other parameters. Also the checked reading of the fields of a
// snapshot's dicts, which the manifest shares.
//
// Every file is a LibTorch pickle of a dict (Python's torch.load reads it) written atomically and
// checked on load as every checkpoint file of the library is (optim::detail's write_pickle_file /
// read_pickle_file: headers, every record's CRC-32).
// - A block: format, version, shard, first_row, end_row (the table's rows it holds), rows,
//   has_state, step, buffers (names) and buffers_values (each buffer's rows, by name).
// - A collisionless table's block: format, version, shard, ids (1-D int64), rows (the ids' rows),
//   has_state, step, buffers and buffers_values (the ids' rows of each buffer).
// - An owner's parameters: format, version, params: a list of dicts with dense_index (the
//   parameter's order among the DistributedOptimizer's parameters that are no table's shard),
//   rows (its value), has_state, step, buffers (names) and buffers_values.

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <distoptim/optim/functional_optimizer.h>

#include "checkpoint_file.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

constexpr const char* kSaveSnapshot = "save_snapshot";
constexpr const char* kLoadSnapshot = "load_snapshot";
constexpr int64_t kSnapshotVersion = 1;

/// A parameter's value (or some rows of a table) and its optimizer state, copied out of an
/// optimizer or read from files.
struct ParamCopy {
  at::Tensor value;
  /// A collisionless table's live rows: each row's id (1-D int64); undefined otherwise.
  at::Tensor ids;
  bool has_state = false;
  optim::OptimizerStateDict::State state;  // buffers shaped as `value`, by name
};

/// Runs `work` on a thread of its own at a low CPU priority (nice 10), on one CPU (the last the
/// process may run on), and waits for it, rethrowing what it throws: a snapshot's writing, and
/// the first touch of its copies' fresh memory (on a virtual machine a fresh page costs far more
/// than its copy: 2.56 GB took about 5 s here), then yield to the owner's requests and the
/// trainers beside it instead of delaying their steps, yet keep about a tenth of a core the
/// others contend for (nice 19 would keep a sixtieth, and a busy server might then not finish a
/// snapshot for minutes). Threads the work starts inherit both.
void run_at_low_priority(const std::function<void()>& work);

/// run_at_low_priority's thread for work beside the caller's: started by the constructor,
/// waited for by join(), which rethrows what the work threw (the destructor waits and drops it).
class LowPriorityThread {
 public:
  explicit LowPriorityThread(std::function<void()> work);
  ~LowPriorityThread();
  LowPriorityThread(const LowPriorityThread&) = delete;
  LowPriorityThread& operator=(const LowPriorityThread&) = delete;
  void join();

 private:
  std::exception_ptr failure_;
  std::thread thread_;
};

/// How many of a shard's rows an owner has copied for a snapshot, so that the shard's first
/// blocks are written while it copies the rest (under its locks, the steps waiting), and the
/// CRC-32s it took of its copy's pieces on the way (the files' writer reads no byte of them again).
class RowsCopied {
 public:
  /// The first `rows` rows are copied, and `crcs` taken of pieces of the copy.
  void advance(int64_t rows, const optim::detail::KnownCrcs& crcs = {});
  /// The copy stopped short (it failed): every wait returns false.
  void abandon();
  /// Waits until the first `rows` rows are copied: true, or false once the copy is abandoned.
  /// The copy runs on the caller's process under no lock a writer holds, so it ends either way.
  bool wait_for(int64_t rows) const;
  /// The CRC-32s taken so far.
  optim::detail::KnownCrcs crcs() const;

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable copied_cv_;
  int64_t rows_ = 0;
  optim::detail::KnownCrcs crcs_;
  bool abandoned_ = false;
};

/// The largest write around the page cache a snapshot's writer makes (optim::detail::
/// ScopedWriteRests, set by SnapshotWrites): 4 MiB, as dd's probe of a disk writes, so that the
/// disk gets one request at a time rather than a block's record of up to 64 MiB at once.
constexpr size_t kSnapshotMaxDirectWriteBytes = size_t{4} << 20;

/// PREFIX.shard-S-of-N.block-B.pt
std::string block_path(const std::string& prefix, int64_t shard, int64_t shards, int64_t block);

/// Writes `part`, rows [first_row, first_row + part.value.size(0)) of a table and shard `shard`
/// of `shards`, as blocks of at most `rows_per_file` rows named after `prefix`, one after another
/// on the caller's thread, each once `copied` (when given) says its rows are in `part`, with the
/// CRC-32s it took. Returns the first row of each block, then the shard's end. Errors: c10::Error
/// naming the first file that could not be written; no block is begun after it (nor after the
/// copy is abandoned).
std::vector<int64_t> write_shard_blocks(const std::string& prefix, int64_t shard, int64_t shards,
                                        int64_t first_row, const ParamCopy& part,
                                        int64_t rows_per_file, const RowsCopied* copied = nullptr);

/// One block file a load reads: who wrote it and which rows of the table it holds.
struct BlockFile {
  std::string path;
  int64_t shard = 0;
  int64_t first_row = 0;
  int64_t end_row = 0;
};

/// What the manifest says of a parameter's (or a shard's) optimizer state.
struct StateSummary {
  bool has_state = false;
  int64_t step = 0;
  std::vector<std::string> buffers;  // sorted
};

/// Reads rows [first_row, end_row) of a table from `blocks`, which hold them in row order, each
/// block read, checked and copied into the result before the next is read (so this process
/// holds the result and one block). Every block must hold the state `state` says its shard has.
/// Errors: c10::Error / c10::ValueError naming the file and what is wrong with it.
ParamCopy read_block_rows(const std::vector<BlockFile>& blocks, int64_t first_row, int64_t end_row,
                          int64_t dim, c10::ScalarType dtype, const StateSummary& state);

/// Writes `part`, the live rows of a collisionless table's shard `shard` of `shards` with their
/// ids (part.ids), as blocks of at most `rows_per_file` rows named after `prefix`. Returns each
/// block's number of rows (one empty block for a shard without rows). Errors: c10::Error naming
/// the file that could not be written.
std::vector<int64_t> write_id_blocks(const std::string& prefix, int64_t shard, int64_t shards,
                                     const ParamCopy& part, int64_t rows_per_file);

/// Reads the rows whose ids `keep` accepts from the id blocks `paths`, each block read, checked
/// (rows of `dim` values of `dtype`, the state `state` says) and its kept rows copied out before
/// the next is read, so this process holds the result and one block. The result's ids
/// (ParamCopy::ids) in the order read. Errors: c10::Error / c10::ValueError naming the file and
/// what is wrong with it, an id that two blocks hold included.
ParamCopy read_id_blocks(const std::vector<std::string>& paths, int64_t dim, c10::ScalarType dtype,
                         const StateSummary& state, const std::function<bool(int64_t)>& keep);

/// Writes `params` (named by their dense indices) to `path`, with the CRC-32s `known` holds of
/// them (when given).
void write_params_file(const std::string& path, const std::vector<int64_t>& dense_indices,
                       const std::vector<ParamCopy>& params,
                       const optim::detail::KnownCrcs* known = nullptr);

/// Reads the parameter of dense index `dense_index` from the file at `path`, checked to be
/// `like`'s shape and dtype and to hold the state `state` says. Errors as read_block_rows'.
ParamCopy read_param(const std::string& path, int64_t dense_index, const at::Tensor& like,
                     const StateSummary& state);

/// An empty dict of string keys, as every dict of a snapshot is.
c10::impl::GenericDict string_dict();

/// "counted N steps (buffers ...)" or "has no optimizer state": a shard's state in errors.
std::string shard_state_text(const StateSummary& state);

/// The summary of `copy`'s state.
StateSummary summary_of(const ParamCopy& copy);

/// The checked reading of a snapshot dict's fields: errors are c10::ValueError
/// "load_snapshot: 'PATH' ..." naming the field.
c10::impl::GenericDict dict_of(const c10::IValue& value, const std::string& path);
const c10::IValue& field(const c10::impl::GenericDict& dict, const char* key,
                         const std::string& path);
int64_t int_field(const c10::impl::GenericDict& dict, const char* key, const std::string& path);
bool bool_field(const c10::impl::GenericDict& dict, const char* key, const std::string& path);
/// An int list, or a list of ints (a list that crossed the wire arrives so).
std::vector<int64_t> int_list_field(const c10::impl::GenericDict& dict, const char* key,
                                    const std::string& path);
std::vector<std::string> string_list_field(const c10::impl::GenericDict& dict, const char* key,
                                           const std::string& path);
/// A list of `count` values (any count when `count` is negative).
c10::ArrayRef<c10::IValue> list_field(const c10::impl::GenericDict& dict, const char* key,
                                      const std::string& path, int64_t count = -1);
/// has_state, step and buffers of `dict`.
StateSummary state_summary(const c10::impl::GenericDict& dict, const std::string& path);
/// Inserts has_state, step and buffers into `dict`.
void insert_state_summary(c10::impl::GenericDict& dict, const StateSummary& state);
/// The dict's format is `format` and its version this library's.
void check_format(const c10::impl::GenericDict& dict, const char* format, const std::string& path);

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
