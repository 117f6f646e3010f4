// rpc::InPlaceRowUpdateGuard and rpc::RowReadGuard between threads of one process, with the
// rows written and read element by element by our own code (so ThreadSanitizer sees every access
// the guards are meant to order): no row update is lost, no reader (a row lookup, a reply's copy
// of the whole tensor) sees a row half-written, guards on disjoint rows do not wait for each other
// and guards on a shared row do, and a tensor written whole holds only itself.

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <distoptim/rpc/api.h>
#include <distoptim/rpc/row_guard.h>

#include "reply_snapshot.h"
#include "support/test_util.h"

namespace distoptim {
namespace rpc {
namespace row_guard_test {

constexpr int64_t kRows = 48, kDim = 64;
constexpr auto kBound = std::chrono::seconds(20);
// How long a guard that must wait is watched still waiting (no guard is expected to take this
// long when it need not wait; the test asserts only that it did not finish).
constexpr auto kStillWaiting = std::chrono::milliseconds(300);

void add_to_row(at::Tensor& weight, int64_t row, float amount) {
  float* data = weight.data_ptr<float>() + row * kDim;
  for (int64_t j = 0; j < kDim; ++j) data[j] += amount;
}

// Whether every element of row `row` of `rows` (a [n, kDim] float tensor) equals its first.
bool row_is_uniform(const at::Tensor& rows, int64_t row) {
  const float* data = rows.data_ptr<float>() + row * kDim;
  for (int64_t j = 1; j < kDim; ++j) {
    if (data[j] != data[0]) return false;
  }
  return true;
}

at::Tensor long_tensor(const std::vector<int64_t>& values) { return at::tensor(values, at::kLong); }

TEST(RowGuards, ConcurrentRowUpdatesLoseNothingAndReadersSeeWholeRows) {
  at::Tensor weight = at::zeros({kRows, kDim});
  constexpr int kUpdaters = 3, kSteps = 3000;
  std::vector<std::vector<int64_t>> counts(kUpdaters, std::vector<int64_t>(kRows, 0));
  std::atomic<int> updaters_left{kUpdaters};
  std::atomic<int64_t> dense_steps{0}, torn{0}, reads{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kUpdaters; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 random(t);
      for (int step = 0; step < kSteps; ++step) {
        // 1 to 4 rows, a row possibly twice (a sparse gradient's duplicate ids).
        std::vector<int64_t> rows(1 + random() % 4);
        for (int64_t& row : rows) row = static_cast<int64_t>(random() % kRows);
        InPlaceRowUpdateGuard writing({weight}, {long_tensor(rows)});
        for (int64_t row : rows) {
          add_to_row(weight, row, 1);
          ++counts[t][row];
        }
      }
      --updaters_left;
    });
  }
  // A dense update now and then: the whole tensor, alone (the process-wide guard), or under its
  // own rows only (a whole-tensor row guard, as a parameter server's dense step).
  threads.emplace_back([&] {
    for (int round = 0; updaters_left > 0; ++round) {
      {
        std::unique_ptr<InPlaceUpdateGuard> everything;
        std::unique_ptr<InPlaceRowUpdateGuard> this_tensor;
        if (round % 2 == 0) {
          everything = std::make_unique<InPlaceUpdateGuard>();
        } else {
          this_tensor = std::make_unique<InPlaceRowUpdateGuard>(std::vector<at::Tensor>{weight},
                                                                std::vector<at::Tensor>{{}});
        }
        for (int64_t row = 0; row < kRows; ++row) add_to_row(weight, row, 1);
        ++dense_steps;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  // Row lookups.
  threads.emplace_back([&] {
    std::mt19937 random(7);
    do {
      std::vector<int64_t> rows = {static_cast<int64_t>(random() % kRows),
                                   static_cast<int64_t>(random() % kRows)};
      at::Tensor copy = at::empty({2, kDim});
      {
        RowReadGuard reading(weight, long_tensor(rows));
        for (int i = 0; i < 2; ++i) {
          std::copy_n(weight.data_ptr<float>() + rows[i] * kDim, kDim,
                      copy.data_ptr<float>() + i * kDim);
        }
      }
      for (int i = 0; i < 2; ++i) torn += row_is_uniform(copy, i) ? 0 : 1;
      ++reads;
    } while (updaters_left > 0);
  });
  // Replies copying the whole tensor (to_here of a parameter).
  threads.emplace_back([&] {
    do {
      const at::Tensor copy =
          detail::snapshot_shared_tensors(c10::IValue(weight), /*holders=*/0).toTensor();
      ASSERT_FALSE(copy.is_same(weight));
      for (int64_t row = 0; row < kRows; ++row) torn += row_is_uniform(copy, row) ? 0 : 1;
      ++reads;
    } while (updaters_left > 0);
  });
  for (auto& thread : threads) thread.join();

  EXPECT_EQ(torn.load(), 0);
  EXPECT_GE(reads.load(), 2);
  for (int64_t row = 0; row < kRows; ++row) {
    int64_t expected = dense_steps.load();
    for (const auto& c : counts) expected += c[row];
    EXPECT_TRUE(at::equal(weight[row], at::full({kDim}, static_cast<float>(expected))))
        << "row " << row << ": " << weight[row][0].item<float>() << " for " << expected
        << " updates";
  }
}

// Runs `fn` on a thread of its own (a guard is released by the thread that took it).
template <class Fn>
std::future<void> on_thread(Fn fn) {
  return std::async(std::launch::async, std::move(fn));
}

TEST(RowGuards, DisjointRowsDoNotWaitSharedRowsDo) {
  at::Tensor weight = at::zeros({kRows, kDim});
  std::promise<void> holding, release;
  std::shared_future<void> released = release.get_future().share();
  // Row 0 held for update until released.
  auto holder = on_thread([&] {
    InPlaceRowUpdateGuard writing({weight}, {long_tensor({0})});
    add_to_row(weight, 0, 1);
    holding.set_value();
    released.wait();
  });
  holding.get_future().wait();

  // Other rows: updated and read meanwhile.
  auto other_update = on_thread([&] {
    InPlaceRowUpdateGuard writing({weight}, {long_tensor({1, 2})});
    add_to_row(weight, 1, 1);
  });
  auto other_read = on_thread([&] { RowReadGuard reading(weight, long_tensor({1, 3})); });
  ASSERT_EQ(other_update.wait_for(kBound), std::future_status::ready);
  ASSERT_EQ(other_read.wait_for(kBound), std::future_status::ready);

  // Row 0: an update, a lookup and a whole copy wait for the holder.
  auto same_update = on_thread([&] {
    InPlaceRowUpdateGuard writing({weight}, {long_tensor({5, 0})});
    add_to_row(weight, 0, 1);
  });
  auto same_read = on_thread([&] { RowReadGuard reading(weight, long_tensor({0})); });
  auto whole = on_thread([&] { detail::snapshot_shared_tensors(c10::IValue(weight), 0); });
  EXPECT_EQ(same_update.wait_for(kStillWaiting), std::future_status::timeout);
  EXPECT_EQ(same_read.wait_for(std::chrono::milliseconds(1)), std::future_status::timeout);
  EXPECT_EQ(whole.wait_for(std::chrono::milliseconds(1)), std::future_status::timeout);
  release.set_value();
  for (auto* f : {&holder, &same_update, &same_read, &whole}) {
    ASSERT_EQ(f->wait_for(kBound), std::future_status::ready);
  }
  EXPECT_EQ(weight[0][0].item<float>(), 2);
  EXPECT_EQ(weight[1][0].item<float>(), 1);
}

// A tensor written whole (a dense layer's step) holds its own rows only: another tensor's rows are
// updated, looked up and copied whole meanwhile, while its own wait.
TEST(RowGuards, ATensorWrittenWholeHoldsOnlyItself) {
  at::Tensor dense = at::zeros({kRows, kDim});
  at::Tensor table = at::zeros({kRows, kDim});
  std::promise<void> holding, release;
  std::shared_future<void> released = release.get_future().share();
  auto holder = on_thread([&] {
    InPlaceRowUpdateGuard writing({dense, table}, {at::Tensor(), long_tensor({3})});
    for (int64_t row = 0; row < kRows; ++row) add_to_row(dense, row, 1);
    add_to_row(table, 3, 1);
    holding.set_value();
    released.wait();
  });
  holding.get_future().wait();

  auto other_update = on_thread([&] {
    InPlaceRowUpdateGuard writing({table}, {long_tensor({1, 2})});
    add_to_row(table, 1, 1);
  });
  auto other_read = on_thread([&] { RowReadGuard reading(table, long_tensor({1, 4})); });
  ASSERT_EQ(other_update.wait_for(kBound), std::future_status::ready);
  ASSERT_EQ(other_read.wait_for(kBound), std::future_status::ready);

  auto dense_update = on_thread([&] {
    InPlaceRowUpdateGuard writing({dense}, {long_tensor({40})});
    add_to_row(dense, 40, 1);
  });
  auto dense_read = on_thread([&] { RowReadGuard reading(dense, long_tensor({7})); });
  auto dense_copy = on_thread([&] { detail::snapshot_shared_tensors(c10::IValue(dense), 0); });
  auto held_row = on_thread([&] { RowReadGuard reading(table, long_tensor({3})); });
  EXPECT_EQ(dense_update.wait_for(kStillWaiting), std::future_status::timeout);
  EXPECT_EQ(dense_read.wait_for(std::chrono::milliseconds(1)), std::future_status::timeout);
  EXPECT_EQ(dense_copy.wait_for(std::chrono::milliseconds(1)), std::future_status::timeout);
  EXPECT_EQ(held_row.wait_for(std::chrono::milliseconds(1)), std::future_status::timeout);
  release.set_value();
  for (auto* f : {&holder, &dense_update, &dense_read, &dense_copy, &held_row}) {
    ASSERT_EQ(f->wait_for(kBound), std::future_status::ready);
  }
  EXPECT_EQ(dense[40][0].item<float>(), 2);
  EXPECT_EQ(dense[0][0].item<float>(), 1);
  EXPECT_EQ(table[1][0].item<float>(), 1);
  EXPECT_EQ(table[3][0].item<float>(), 1);
}

TEST(RowGuards, ATensorThatIsNotItsWholeStorageIsLockedWhole) {
  at::Tensor weight = at::zeros({kRows, kDim});
  const at::Tensor view = weight.slice(0, 4, 8);
  std::promise<void> holding, release;
  std::shared_future<void> released = release.get_future().share();
  auto holder = on_thread([&] {
    // Row 0 of the view is row 4 of the storage: the guard takes the process-wide lock.
    InPlaceRowUpdateGuard writing({view}, {long_tensor({0})});
    holding.set_value();
    released.wait();
  });
  holding.get_future().wait();
  auto read = on_thread([&] { RowReadGuard reading(weight, long_tensor({20})); });
  EXPECT_EQ(read.wait_for(kStillWaiting), std::future_status::timeout);
  release.set_value();
  ASSERT_EQ(holder.wait_for(kBound), std::future_status::ready);
  ASSERT_EQ(read.wait_for(kBound), std::future_status::ready);
}

TEST(RowGuards, BadRowsAreRefusedNamingThem) {
  const at::Tensor weight = at::zeros({kRows, kDim});
  testing::expect_error_containing(
      [&] { InPlaceRowUpdateGuard({weight}, {at::zeros({2})}); },
      {"InPlaceRowUpdateGuard: rows[0] must be a 1-D int64 CPU tensor, got Float of shape [2]"});
  testing::expect_error_containing(
      [&] {
        InPlaceRowUpdateGuard({weight, weight}, {long_tensor({1})});
      },
      {"InPlaceRowUpdateGuard: 1 row sets for 2 tensors"});
  testing::expect_error_containing(
      [&] {
        RowReadGuard(weight, at::zeros({2, 2}, at::kLong));
      },
      {"RowReadGuard: rows[0] must be a 1-D int64 CPU tensor, got Long of shape [2, 2]"});
  // Nothing stays locked: a dense update runs.
  auto dense = on_thread([] { InPlaceUpdateGuard writing; });
  ASSERT_EQ(dense.wait_for(kBound), std::future_status::ready);
}

}  // namespace row_guard_test
}  // namespace rpc
}  // namespace distoptim
