// The rows of tensors handed to new keys (detail/reassigned_rows.h): one process-wide map of a
// log per tensor, each reader a position in its tensor's log, and a count that lets a step of
// tensors without any (nearly every step) skip the map's lock.

#include <distoptim/rpc/detail/reassigned_rows.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <mutex>
#include <vector>

#include <absl/container/flat_hash_map.h>

namespace distoptim {
namespace rpc {
namespace detail {

namespace {

// One tensor's rows noted, in order: the row of sequence number `first + i` is rows[i].
struct RowLog {
  int64_t first = 0;
  std::deque<int64_t> rows;
  int64_t limit = 0;              // at most this many kept: twice the tensor's rows
  std::vector<int64_t*> readers;  // each reader's next_
};

struct ReassignedRows {
  std::mutex mutex;
  absl::flat_hash_map<const void*, RowLog> logs;
  std::atomic<int64_t> noted{0};  // rows kept in all logs
};

ReassignedRows& reassigned() {
  static ReassignedRows* rows = new ReassignedRows();  // never destroyed: used at exit
  return *rows;
}

// Drops the rows every reader of `log` has taken. Under the mutex.
void drop_taken(ReassignedRows& all, RowLog& log) {
  int64_t oldest = log.first + static_cast<int64_t>(log.rows.size());
  for (const int64_t* next : log.readers) oldest = std::min(oldest, *next);
  while (log.first < oldest) {
    log.rows.pop_front();
    ++log.first;
    all.noted.fetch_sub(1, std::memory_order_relaxed);
  }
}

}  // namespace

void note_reassigned_row(const at::Tensor& tensor, int64_t row) {
  ReassignedRows& all = reassigned();
  std::lock_guard<std::mutex> lock(all.mutex);
  const auto it = all.logs.find(tensor.unsafeGetTensorImpl());
  if (it == all.logs.end() || it->second.readers.empty()) return;  // no optimizer to tell
  RowLog& log = it->second;
  log.limit = 2 * std::max<int64_t>(1, tensor.size(0));
  log.rows.push_back(row);
  all.noted.fetch_add(1, std::memory_order_relaxed);
  if (static_cast<int64_t>(log.rows.size()) > log.limit) {
    // A reader this far behind is told to reset everything (take's `everything`).
    log.rows.pop_front();
    ++log.first;
    all.noted.fetch_sub(1, std::memory_order_relaxed);
  }
}

void forget_reassigned_rows(const at::Tensor& tensor) {
  ReassignedRows& all = reassigned();
  std::lock_guard<std::mutex> lock(all.mutex);
  const auto it = all.logs.find(tensor.unsafeGetTensorImpl());
  if (it == all.logs.end()) return;
  // Readers of a tensor that is gone read nothing more: they start past its log.
  RowLog& log = it->second;
  all.noted.fetch_sub(static_cast<int64_t>(log.rows.size()), std::memory_order_relaxed);
  log.first += static_cast<int64_t>(log.rows.size());
  log.rows.clear();
  for (int64_t* next : log.readers) *next = log.first;
}

ReassignedRowsReader::ReassignedRowsReader(const at::Tensor& tensor)
    : key_(tensor.unsafeGetTensorImpl()) {
  ReassignedRows& all = reassigned();
  std::lock_guard<std::mutex> lock(all.mutex);
  RowLog& log = all.logs[key_];
  next_ = log.first + static_cast<int64_t>(log.rows.size());
  log.readers.push_back(&next_);
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
  std::vector<int64_t> rows;
  if (all.noted.load(std::memory_order_relaxed) == 0) return rows;
  std::lock_guard<std::mutex> lock(all.mutex);
  RowLog& log = all.logs.at(key_);
  const int64_t end = log.first + static_cast<int64_t>(log.rows.size());
  everything = next_ < log.first;
  if (!everything && next_ < end) {
    rows.assign(log.rows.begin() + (next_ - log.first), log.rows.end());
  }
  next_ = end;
  drop_taken(all, log);
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  return rows;
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
