// The rows of tensors handed to new keys (detail/reassigned_rows.h): one process-wide map of a
// log per tensor, whose entries carry one sequence numbering for all tensors; each reader and
// each pin a sequence number; and a count that lets a step of tensors without any rows noted
// (nearly every step) skip the map's lock.

#include <distoptim/rpc/detail/reassigned_rows.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <limits>
#include <mutex>
#include <set>
#include <vector>

#include <ATen/ATen.h>
#include <absl/container/flat_hash_map.h>

namespace distoptim {
namespace rpc {
namespace detail {

namespace {

struct NotedRow {
  int64_t sequence;
  int64_t row;
};

// One tensor's rows noted, in order.
struct RowLog {
  std::deque<NotedRow> rows;
  // Rows noted before this sequence number may have been dropped unread (the bound): a reader or
  // pin before it is told every row may be new.
  int64_t dropped_before = 0;
  std::vector<int64_t*> readers;  // each reader's next_
};

struct ReassignedRows {
  std::mutex mutex;
  absl::flat_hash_map<const void*, RowLog> logs;
  std::multiset<int64_t> pins;  // live pins' positions
  int64_t next_sequence = 0;
  std::atomic<int64_t> noted{0};  // rows kept in all logs
};

ReassignedRows& reassigned() {
  static ReassignedRows* rows = new ReassignedRows();  // never destroyed: used at exit
  return *rows;
}

// Drops the rows that every reader has taken and no pin keeps. Under the mutex.
void drop_taken(ReassignedRows& all, RowLog& log) {
  int64_t oldest = all.pins.empty() ? std::numeric_limits<int64_t>::max() : *all.pins.begin();
  for (const int64_t* next : log.readers) oldest = std::min(oldest, *next);
  while (!log.rows.empty() && log.rows.front().sequence < oldest) {
    log.rows.pop_front();
    all.noted.fetch_sub(1, std::memory_order_relaxed);
  }
}

// The rows of `log` noted from `from` on, ascending, each once; `everything` when some of them
// were dropped unread. Under the mutex.
std::vector<int64_t> rows_from(const RowLog& log, int64_t from, bool& everything) {
  everything = from < log.dropped_before;
  std::vector<int64_t> rows;
  if (everything) return rows;
  // Sequence numbers ascend along the log: the rows from `from` on are its tail.
  auto first = std::partition_point(log.rows.begin(), log.rows.end(),
                                    [&](const NotedRow& noted) { return noted.sequence < from; });
  for (auto it = first; it != log.rows.end(); ++it) rows.push_back(it->row);
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  return rows;
}

}  // namespace

void note_reassigned_row(const at::Tensor& tensor, int64_t row) {
  note_reassigned_rows(tensor, &row, 1);
}

void note_reassigned_rows(const at::Tensor& tensor, const int64_t* rows, int64_t n) {
  ReassignedRows& all = reassigned();
  std::lock_guard<std::mutex> lock(all.mutex);
  const int64_t first_sequence = all.next_sequence;
  all.next_sequence += n;  // one each, in order
  const auto it = all.logs.find(tensor.unsafeGetTensorImpl());
  if (it == all.logs.end() || it->second.readers.empty()) return;  // no optimizer to tell
  RowLog& log = it->second;
  // Kept only for a pin (every live pin's position is at or before these rows) or a reader that
  // has started (a reader that has not takes nothing noted before its start).
  const bool kept = !all.pins.empty() ||
                    std::any_of(log.readers.begin(), log.readers.end(), [](const int64_t* next) {
                      return *next != ReassignedRowsReader::kNotStarted;
                    });
  if (!kept) return;
  const auto limit = static_cast<size_t>(2 * std::max<int64_t>(1, tensor.size(0)));
  for (int64_t i = 0; i < n; ++i) {
    log.rows.push_back({first_sequence + i, rows[i]});
    all.noted.fetch_add(1, std::memory_order_relaxed);
    if (log.rows.size() > limit) {
      // A reader or pin this far behind is told to reset everything (take's `everything`).
      log.dropped_before = log.rows.front().sequence + 1;
      log.rows.pop_front();
      all.noted.fetch_sub(1, std::memory_order_relaxed);
    }
  }
}

void forget_reassigned_rows(const at::Tensor& tensor) {
  ReassignedRows& all = reassigned();
  std::lock_guard<std::mutex> lock(all.mutex);
  const auto it = all.logs.find(tensor.unsafeGetTensorImpl());
  if (it == all.logs.end()) return;
  // Readers of a tensor that is gone read nothing more: they start past its log, and so does
  // every position taken before now.
  RowLog& log = it->second;
  all.noted.fetch_sub(static_cast<int64_t>(log.rows.size()), std::memory_order_relaxed);
  log.rows.clear();
  for (int64_t* next : log.readers) *next = all.next_sequence;
}

ReassignedRowsReader::ReassignedRowsReader(const at::Tensor& tensor)
    : key_(tensor.unsafeGetTensorImpl()) {
  ReassignedRows& all = reassigned();
  std::lock_guard<std::mutex> lock(all.mutex);
  all.logs[key_].readers.push_back(&next_);
}

ReassignedRowsReader::~ReassignedRowsReader() {
  ReassignedRows& all = reassigned();
  std::lock_guard<std::mutex> lock(all.mutex);
  const auto it = all.logs.find(key_);
  if (it == all.logs.end()) return;
  RowLog& log = it->second;
  log.readers.erase(std::find(log.readers.begin(), log.readers.end(), &next_));
  if (log.readers.empty()) {
    all.noted.fetch_sub(static_cast<int64_t>(log.rows.size()), std::memory_order_relaxed);
    all.logs.erase(it);
  } else {
    drop_taken(all, log);
  }
}

std::vector<int64_t> ReassignedRowsReader::take(bool& everything) {
  everything = false;
  ReassignedRows& all = reassigned();
  if (next_ != kNotStarted && all.noted.load(std::memory_order_relaxed) == 0) return {};
  std::lock_guard<std::mutex> lock(all.mutex);
  if (next_ == kNotStarted) {
    next_ = all.next_sequence;
    return {};
  }
  RowLog& log = all.logs.at(key_);
  std::vector<int64_t> rows = rows_from(log, next_, everything);
  next_ = all.next_sequence;
  drop_taken(all, log);
  return rows;
}

void ReassignedRowsReader::start() {
  ReassignedRows& all = reassigned();
  std::lock_guard<std::mutex> lock(all.mutex);
  if (next_ == kNotStarted) next_ = all.next_sequence;
}

ReassignedRowsPin::ReassignedRowsPin() {
  ReassignedRows& all = reassigned();
  std::lock_guard<std::mutex> lock(all.mutex);
  position_ = all.next_sequence;
  all.pins.insert(position_);
}

ReassignedRowsPin::~ReassignedRowsPin() {
  ReassignedRows& all = reassigned();
  std::lock_guard<std::mutex> lock(all.mutex);
  all.pins.erase(all.pins.find(position_));
  if (all.noted.load(std::memory_order_relaxed) == 0) return;
  for (auto& [key, log] : all.logs) drop_taken(all, log);
}

std::vector<int64_t> rows_reassigned_since(const at::Tensor& tensor, int64_t position,
                                           bool& everything) {
  everything = false;
  ReassignedRows& all = reassigned();
  // None kept anywhere: none was dropped past a live pin either (the pin would keep the rows
  // after it, and the bound drops only where more are kept).
  if (all.noted.load(std::memory_order_relaxed) == 0) return {};
  std::lock_guard<std::mutex> lock(all.mutex);
  const auto it = all.logs.find(tensor.unsafeGetTensorImpl());
  if (it == all.logs.end()) return {};
  return rows_from(it->second, position, everything);
}

at::Tensor without_rows_reassigned_since(const at::Tensor& tensor, const at::Tensor& gradient,
                                         int64_t position) {
  bool everything = false;
  const std::vector<int64_t> rows = rows_reassigned_since(tensor, position, everything);
  if (!everything && rows.empty()) return gradient;
  const at::Tensor indices = gradient._indices();
  const at::Tensor keep =
      everything
          ? at::empty({0}, at::kLong)
          : at::logical_not(at::isin(indices[0], at::tensor(rows, at::kLong))).nonzero().flatten();
  return at::_sparse_coo_tensor_unsafe(indices.index_select(1, keep),
                                       gradient._values().index_select(0, keep), gradient.sizes())
      ._coalesced_(gradient.is_coalesced());
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
