#pragma once

// Which row of a server's storage holds each 64-bit id of a collisionless embedding table, and
// which ids get one: an id is admitted at its admit_after-th sighting (before, its lookups read a
// shared default row), a row not looked up for expire_after ticks of the caller's clock is
// dropped, and at the bound on rows the least recently used rows go first (a share of them at
// once, so that a full table pays one pass over its rows per capacity/64 admissions, not per
// admission). Rows are slots [0, capacity) of storage the caller preallocates; whoever hands a
// slot to a new id sets its value and optimizer state (on_assign, or the read that follows under
// the same lock) before any lookup returns it.
//
// Locks: a lookup whose ids all have rows runs under a shared lock, so such lookups run together
// (their last-use ticks are atomics); one with an id without a row runs under the exclusive
// lock, which counts, admits and evicts: nothing is allocated under the shared lock. A lookup
// reads its rows' values under its lock, so a row never changes hands between the two.
//
// Bounds: at most `capacity` rows and `max_pending` ids counted towards admission (at the bound
// the half seen least recently are forgotten), so what hostile or unbounded id streams can make
// a server hold is fixed by the options.
//
// Memory per row, beside the caller's storage: the row's id and last use side by side and a bit
// (17 bytes),
// and the id -> row map's slots, reserved for the capacity at construction (so no rehash doubles
// it on the way): a set of 4-byte rows hashed and compared by the id each holds, about 10 bytes a
// row at 1e6 (a map of id -> row pairs would take 16 bytes a slot). A free row's id field holds
// the next free row.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <shared_mutex>
#include <utility>
#include <vector>

#include <absl/container/flat_hash_map.h>
#include <absl/container/flat_hash_set.h>

namespace distoptim {
namespace rpc {
namespace detail {

struct IdRowsOptions {
  /// The hard bound on rows (>= 1).
  int64_t capacity = 0;
  /// Sightings of an id before it gets a row of its own (>= 1; 1 admits at once).
  int64_t admit_after = 1;
  /// A row not looked up for this many ticks is dropped; 0 keeps rows until evicted.
  int64_t expire_after = 0;
  /// Ids counted towards admission at most (>= 1; 0: `capacity`).
  int64_t max_pending = 0;
};

/// What the table did, for a server's debug info.
struct IdRowsCounters {
  int64_t live_rows = 0;
  int64_t admitted = 0;
  int64_t expired = 0;
  int64_t evicted = 0;
  /// Lookups answered with the default row: the id not admitted yet, or no row evictable.
  int64_t unadmitted_lookups = 0;
  int64_t pending_ids = 0;
};

class IdRows {
 public:
  /// The row of an id that has none: the caller's shared default row.
  static constexpr int64_t kNoRow = -1;
  /// Called under the exclusive lock when `row` is handed to `id`: set its value and state.
  using OnAssign = std::function<void(int64_t id, int64_t row)>;
  /// Called with a lookup's rows while its lock is held: no row changes hands meanwhile.
  using ReadRows = std::function<void(const int64_t* rows)>;

  /// Throws c10::ValueError naming an option out of range.
  explicit IdRows(const IdRowsOptions& options);

  /// The rows of `ids[0..n)` at tick `now` (the caller's clock; never decreasing), written to
  /// `rows`: kNoRow for an id not admitted; then `read(rows)` under the same lock. Counts each
  /// unknown id's sighting and admits it at its admit_after-th, in the order of `ids` (an id
  /// seen twice in one call counts twice). A lookup whose ids all have rows takes the shared
  /// lock only; one with an unknown id, the exclusive lock, and never evicts a row it returns.
  /// Expires rows every max(1, expire_after / 8) ticks.
  void lookup(const int64_t* ids, int64_t n, int64_t now, int64_t* rows, const OnAssign& on_assign,
              const ReadRows& read = {});

  /// The row of `id`, kNoRow if it has none: no sighting counted, nothing allocated.
  int64_t find(int64_t id) const;
  /// The rows of `ids[0..n)` as they are, written to `rows` (kNoRow for an id without one), then
  /// `read(rows)` under the same shared lock: no sighting counted, no recency moved, nothing
  /// allocated (an evaluation's lookup).
  void find_rows(const int64_t* ids, int64_t n, int64_t* rows, const ReadRows& read) const;

  /// The positions i in [0, n) whose `rows[i]` is still the row of `ids[i]` (an earlier lookup's
  /// rows, kNoRow for an id that had none), ascending, under one shared lock: a row read per id,
  /// no search of the map. A lookup's backward keeps only those.
  std::vector<int64_t> still_held(const int64_t* ids, const int64_t* rows, int64_t n) const;

  /// Drops the rows not looked up since `now - expire_after` (nothing when expire_after is 0).
  void expire(int64_t now);

  /// Every live row: (id, row), in no particular order.
  std::vector<std::pair<int64_t, int64_t>> live() const;

  /// Called with the live rows, ascending by id: ids[i] holds rows[i].
  using ReadLive =
      std::function<void(const std::vector<int64_t>& ids, const std::vector<int64_t>& rows)>;
  /// Calls `read` with every live row while no id gains or loses one (under the shared lock:
  /// lookups of ids with rows go on). A snapshot's copy.
  void read_live(const ReadLive& read) const;
  /// Drops every row and every id counted towards admission, gives `ids[0..n)` rows 0..n-1 as
  /// used at `now`, and calls `write` under the exclusive lock (a snapshot's load: the caller
  /// writes the rows' values and state there). Counters but live_rows and pending_ids stay.
  /// c10::ValueError, changing nothing, for more ids than the capacity or an id given twice.
  void replace(const int64_t* ids, int64_t n, int64_t now, const std::function<void()>& write);

  IdRowsCounters counters() const;
  const IdRowsOptions& options() const { return options_; }

 private:
  struct Pending {
    int64_t sightings = 0;
    int64_t last_seen = 0;
  };
  // The map's key when looking up an id (its elements are rows).
  struct IdKey {
    int64_t id;
  };
  // What the table keeps per row, side by side, so that a lookup's read of the id that confirms
  // its row brings the row's last use into the cache with it.
  struct RowInfo {
    // Its id while the row is live; while it is free, the next free row (kNoRow: the last).
    int64_t id = 0;
    std::atomic<int64_t> last_used{0};  // the tick of its last lookup
  };
  // Hashes and compares rows by the id each holds in `info`, and ids as themselves.
  struct RowHash {
    using is_transparent = void;  // NOLINT(readability-identifier-naming): Abseil looks it up
    const RowInfo* info;
    size_t operator()(uint32_t row) const;
    size_t operator()(IdKey key) const;
  };
  struct RowEq {
    using is_transparent = void;  // NOLINT(readability-identifier-naming): Abseil looks it up
    const RowInfo* info;
    bool operator()(uint32_t a, uint32_t b) const { return a == b; }
    bool operator()(uint32_t row, IdKey key) const { return info[row].id == key.id; }
    bool operator()(IdKey key, uint32_t row) const { return info[row].id == key.id; }
  };
  using RowSet = absl::flat_hash_set<uint32_t, RowHash, RowEq>;

  // Under the exclusive lock: a row for `id`, which has none, used at `now` (kNoRow if every
  // row was used at `now`).
  int64_t give_row(int64_t id, int64_t now);
  // Under the exclusive lock: a free row for a new id at `now`, evicting when none is free.
  int64_t take_row(int64_t now);
  // Under the exclusive lock: frees the least recently used rows not used at `now`.
  void evict_least_recent(int64_t now);
  // Under the exclusive lock: forgets `row`'s id and frees it.
  void drop_row(int64_t row);
  void expire_locked(int64_t now);
  // Under the exclusive lock: counts a sighting of unknown `id`; whether it is admitted now.
  bool sighted(int64_t id, int64_t now);

  // Under the lock (shared or exclusive): the live row of `id`, kNoRow if none.
  int64_t row_of(int64_t id) const;
  // Under the lock: every live row, (id, row), in no particular order.
  std::vector<std::pair<int64_t, int64_t>> live_locked() const;
  // Under the exclusive lock: makes rows [first, capacity) the free list, `first` on top.
  void free_rows_from(int64_t first);

  const IdRowsOptions options_;
  mutable std::shared_mutex mutex_;
  std::unique_ptr<RowInfo[]> info_;  // per row
  RowSet rows_;                      // the live rows, by their ids: the id -> row map
  absl::flat_hash_map<int64_t, Pending> pending_;
  std::vector<bool> live_;      // per row
  int64_t free_head_ = kNoRow;  // the free row taken next
  std::atomic<int64_t> next_expiry_{0};
  int64_t admitted_ = 0;
  int64_t expired_ = 0;
  int64_t evicted_ = 0;
  std::atomic<int64_t> unadmitted_lookups_{0};
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
