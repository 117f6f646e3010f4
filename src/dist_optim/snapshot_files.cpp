#include "snapshot_files.h"

#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <exception>
#include <map>
#include <mutex>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "checkpoint_file.h"
#include "file_writer.h"
#include "huge_pages.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

namespace {

using c10::impl::GenericDict;

constexpr const char* kBlockFormat = "distoptim.snapshot.table_block";
constexpr const char* kParamsFormat = "distoptim.snapshot.params";
constexpr const char* kIdBlockFormat = "distoptim.snapshot.id_block";

// Rows [from, to) of `copy` (its value and buffers, whose first row is `first`): copies, so that
// a pickle of them does not carry the whole shard's storage.
// Rows [from, to) of `table` (a contiguous copy) as a tensor whose storage is exactly those rows,
// sharing their memory: pickling writes a tensor's whole storage, so a slice would write the whole
// copy and a clone would cost a copy through fresh pages. Valid while `table` lives.
at::Tensor alias_of_rows(const at::Tensor& table, int64_t from, int64_t to) {
  const at::Tensor rows = table.slice(0, from, to);
  if (from == to) return at::empty(rows.sizes(), rows.options());
  if (!table.is_contiguous()) return rows.clone(at::MemoryFormat::Contiguous);
  return at::from_blob(rows.data_ptr(), rows.sizes(), rows.options());
}

void insert_rows(GenericDict& dict, const ParamCopy& copy, int64_t first, int64_t from,
                 int64_t to) {
  dict.insert("rows", alias_of_rows(copy.value, from - first, to - first));
  insert_state_summary(dict, summary_of(copy));
  c10::Dict<std::string, at::Tensor> buffers;
  for (const auto& [name, buffer] : copy.state.buffers) {
    buffers.insert(name, alias_of_rows(buffer, from - first, to - first));
  }
  dict.insert("buffers_values", buffers);
}

std::string describe(const StateSummary& state) {
  return state.has_state ? c10::str("the state of step ", state.step, " (buffers ",
                                    c10::Join(", ", state.buffers), ")")
                         : std::string("no optimizer state");
}

// The buffers of a file's entry, checked against what the manifest said of its state; `check`
// checks each buffer's tensor.
template <class Check>
std::map<std::string, at::Tensor> checked_buffers(const GenericDict& dict,
                                                  const StateSummary& state,
                                                  const std::string& path, const char* what,
                                                  const Check& check) {
  const StateSummary found = state_summary(dict, path);
  TORCH_CHECK_VALUE(found.has_state == state.has_state &&
                        (!state.has_state || found.step == state.step) &&
                        found.buffers == state.buffers,
                    kLoadSnapshot, ": '", path, "': ", what, " holds ", describe(found),
                    "; the manifest says ", describe(state));
  const c10::IValue& values = field(dict, "buffers_values", path);
  TORCH_CHECK_VALUE(values.isGenericDict(), kLoadSnapshot, ": '", path,
                    "': 'buffers_values' is no dict");
  std::map<std::string, at::Tensor> out;
  for (const auto& entry : values.toGenericDict()) {
    TORCH_CHECK_VALUE(entry.key().isString(), kLoadSnapshot, ": '", path,
                      "': a buffer name is no string");
    const std::string& name = entry.key().toStringRef();
    out[name] = check(entry.value(), "buffer '" + name + "'");
  }
  std::vector<std::string> names;
  for (const auto& entry : out) names.push_back(entry.first);
  TORCH_CHECK_VALUE(names == state.buffers, kLoadSnapshot, ": '", path, "': ", what,
                    " holds the buffers ", c10::Join(", ", names), ", its 'buffers' say ",
                    c10::Join(", ", state.buffers));
  return out;
}

// Keeps the calling thread, and the threads it starts, to the last CPU the process may run on
// (when it may run on more than one): the steps keep the others whole. A snapshot's writing needs
// little CPU (the system calls of its direct writes; the CRC-32s, where the copy took none), and
// where it ran on every CPU a step that woke beside it waited for it now and then (a 2.56 GB
// snapshot beside a trainer on 2 CPUs, three runs of three rounds each way: the steps' p99 while it
// was written 1.4-3.1x that without it, run medians 2.0-2.2x; on one CPU 1.0-2.3x, run
// medians 1.3-2.0x; written as fast). If refused, the thread runs anywhere.
void keep_to_one_cpu() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof allowed, &allowed) != 0 || CPU_COUNT(&allowed) < 2) return;
  int last = -1;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &allowed)) last = cpu;
  }
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(last, &one);
  (void)::sched_setaffinity(0, sizeof one, &one);
}

}  // namespace

LowPriorityThread::LowPriorityThread(std::function<void()> work)
    : thread_([this, work = std::move(work)] {
        // The thread's own nice value (Linux schedules threads apart); if refused, it runs anyway.
        (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 10);
        keep_to_one_cpu();
        try {
          work();
        } catch (...) {
          failure_ = std::current_exception();
        }
      }) {}

LowPriorityThread::~LowPriorityThread() {
  if (thread_.joinable()) thread_.join();
}

void LowPriorityThread::join() {
  thread_.join();
  if (failure_) std::rethrow_exception(failure_);
}

void run_at_low_priority(const std::function<void()>& work) { LowPriorityThread(work).join(); }

void RowsCopied::advance(int64_t rows, const optim::detail::KnownCrcs& crcs) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    rows_ = std::max(rows_, rows);
    crcs_.insert(crcs.begin(), crcs.end());
  }
  copied_cv_.notify_all();
}

void RowsCopied::abandon() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    abandoned_ = true;
  }
  copied_cv_.notify_all();
}

bool RowsCopied::wait_for(int64_t rows) const {
  std::unique_lock<std::mutex> lock(mutex_);
  copied_cv_.wait(lock, [&] { return rows_ >= rows || abandoned_; });
  return rows_ >= rows;
}

optim::detail::KnownCrcs RowsCopied::crcs() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return crcs_;
}

std::string shard_state_text(const StateSummary& state) {
  return state.has_state ? c10::str("counted ", state.step, " steps (buffers ",
                                    c10::Join(", ", state.buffers), ")")
                         : std::string("has no optimizer state");
}

std::string block_path(const std::string& prefix, int64_t shard, int64_t shards, int64_t block) {
  return c10::str(prefix, ".shard-", shard, "-of-", shards, ".block-", block, ".pt");
}

std::vector<int64_t> write_shard_blocks(const std::string& prefix, int64_t shard, int64_t shards,
                                        int64_t first_row, const ParamCopy& part,
                                        int64_t rows_per_file, const RowsCopied* copied) {
  TORCH_INTERNAL_ASSERT(rows_per_file > 0);
  const int64_t end_row = first_row + part.value.size(0);
  std::vector<int64_t> firsts;
  for (int64_t first = first_row; first < end_row; first += rows_per_file) firsts.push_back(first);
  const size_t blocks = firsts.size();
  firsts.push_back(end_row);
  // One block after another on this thread: paced by the caller (SnapshotWrites), which keeps
  // one write in flight.
  for (size_t b = 0; b < blocks; ++b) {
    TORCH_CHECK(copied == nullptr || copied->wait_for(firsts[b + 1] - first_row), kSaveSnapshot,
                ": the copy of shard ", shard, " stopped before its block ", b);
    GenericDict block = string_dict();
    block.insert("format", std::string(kBlockFormat));
    block.insert("version", kSnapshotVersion);
    block.insert("shard", shard);
    block.insert("first_row", firsts[b]);
    block.insert("end_row", firsts[b + 1]);
    insert_rows(block, part, first_row, firsts[b], firsts[b + 1]);
    const optim::detail::KnownCrcs crcs =
        copied != nullptr ? copied->crcs() : optim::detail::KnownCrcs{};
    optim::detail::write_pickle_file(block_path(prefix, shard, shards, static_cast<int64_t>(b)),
                                     block, kSaveSnapshot, &crcs);
  }
  return firsts;
}

ParamCopy read_block_rows(const std::vector<BlockFile>& blocks, int64_t first_row, int64_t end_row,
                          int64_t dim, c10::ScalarType dtype, const StateSummary& state) {
  TORCH_INTERNAL_ASSERT(!blocks.empty() && blocks.front().first_row <= first_row &&
                        blocks.back().end_row >= end_row);
  ParamCopy out;
  out.has_state = state.has_state;
  out.state.step = state.has_state ? state.step : 0;
  // A block holding exactly the rows asked for is taken as read (its tensors share the file's
  // memory, which they keep); otherwise the rows are copied into memory of their own, in huge
  // pages where the kernel gives them (one fault per 2 MB where 4 KB pages take 512).
  const bool whole_block =
      blocks.size() == 1 && blocks[0].first_row == first_row && blocks[0].end_row == end_row;
  auto fresh_rows = [&] {
    return optim::detail::empty_with_huge_pages({end_row - first_row, dim},
                                                at::TensorOptions().dtype(dtype));
  };
  if (!whole_block) {
    out.value = fresh_rows();
    if (state.has_state) {
      for (const std::string& name : state.buffers) out.state.buffers[name] = fresh_rows();
    }
  }
  for (const BlockFile& block : blocks) {
    const GenericDict dict =
        dict_of(optim::detail::read_pickle_file_in_place(block.path, kLoadSnapshot), block.path);
    check_format(dict, kBlockFormat, block.path);
    const int64_t shard = int_field(dict, "shard", block.path);
    const int64_t first = int_field(dict, "first_row", block.path);
    const int64_t end = int_field(dict, "end_row", block.path);
    TORCH_CHECK_VALUE(shard == block.shard && first == block.first_row && end == block.end_row,
                      kLoadSnapshot, ": '", block.path, "' is a block of shard ", shard,
                      " with rows [", first, ", ", end, "); the manifest names a block of shard ",
                      block.shard, " with rows [", block.first_row, ", ", block.end_row, ")");
    auto rows_of = [&](const c10::IValue& value, const std::string& what) {
      TORCH_CHECK_VALUE(value.isTensor(), kLoadSnapshot, ": '", block.path, "': ", what,
                        " is not a tensor");
      const at::Tensor& t = value.toTensor();
      TORCH_CHECK_VALUE(t.layout() == c10::kStrided && t.dim() == 2 && t.size(0) == end - first &&
                            t.size(1) == dim && t.scalar_type() == dtype,
                        kLoadSnapshot, ": '", block.path, "': ", what, " has shape ", t.sizes(),
                        " and dtype ", t.scalar_type(), "; the block holds ", end - first,
                        " rows of ", dim, " ", dtype);
      return t;
    };
    const std::map<std::string, at::Tensor> buffers = checked_buffers(
        dict, state, block.path, ("the block of shard " + std::to_string(shard)).c_str(), rows_of);
    // The rows of this block that [first_row, end_row) takes.
    const int64_t from = std::max(first, first_row), to = std::min(end, end_row);
    if (from >= to) continue;
    const at::Tensor rows = rows_of(field(dict, "rows", block.path), "'rows'");
    if (whole_block) {
      out.value = rows;
      out.state.buffers = buffers;
      continue;
    }
    auto take = [&](const at::Tensor& source, at::Tensor& target) {
      target.slice(0, from - first_row, to - first_row)
          .copy_(source.slice(0, from - first, to - first));
    };
    take(rows, out.value);
    for (const auto& [name, buffer] : buffers) take(buffer, out.state.buffers.at(name));
  }
  return out;
}

std::vector<int64_t> write_id_blocks(const std::string& prefix, int64_t shard, int64_t shards,
                                     const ParamCopy& part, int64_t rows_per_file) {
  TORCH_INTERNAL_ASSERT(rows_per_file > 0 && part.ids.size(0) == part.value.size(0));
  const int64_t live = part.ids.size(0);
  std::vector<int64_t> counts;
  for (int64_t first = 0; first < live || counts.empty(); first += rows_per_file) {
    const int64_t end = std::min(live, first + rows_per_file);
    GenericDict block = string_dict();
    block.insert("format", std::string(kIdBlockFormat));
    block.insert("version", kSnapshotVersion);
    block.insert("shard", shard);
    block.insert("ids", alias_of_rows(part.ids, first, end));
    insert_rows(block, part, 0, first, end);
    optim::detail::write_pickle_file(
        block_path(prefix, shard, shards, static_cast<int64_t>(counts.size())), block,
        kSaveSnapshot);
    counts.push_back(end - first);
  }
  return counts;
}

ParamCopy read_id_blocks(const std::vector<std::string>& paths, int64_t dim, c10::ScalarType dtype,
                         const StateSummary& state, const std::function<bool(int64_t)>& keep) {
  std::vector<at::Tensor> ids, values;
  std::map<std::string, std::vector<at::Tensor>> buffers_kept;
  std::map<int64_t, std::string> seen;  // kept id -> its file
  for (const std::string& path : paths) {
    const GenericDict dict =
        dict_of(optim::detail::read_pickle_file_in_place(path, kLoadSnapshot), path);
    check_format(dict, kIdBlockFormat, path);
    const c10::IValue& ids_value = field(dict, "ids", path);
    TORCH_CHECK_VALUE(ids_value.isTensor() && ids_value.toTensor().layout() == c10::kStrided &&
                          ids_value.toTensor().dim() == 1 &&
                          ids_value.toTensor().scalar_type() == at::kLong,
                      kLoadSnapshot, ": '", path, "': 'ids' is not a 1-D int64 tensor");
    const at::Tensor block_ids = ids_value.toTensor().contiguous();
    const int64_t n = block_ids.size(0);
    auto rows_of = [&](const c10::IValue& value, const std::string& what) {
      TORCH_CHECK_VALUE(value.isTensor(), kLoadSnapshot, ": '", path, "': ", what,
                        " is not a tensor");
      const at::Tensor& t = value.toTensor();
      TORCH_CHECK_VALUE(t.layout() == c10::kStrided && t.dim() == 2 && t.size(0) == n &&
                            t.size(1) == dim && t.scalar_type() == dtype,
                        kLoadSnapshot, ": '", path, "': ", what, " has shape ", t.sizes(),
                        " and dtype ", t.scalar_type(), "; the block holds ", n, " rows of ", dim,
                        " ", dtype);
      return t;
    };
    const std::map<std::string, at::Tensor> buffers =
        checked_buffers(dict, state, path, "the block", rows_of);
    const at::Tensor rows = rows_of(field(dict, "rows", path), "'rows'");
    std::vector<int64_t> kept;
    const int64_t* id = block_ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      if (!keep(id[i])) continue;
      const auto [it, fresh] = seen.emplace(id[i], path);
      TORCH_CHECK_VALUE(fresh, kLoadSnapshot, ": '", path, "' holds id ", id[i], ", which '",
                        it->second, "' holds too");
      kept.push_back(i);
    }
    if (kept.empty()) continue;
    const at::Tensor at_kept = at::tensor(kept, at::kLong);
    ids.push_back(block_ids.index_select(0, at_kept));
    values.push_back(rows.index_select(0, at_kept));
    for (const auto& [name, buffer] : buffers) {
      buffers_kept[name].push_back(buffer.index_select(0, at_kept));
    }
  }
  ParamCopy out;
  const at::TensorOptions options = at::TensorOptions().dtype(dtype);
  out.ids = ids.empty() ? at::empty({0}, at::kLong) : at::cat(ids);
  out.value = values.empty() ? at::empty({0, dim}, options) : at::cat(values);
  out.has_state = state.has_state;
  out.state.step = state.has_state ? state.step : 0;
  if (state.has_state) {
    for (const std::string& name : state.buffers) {
      const std::vector<at::Tensor>& parts = buffers_kept[name];
      out.state.buffers[name] = parts.empty() ? at::empty({0, dim}, options) : at::cat(parts);
    }
  }
  return out;
}

void write_params_file(const std::string& path, const std::vector<int64_t>& dense_indices,
                       const std::vector<ParamCopy>& params,
                       const optim::detail::KnownCrcs* known) {
  TORCH_INTERNAL_ASSERT(dense_indices.size() == params.size());
  c10::impl::GenericList entries(c10::AnyType::get());
  for (size_t i = 0; i < params.size(); ++i) {
    GenericDict entry = string_dict();
    entry.insert("dense_index", dense_indices[i]);
    entry.insert("rows", params[i].value);
    insert_state_summary(entry, summary_of(params[i]));
    c10::Dict<std::string, at::Tensor> buffers;
    for (const auto& [name, buffer] : params[i].state.buffers) buffers.insert(name, buffer);
    entry.insert("buffers_values", buffers);
    entries.push_back(entry);
  }
  GenericDict file = string_dict();
  file.insert("format", std::string(kParamsFormat));
  file.insert("version", kSnapshotVersion);
  file.insert("params", entries);
  optim::detail::write_pickle_file(path, file, kSaveSnapshot, known);
}

ParamCopy read_param(const std::string& path, int64_t dense_index, const at::Tensor& like,
                     const StateSummary& state) {
  const GenericDict file =
      dict_of(optim::detail::read_pickle_file_in_place(path, kLoadSnapshot), path);
  check_format(file, kParamsFormat, path);
  for (const c10::IValue& item : list_field(file, "params", path)) {
    TORCH_CHECK_VALUE(item.isGenericDict(), kLoadSnapshot, ": '", path,
                      "': a parameter's entry is no dict");
    const GenericDict entry = item.toGenericDict();
    if (int_field(entry, "dense_index", path) != dense_index) continue;
    const std::string what = "parameter " + std::to_string(dense_index);
    auto shaped_like = [&](const c10::IValue& value, const std::string& part) {
      TORCH_CHECK_VALUE(value.isTensor(), kLoadSnapshot, ": '", path, "': ", what, "'s ", part,
                        " is not a tensor");
      const at::Tensor& t = value.toTensor();
      TORCH_CHECK_VALUE(t.layout() == c10::kStrided && t.sizes() == like.sizes() &&
                            t.scalar_type() == like.scalar_type(),
                        kLoadSnapshot, ": '", path, "': ", what, "'s ", part, " has shape ",
                        t.sizes(), " and dtype ", t.scalar_type(), "; the parameter has ",
                        like.sizes(), " and ", like.scalar_type());
      return t;
    };
    ParamCopy out;
    out.value = shaped_like(field(entry, "rows", path), "value");
    out.state.buffers = checked_buffers(entry, state, path, what.c_str(), shaped_like);
    out.has_state = state.has_state;
    out.state.step = state.has_state ? state.step : 0;
    return out;
  }
  TORCH_CHECK_VALUE(false, kLoadSnapshot, ": '", path, "' holds no parameter ", dense_index);
}

GenericDict string_dict() { return GenericDict(c10::StringType::get(), c10::AnyType::get()); }

StateSummary summary_of(const ParamCopy& copy) {
  StateSummary summary{copy.has_state, copy.state.step, {}};
  for (const auto& entry : copy.state.buffers) summary.buffers.push_back(entry.first);
  return summary;  // sorted: the buffers are a std::map
}

GenericDict dict_of(const c10::IValue& value, const std::string& path) {
  TORCH_CHECK_VALUE(value.isGenericDict(), kLoadSnapshot, ": '", path, "' holds no dict but ",
                    value.tagKind());
  return value.toGenericDict();
}

const c10::IValue& field(const GenericDict& dict, const char* key, const std::string& path) {
  auto it = dict.find(key);
  TORCH_CHECK_VALUE(it != dict.end(), kLoadSnapshot, ": '", path, "' has no '", key, "'");
  return it->value();
}

int64_t int_field(const GenericDict& dict, const char* key, const std::string& path) {
  const c10::IValue& value = field(dict, key, path);
  TORCH_CHECK_VALUE(value.isInt(), kLoadSnapshot, ": '", path, "': '", key, "' is ",
                    value.tagKind(), ", not an int");
  return value.toInt();
}

bool bool_field(const GenericDict& dict, const char* key, const std::string& path) {
  const c10::IValue& value = field(dict, key, path);
  TORCH_CHECK_VALUE(value.isBool(), kLoadSnapshot, ": '", path, "': '", key, "' is ",
                    value.tagKind(), ", not a bool");
  return value.toBool();
}

std::vector<int64_t> int_list_field(const GenericDict& dict, const char* key,
                                    const std::string& path) {
  const c10::IValue& value = field(dict, key, path);
  if (value.isIntList()) return value.toIntVector();
  std::vector<int64_t> out;
  for (const c10::IValue& item : list_field(dict, key, path)) {
    TORCH_CHECK_VALUE(item.isInt(), kLoadSnapshot, ": '", path, "': '", key, "' holds ",
                      item.tagKind(), ", not an int");
    out.push_back(item.toInt());
  }
  return out;
}

std::vector<std::string> string_list_field(const GenericDict& dict, const char* key,
                                           const std::string& path) {
  std::vector<std::string> out;
  for (const c10::IValue& item : list_field(dict, key, path)) {
    TORCH_CHECK_VALUE(item.isString(), kLoadSnapshot, ": '", path, "': '", key, "' holds ",
                      item.tagKind(), ", not a string");
    out.push_back(item.toStringRef());
  }
  return out;
}

c10::ArrayRef<c10::IValue> list_field(const GenericDict& dict, const char* key,
                                      const std::string& path, int64_t count) {
  const c10::IValue& value = field(dict, key, path);
  TORCH_CHECK_VALUE(value.isList(), kLoadSnapshot, ": '", path, "': '", key, "' is ",
                    value.tagKind(), ", not a list");
  const c10::ArrayRef<c10::IValue> items = value.toListRef();
  TORCH_CHECK_VALUE(count < 0 || static_cast<int64_t>(items.size()) == count, kLoadSnapshot, ": '",
                    path, "': '", key, "' has ", items.size(), " entries, not ", count);
  return items;
}

StateSummary state_summary(const GenericDict& dict, const std::string& path) {
  StateSummary state;
  state.has_state = bool_field(dict, "has_state", path);
  state.step = int_field(dict, "step", path);
  state.buffers = string_list_field(dict, "buffers", path);
  TORCH_CHECK_VALUE(
      std::is_sorted(state.buffers.begin(), state.buffers.end()) &&
          std::adjacent_find(state.buffers.begin(), state.buffers.end()) == state.buffers.end() &&
          (state.has_state || state.buffers.empty()),
      kLoadSnapshot, ": '", path, "': 'buffers' ", c10::Join(", ", state.buffers),
      " are not the sorted names of the state's buffers");
  return state;
}

void insert_state_summary(GenericDict& dict, const StateSummary& state) {
  dict.insert("has_state", state.has_state);
  dict.insert("step", state.step);
  dict.insert("buffers", c10::List<std::string>(state.buffers));
}

void check_format(const GenericDict& dict, const char* format, const std::string& path) {
  const c10::IValue& value = field(dict, "format", path);
  TORCH_CHECK_VALUE(value.isString() && value.toStringRef() == format, kLoadSnapshot, ": '", path,
                    "' is not a ", format, " file");
  const int64_t version = int_field(dict, "version", path);
  TORCH_CHECK_VALUE(version == kSnapshotVersion, kLoadSnapshot, ": '", path, "' has version ",
                    version, "; this library reads version ", kSnapshotVersion);
}

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
