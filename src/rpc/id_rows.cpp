#include "id_rows.h"

#include <algorithm>
#include <limits>
#include <mutex>

#include <absl/hash/hash.h>
#include <c10/util/Exception.h>

namespace distoptim {
namespace rpc {
namespace detail {

namespace {

// At the bound, this share of the rows goes at once (at least one).
constexpr int64_t kEvictShare = 64;

}  // namespace

IdRows::IdRows(const IdRowsOptions& options)
    : options_([&] {
        IdRowsOptions checked = options;
        TORCH_CHECK_VALUE(
            checked.capacity >= 1 && checked.capacity <= std::numeric_limits<uint32_t>::max(),
            "IdRows: capacity = ", checked.capacity, "; must be at least 1 and at most 2^32 - 1");
        TORCH_CHECK_VALUE(checked.admit_after >= 1, "IdRows: admit_after = ", checked.admit_after,
                          "; must be at least 1");
        TORCH_CHECK_VALUE(checked.expire_after >= 0,
                          "IdRows: expire_after = ", checked.expire_after,
                          "; must be at least 0 (0: never)");
        TORCH_CHECK_VALUE(checked.max_pending >= 0, "IdRows: max_pending = ", checked.max_pending,
                          "; must be at least 0 (0: the capacity)");
        if (checked.max_pending == 0) checked.max_pending = checked.capacity;
        return checked;
      }()),
      info_(new RowInfo[options_.capacity]),
      rows_(0, RowHash{info_.get()}, RowEq{info_.get()}),
      live_(options_.capacity, false) {
  // Every slot the capacity needs, at once: growing by doubling would hold the old and the new
  // slots together at each step.
  rows_.reserve(static_cast<size_t>(options_.capacity));
  free_rows_from(0);  // row 0 taken first
}

size_t IdRows::RowHash::operator()(uint32_t row) const {
  return absl::Hash<int64_t>{}(info[row].id);
}

size_t IdRows::RowHash::operator()(IdKey key) const { return absl::Hash<int64_t>{}(key.id); }

int64_t IdRows::row_of(int64_t id) const {
  const auto it = rows_.find(IdKey{id});
  return it == rows_.end() ? kNoRow : static_cast<int64_t>(*it);
}

void IdRows::free_rows_from(int64_t first) {
  for (int64_t row = first; row < options_.capacity; ++row) {
    info_[row].id = row + 1 < options_.capacity ? row + 1 : kNoRow;
  }
  free_head_ = first < options_.capacity ? first : kNoRow;
}

void IdRows::lookup(const int64_t* ids, int64_t n, int64_t now, int64_t* rows,
                    const OnAssign& on_assign, const ReadRows& read) {
  const bool expiry_due =
      options_.expire_after > 0 && now >= next_expiry_.load(std::memory_order_relaxed);
  if (!expiry_due) {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    bool all_known = true;
    for (int64_t i = 0; i < n && all_known; ++i) {
      const int64_t row = row_of(ids[i]);
      all_known = row != kNoRow;
      if (all_known) {
        rows[i] = row;
        info_[row].last_used.store(now, std::memory_order_relaxed);
      }
    }
    if (all_known) {
      if (read) read(rows);
      return;
    }
  }
  // Some id has no row (or rows expire now): the rest under the exclusive lock, which no
  // lookup holds while it reads rows, so no row changes hands between its lookup and its read.
  std::unique_lock<std::shared_mutex> lock(mutex_);
  if (expiry_due && now >= next_expiry_.load(std::memory_order_relaxed)) {
    next_expiry_.store(now + std::max<int64_t>(1, options_.expire_after / 8),
                       std::memory_order_relaxed);
    expire_locked(now);
  }
  // Known ids first, so that admissions below never evict a row this lookup returns.
  std::vector<int64_t> unknown;  // positions in `ids`
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = row_of(ids[i]);
    if (row == kNoRow) {
      unknown.push_back(i);
      continue;
    }
    rows[i] = row;
    info_[row].last_used.store(now, std::memory_order_relaxed);
  }
  for (const int64_t i : unknown) {
    const int64_t id = ids[i];
    // Admitted earlier in this lookup (an id seen twice).
    if (const int64_t row = row_of(id); row != kNoRow) {
      rows[i] = row;
      continue;
    }
    int64_t row = kNoRow;
    if (sighted(id, now)) {
      row = give_row(id, now);
      if (row != kNoRow) {
        ++admitted_;
        if (on_assign) on_assign(id, row);
      }
    }
    if (row == kNoRow) unadmitted_lookups_.fetch_add(1, std::memory_order_relaxed);
    rows[i] = row;
  }
  if (read) read(rows);
}

int64_t IdRows::find(int64_t id) const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  return row_of(id);
}

void IdRows::find_rows(const int64_t* ids, int64_t n, int64_t* rows, const ReadRows& read) const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  for (int64_t i = 0; i < n; ++i) rows[i] = row_of(ids[i]);
  read(rows);
}

std::vector<int64_t> IdRows::still_held(const int64_t* ids, const int64_t* rows, int64_t n) const {
  std::vector<int64_t> positions;
  positions.reserve(static_cast<size_t>(n));
  std::shared_lock<std::shared_mutex> lock(mutex_);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = rows[i];
    // A free row's id field holds the next free row, so liveness is checked first.
    if (row != kNoRow && live_[row] && info_[row].id == ids[i]) positions.push_back(i);
  }
  return positions;
}

void IdRows::expire(int64_t now) {
  std::unique_lock<std::shared_mutex> lock(mutex_);
  expire_locked(now);
}

std::vector<std::pair<int64_t, int64_t>> IdRows::live() const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  return live_locked();
}

std::vector<std::pair<int64_t, int64_t>> IdRows::live_locked() const {
  std::vector<std::pair<int64_t, int64_t>> live;
  live.reserve(rows_.size());
  for (const uint32_t row : rows_) live.emplace_back(info_[row].id, row);
  return live;
}

void IdRows::read_live(const ReadLive& read) const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  std::vector<std::pair<int64_t, int64_t>> live = live_locked();
  std::sort(live.begin(), live.end());
  std::vector<int64_t> ids, rows;
  ids.reserve(live.size());
  rows.reserve(live.size());
  for (const auto& [id, row] : live) {
    ids.push_back(id);
    rows.push_back(row);
  }
  read(ids, rows);
}

void IdRows::replace(const int64_t* ids, int64_t n, int64_t now,
                     const std::function<void()>& write) {
  TORCH_CHECK_VALUE(n <= options_.capacity, "IdRows: ", n, " ids for a capacity of ",
                    options_.capacity, " rows");
  {
    absl::flat_hash_set<int64_t> distinct;
    distinct.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK_VALUE(distinct.insert(ids[i]).second, "IdRows: id ", ids[i], " given twice");
    }
  }
  std::unique_lock<std::shared_mutex> lock(mutex_);
  rows_.clear();  // frees a large table's slots: reserved again below
  rows_.reserve(static_cast<size_t>(options_.capacity));
  pending_.clear();
  for (int64_t row = 0; row < options_.capacity; ++row) {
    live_[row] = row < n;
    if (row < n) {
      info_[row].id = ids[row];
      rows_.insert(static_cast<uint32_t>(row));
      info_[row].last_used.store(now, std::memory_order_relaxed);
    }
  }
  free_rows_from(n);
  if (write) write();
}

IdRowsCounters IdRows::counters() const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  IdRowsCounters counters;
  counters.live_rows = static_cast<int64_t>(rows_.size());
  counters.admitted = admitted_;
  counters.expired = expired_;
  counters.evicted = evicted_;
  counters.unadmitted_lookups = unadmitted_lookups_.load(std::memory_order_relaxed);
  counters.pending_ids = static_cast<int64_t>(pending_.size());
  return counters;
}

int64_t IdRows::give_row(int64_t id, int64_t now) {
  const int64_t row = take_row(now);
  if (row == kNoRow) return kNoRow;
  pending_.erase(id);
  info_[row].id = id;  // first: the map hashes the row by it
  rows_.insert(static_cast<uint32_t>(row));
  live_[row] = true;
  info_[row].last_used.store(now, std::memory_order_relaxed);
  return row;
}

int64_t IdRows::take_row(int64_t now) {
  if (free_head_ == kNoRow) evict_least_recent(now);
  if (free_head_ == kNoRow) return kNoRow;
  const int64_t row = free_head_;
  free_head_ = info_[row].id;
  return row;
}

void IdRows::evict_least_recent(int64_t now) {
  // (last use, row) of every live row not used at `now`: this lookup's rows stay.
  std::vector<std::pair<int64_t, int64_t>> candidates;
  candidates.reserve(rows_.size());
  for (int64_t row = 0; row < options_.capacity; ++row) {
    const int64_t used = info_[row].last_used.load(std::memory_order_relaxed);
    if (live_[row] && used < now) candidates.emplace_back(used, row);
  }
  if (candidates.empty()) return;
  const auto count =
      std::min<size_t>(candidates.size(),
                       static_cast<size_t>(std::max<int64_t>(1, options_.capacity / kEvictShare)));
  // Ties broken by row, so the choice does not depend on the map's order.
  std::nth_element(candidates.begin(), candidates.begin() + (count - 1), candidates.end());
  std::sort(candidates.begin(), candidates.begin() + count);
  for (size_t i = 0; i < count; ++i) drop_row(candidates[i].second);
  evicted_ += static_cast<int64_t>(count);
}

void IdRows::drop_row(int64_t row) {
  rows_.erase(static_cast<uint32_t>(row));  // hashed by its id, still in info_
  live_[row] = false;
  info_[row].id = free_head_;
  free_head_ = row;
}

void IdRows::expire_locked(int64_t now) {
  if (options_.expire_after == 0) return;
  for (int64_t row = 0; row < options_.capacity; ++row) {
    if (live_[row] &&
        info_[row].last_used.load(std::memory_order_relaxed) < now - options_.expire_after) {
      drop_row(row);
      ++expired_;
    }
  }
}

bool IdRows::sighted(int64_t id, int64_t now) {
  if (options_.admit_after == 1) return true;
  auto it = pending_.find(id);
  if (it == pending_.end()) {
    if (static_cast<int64_t>(pending_.size()) >= options_.max_pending) {
      // Forget the half of the counted ids seen least recently.
      std::vector<std::pair<int64_t, int64_t>> seen;  // (last seen, id)
      seen.reserve(pending_.size());
      for (const auto& [pending_id, pending] : pending_) {
        seen.emplace_back(pending.last_seen, pending_id);
      }
      const size_t forget = std::max<size_t>(1, seen.size() / 2);
      std::nth_element(seen.begin(), seen.begin() + (forget - 1), seen.end());
      for (size_t i = 0; i < forget; ++i) pending_.erase(seen[i].second);
    }
    it = pending_.emplace(id, Pending{}).first;
  }
  it->second.last_seen = now;
  return ++it->second.sightings >= options_.admit_after;
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
