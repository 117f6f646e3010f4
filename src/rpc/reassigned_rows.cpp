// The rows of tensors handed to new keys (detail/reassigned_rows.h): one process-wide map, and a
// count that lets a step of tensors without any (nearly every step) skip the map's lock.

#include <distoptim/rpc/detail/reassigned_rows.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

#include <absl/container/flat_hash_map.h>
#include <absl/container/flat_hash_set.h>

namespace distoptim {
namespace rpc {
namespace detail {

namespace {

struct ReassignedRows {
  std::mutex mutex;
  absl::flat_hash_map<const void*, absl::flat_hash_set<int64_t>> rows_of;
  std::atomic<int64_t> noted{0};  // rows in rows_of
};

ReassignedRows& reassigned() {
  static ReassignedRows* rows = new ReassignedRows();  // never destroyed: used at exit
  return *rows;
}

}  // namespace

void note_reassigned_row(const at::Tensor& tensor, int64_t row) {
  ReassignedRows& all = reassigned();
  std::lock_guard<std::mutex> lock(all.mutex);
  if (all.rows_of[tensor.unsafeGetTensorImpl()].insert(row).second) {
    all.noted.fetch_add(1, std::memory_order_relaxed);
  }
}

std::vector<int64_t> take_reassigned_rows(const at::Tensor& tensor) {
  ReassignedRows& all = reassigned();
  std::vector<int64_t> rows;
  if (all.noted.load(std::memory_order_relaxed) > 0) {
    std::lock_guard<std::mutex> lock(all.mutex);
    const auto it = all.rows_of.find(tensor.unsafeGetTensorImpl());
    if (it != all.rows_of.end()) {
      rows.assign(it->second.begin(), it->second.end());
      all.noted.fetch_sub(static_cast<int64_t>(rows.size()), std::memory_order_relaxed);
      all.rows_of.erase(it);
    }
  }
  std::sort(rows.begin(), rows.end());
  return rows;
}

void forget_reassigned_rows(const at::Tensor& tensor) { take_reassigned_rows(tensor); }

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
