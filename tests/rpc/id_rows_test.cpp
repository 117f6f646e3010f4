// IdRows (src/rpc/id_rows.h), the id -> row map of a collisionless table on one server:
// admission after K sightings, eviction of the least recently used at the bound, expiry, the
// bound on ids counted towards admission, and lookups from many threads that never see a row
// change hands between their lookup and their read.

#include "id_rows.h"

#include <algorithm>
#include <atomic>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace distoptim {
namespace rpc {
namespace detail {
namespace id_rows_test {

constexpr int64_t kNoRow = IdRows::kNoRow;

IdRowsOptions options(int64_t capacity, int64_t admit_after = 1, int64_t expire_after = 0,
                      int64_t max_pending = 0) {
  IdRowsOptions o;
  o.capacity = capacity;
  o.admit_after = admit_after;
  o.expire_after = expire_after;
  o.max_pending = max_pending;
  return o;
}

// One id's lookup at `now`; records the rows handed out in `assigned`.
int64_t look(IdRows& rows, int64_t id, int64_t now,
             std::vector<std::pair<int64_t, int64_t>>* assigned = nullptr) {
  int64_t row = -2;
  rows.lookup(&id, 1, now, &row, [&](int64_t who, int64_t where) {
    if (assigned != nullptr) assigned->emplace_back(who, where);
  });
  return row;
}

TEST(IdRows, AnIdGetsItsRowAtItsKthSightingAndNotBefore) {
  IdRows rows(options(16, /*admit_after=*/3));
  std::vector<std::pair<int64_t, int64_t>> assigned;
  const int64_t id = 0x7fffffff12345678;
  EXPECT_EQ(look(rows, id, 1, &assigned), kNoRow);
  EXPECT_EQ(look(rows, id, 2, &assigned), kNoRow);
  EXPECT_EQ(rows.find(id), kNoRow);
  EXPECT_EQ(rows.counters().pending_ids, 1);
  const int64_t row = look(rows, id, 3, &assigned);
  ASSERT_NE(row, kNoRow);
  EXPECT_EQ(assigned, (std::vector<std::pair<int64_t, int64_t>>{{id, row}}));
  EXPECT_EQ(look(rows, id, 4, &assigned), row);
  EXPECT_EQ(assigned.size(), 1u);  // handed out once
  const IdRowsCounters counters = rows.counters();
  EXPECT_EQ(counters.live_rows, 1);
  EXPECT_EQ(counters.admitted, 1);
  EXPECT_EQ(counters.unadmitted_lookups, 2);
  EXPECT_EQ(counters.pending_ids, 0);

  // Seen twice in one lookup: counted twice, the second admits it.
  IdRows twice(options(16, 2));
  const int64_t ids[2] = {5, 5};
  int64_t got[2] = {-2, -2};
  twice.lookup(ids, 2, 1, got, {});
  EXPECT_EQ(got[0], kNoRow);
  EXPECT_NE(got[1], kNoRow);
  EXPECT_EQ(twice.find(5), got[1]);
}

TEST(IdRows, AtTheBoundTheLeastRecentlyUsedGoFirst) {
  // 128 rows: a full table evicts 128 / 64 = 2 at once.
  IdRows rows(options(128));
  for (int64_t id = 0; id < 128; ++id) ASSERT_NE(look(rows, 1000 + id, 1 + id), kNoRow);
  EXPECT_EQ(rows.counters().live_rows, 128);
  for (int64_t id = 0; id < 10; ++id) look(rows, 1000 + id, 200);  // used again: now the newest
  const std::set<int64_t> least_recent = {rows.find(1010), rows.find(1011)};
  std::vector<std::pair<int64_t, int64_t>> assigned;
  const int64_t row = look(rows, 5000, 201, &assigned);
  ASSERT_NE(row, kNoRow);
  // Ids 1010 and 1011 were the least recently used (ticks 11 and 12).
  EXPECT_EQ(rows.find(1010), kNoRow);
  EXPECT_EQ(rows.find(1011), kNoRow);
  EXPECT_NE(rows.find(1012), kNoRow);
  for (int64_t id = 0; id < 10; ++id) EXPECT_NE(rows.find(1000 + id), kNoRow);
  EXPECT_EQ(least_recent.count(row), 1u) << "the new id took a row that was not freed";
  const IdRowsCounters counters = rows.counters();
  EXPECT_EQ(counters.evicted, 2);
  EXPECT_EQ(counters.live_rows, 127);
  // Every live id has a row of its own.
  std::set<int64_t> used;
  for (const auto& [id, r] : rows.live()) EXPECT_TRUE(used.insert(r).second) << id;
  EXPECT_EQ(used.count(row), 1u);
}

TEST(IdRows, ALookupNeverEvictsTheRowsItReturns) {
  IdRows rows(options(2));
  const int64_t ids[3] = {7, 8, 9};
  int64_t got[3];
  rows.lookup(ids, 3, 1, got, {});
  EXPECT_NE(got[0], kNoRow);
  EXPECT_NE(got[1], kNoRow);
  EXPECT_EQ(got[2], kNoRow);  // every row was used by this lookup: id 9 reads the default row
  EXPECT_EQ(rows.counters().evicted, 0);
  EXPECT_EQ(rows.counters().unadmitted_lookups, 1);
  // A later tick may evict them: id 9 takes the least recent of the two.
  rows.lookup(ids + 1, 1, 2, got, {});
  EXPECT_NE(look(rows, 9, 3), kNoRow);
  EXPECT_EQ(rows.find(7), kNoRow);
  EXPECT_NE(rows.find(8), kNoRow);
}

TEST(IdRows, RowsUnusedForTheExpiryAreDropped) {
  IdRows rows(options(16, 1, /*expire_after=*/10));
  ASSERT_NE(look(rows, 1, 1), kNoRow);
  ASSERT_NE(look(rows, 2, 8), kNoRow);
  rows.expire(12);  // id 1 last used at 1 < 12 - 10; id 2 at 8 is kept
  EXPECT_EQ(rows.find(1), kNoRow);
  EXPECT_NE(rows.find(2), kNoRow);
  EXPECT_EQ(rows.counters().expired, 1);
  // Lookups expire by themselves (every max(1, 10 / 8) ticks here).
  ASSERT_NE(look(rows, 3, 30), kNoRow);
  EXPECT_EQ(rows.find(2), kNoRow);
  EXPECT_EQ(rows.counters().expired, 2);
  EXPECT_EQ(rows.counters().live_rows, 1);
}

// A backward keeps the rows its lookup read that still hold their ids: not a row dropped since
// (whose id field now chains free rows, here to the number the dropped id was), nor a row handed
// to another id.
TEST(IdRows, StillHeldKeepsOnlyRowsThatStillHoldTheirIds) {
  IdRows rows(options(4, 1, /*expire_after=*/10));
  const int64_t dropped = 3;
  const int64_t read[] = {look(rows, dropped, 1), look(rows, 11, 6), look(rows, 12, 6), kNoRow};
  // The premise: rows are handed out from row 0 up, so that row 3 is the free row after them.
  ASSERT_EQ(read[0], 0);
  ASSERT_EQ(read[1], 1);
  ASSERT_EQ(read[2], 2);
  const int64_t ids[] = {dropped, 11, 12, 99};
  EXPECT_EQ(rows.still_held(ids, read, 4), (std::vector<int64_t>{0, 1, 2}));
  // Tick 15 expires `dropped` (last used at 1), not 11 and 12 (at 6), which are used again.
  ASSERT_EQ(look(rows, 11, 15), 1);
  ASSERT_EQ(look(rows, 12, 15), 2);
  ASSERT_EQ(rows.find(dropped), kNoRow);
  EXPECT_EQ(rows.still_held(ids, read, 4), (std::vector<int64_t>{1, 2}));
  // Row 0 goes to a new id.
  ASSERT_EQ(look(rows, 20, 16), 0);
  EXPECT_EQ(rows.still_held(ids, read, 4), (std::vector<int64_t>{1, 2}));
  const int64_t now_read[] = {0};
  const int64_t new_id[] = {20};
  EXPECT_EQ(rows.still_held(new_id, now_read, 1), (std::vector<int64_t>{0}));
}

TEST(IdRows, IdsCountedTowardsAdmissionAreBounded) {
  IdRows rows(options(16, /*admit_after=*/2, 0, /*max_pending=*/4));
  for (int64_t id = 1; id <= 4; ++id) EXPECT_EQ(look(rows, id, id), kNoRow);
  EXPECT_EQ(look(rows, 5, 5), kNoRow);  // the bound: ids 1 and 2, seen least recently, forgotten
  EXPECT_EQ(rows.counters().pending_ids, 3);
  EXPECT_EQ(look(rows, 1, 6), kNoRow);  // its first sighting again
  EXPECT_NE(look(rows, 3, 7), kNoRow);  // its second
}

TEST(IdRows, OptionsOutOfRangeAreNamed) {
  const auto message = [](const IdRowsOptions& o) {
    try {
      IdRows rows(o);
    } catch (const c10::ValueError& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message(options(0)), "IdRows: capacity = 0; must be at least 1 and at most 2^32 - 1");
  // Rows are 4-byte entries of the id map: refused before anything is allocated.
  EXPECT_EQ(message(options(int64_t{1} << 32)),
            "IdRows: capacity = 4294967296; must be at least 1 and at most 2^32 - 1");
  EXPECT_EQ(message(options(4, 0)), "IdRows: admit_after = 0; must be at least 1");
  EXPECT_EQ(message(options(4, 1, -1)), "IdRows: expire_after = -1; must be at least 0 (0: never)");
  EXPECT_EQ(message(options(4, 1, 0, -3)),
            "IdRows: max_pending = -3; must be at least 0 (0: the capacity)");
}

TEST(IdRows, ThreadsNeverReadARowThatChangedHands) {
  // Four threads look up batches of ids from a space 8 times the table, so rows are evicted and
  // handed on all the time; each row's owner is written when it is handed out, and every read
  // must find each returned row still owned by the id it was returned for.
  constexpr int64_t kCapacity = 256;
  IdRows rows(options(kCapacity, 2, 0, 1024));
  std::vector<std::atomic<int64_t>> owner(kCapacity);
  for (auto& o : owner) o.store(-1);
  std::atomic<int64_t> clock{1};
  std::atomic<int64_t> torn{0};
  std::atomic<int64_t> returned{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 random(t);
      std::uniform_int_distribution<int64_t> pick(0, 8 * kCapacity - 1);
      std::vector<int64_t> ids(32), got(32);
      for (int batch = 0; batch < 2000; ++batch) {
        for (auto& id : ids) id = pick(random);
        rows.lookup(
            ids.data(), static_cast<int64_t>(ids.size()), clock.fetch_add(1), got.data(),
            [&](int64_t id, int64_t row) { owner[row].store(id); },
            [&](const int64_t* read) {
              for (size_t i = 0; i < ids.size(); ++i) {
                if (read[i] == kNoRow) continue;
                returned.fetch_add(1);
                if (owner[read[i]].load() != ids[i]) torn.fetch_add(1);
              }
            });
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(torn.load(), 0);
  EXPECT_GT(returned.load(), 0);
  const IdRowsCounters counters = rows.counters();
  EXPECT_LE(counters.live_rows, kCapacity);
  EXPECT_GT(counters.evicted, 0);
  EXPECT_EQ(counters.admitted - counters.evicted, counters.live_rows);
  std::set<int64_t> used;
  for (const auto& [id, row] : rows.live()) {
    EXPECT_TRUE(used.insert(row).second);
    EXPECT_EQ(owner[row].load(), id);
  }
}

}  // namespace id_rows_test
}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
