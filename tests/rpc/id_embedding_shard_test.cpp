// IdEmbeddingShard (distoptim/rpc/id_embedding_bag.h) in one process: rows start at a value of
// the id and the seed alone, ids without a row read the default row and move nothing, and a
// lookup's gradient moves only the rows that still belong to the ids it read.

#include <distoptim/rpc/id_embedding_bag.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <distoptim/rpc/detail/reassigned_rows.h>

#include "debug_info_sources.h"

namespace distoptim {
namespace rpc {
namespace id_embedding_shard_test {

constexpr int64_t kFloat = static_cast<int64_t>(c10::ScalarType::Float);

IdEmbeddingShard shard(int64_t capacity, int64_t dim, int64_t seed, int64_t admit_after = 1) {
  return IdEmbeddingShard(capacity, dim, kFloat, seed, admit_after, /*expire_after=*/0,
                          /*max_pending=*/0);
}

at::Tensor ids_of(const std::vector<int64_t>& ids) { return at::tensor(ids, at::kLong); }

// The weight's gradient as (row -> values), coalesced.
at::Tensor dense_gradient(const IdEmbeddingShard& table) {
  return table.weight.grad().coalesce().to_dense();
}

TEST(IdEmbeddingShard, AnIdsRowStartsAtTheSameValueOnAnyShardInAnyOrder) {
  const std::vector<int64_t> ids = {0x7fffffffffff0001, -3, 42, 0, 1LL << 40};
  IdEmbeddingShard small = shard(8, 6, /*seed=*/11);
  IdEmbeddingShard large = shard(1000, 6, /*seed=*/11);
  IdEmbeddingShard reseeded = shard(8, 6, /*seed=*/12);
  const at::Tensor forward_order = small.forward(ids_of(ids)).detach();
  std::vector<int64_t> reversed(ids.rbegin(), ids.rend());
  const at::Tensor reverse_order = large.forward(ids_of(reversed)).detach().flip(0);
  const at::Tensor other_seed = reseeded.forward(ids_of(ids)).detach();
  EXPECT_TRUE(at::equal(forward_order, reverse_order));
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_TRUE(at::equal(forward_order[i], small.initial_row(ids[i]))) << "id " << ids[i];
    EXPECT_FALSE(at::equal(forward_order[i], other_seed[i])) << "id " << ids[i];
  }
}

TEST(IdEmbeddingShard, InitialRowsAreStandardNormal) {
  IdEmbeddingShard table = shard(1, 8, /*seed=*/5);
  std::vector<at::Tensor> rows;
  for (int64_t id = 0; id < 4000; ++id) rows.push_back(table.initial_row(id * 7919));
  const at::Tensor values = at::stack(rows).to(at::kDouble);
  // 32,000 draws: the mean's standard error is 0.0056 and the variance's 0.008.
  EXPECT_LT(std::abs(values.mean().item<double>()), 0.03);
  EXPECT_LT(std::abs(values.var().item<double>() - 1.0), 0.05);
  // Every value's sign and magnitude vary: no column is constant.
  EXPECT_GT(values.std(0).min().item<double>(), 0.9);
}

TEST(IdEmbeddingShard, AnIdBeforeItsAdmissionReadsTheDefaultRowAndMovesNothing) {
  IdEmbeddingShard table = shard(4, 3, /*seed=*/1, /*admit_after=*/2);
  const int64_t id = 77;
  const at::Tensor first = table.forward(ids_of({id}));
  EXPECT_TRUE(at::equal(first, at::zeros({1, 3})));
  EXPECT_EQ(table.row_of(id), 0);
  first.sum().backward();
  EXPECT_TRUE(at::equal(dense_gradient(table), at::zeros({5, 3})));

  table.weight.mutable_grad() = at::Tensor();
  const at::Tensor second = table.forward(ids_of({id, id}));
  const int64_t row = table.row_of(id);
  ASSERT_GE(row, 1);
  EXPECT_TRUE(at::equal(second[0], table.initial_row(id)));
  (second * 2).sum().backward();
  at::Tensor expected = at::zeros({5, 3});
  expected[row].fill_(4);  // two lookups, each with gradient 2
  EXPECT_TRUE(at::equal(dense_gradient(table), expected));
  EXPECT_EQ(table.counters().at("unadmitted_lookups"), 1);
  EXPECT_EQ(table.counters().at("admitted"), 1);
}

TEST(IdEmbeddingShard, AGradientMovesOnlyRowsThatStillBelongToTheirIds) {
  IdEmbeddingShard table = shard(2, 4, /*seed=*/3);
  const at::Tensor read = table.forward(ids_of({10, 20}));
  const int64_t row10 = table.row_of(10), row20 = table.row_of(20);
  ASSERT_GE(row10, 1);
  ASSERT_GE(row20, 1);
  // A third id at the bound takes the row of one of them (both were used as recently).
  table.forward(ids_of({30}));
  const int64_t row30 = table.row_of(30);
  ASSERT_TRUE(row30 == row10 || row30 == row20) << row30;
  const int64_t survivor = row30 == row10 ? 20 : 10;
  const int64_t survivor_row = table.row_of(survivor);
  ASSERT_EQ(survivor_row, survivor == 10 ? row10 : row20);
  EXPECT_EQ(table.row_of(survivor == 10 ? 20 : 10), 0);
  EXPECT_TRUE(at::equal(table.weight[row30], table.initial_row(30)));

  read.sum().backward();
  at::Tensor expected = at::zeros({3, 4});
  expected[survivor_row].fill_(1);
  EXPECT_TRUE(at::equal(dense_gradient(table), expected));
  EXPECT_EQ(table.counters().at("evicted"), 1);
  EXPECT_EQ(table.counters().at("live_rows"), 2);
}

// What each optimizer over the table reads before its next step: each row handed to a new id
// since it started, once, whatever the other readers took.
TEST(IdEmbeddingShard, RowsHandedToNewIdsAreNotedOnceForEveryOptimizer) {
  IdEmbeddingShard table = shard(2, 2, /*seed=*/9);
  detail::ReassignedRowsReader first(table.weight), second(table.weight);
  first.start();
  second.start();
  bool everything = true;
  const auto noted = [&](detail::ReassignedRowsReader& reader) {
    std::vector<int64_t> rows = reader.take(everything);
    EXPECT_FALSE(everything);
    return rows;
  };
  table.forward(ids_of({10, 20}));
  std::vector<int64_t> expected = {table.row_of(10), table.row_of(20)};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(noted(first), expected);
  EXPECT_EQ(noted(first), std::vector<int64_t>{});
  table.forward(ids_of({10, 20}));  // known ids: no row changes hands
  EXPECT_EQ(noted(first), std::vector<int64_t>{});
  table.forward(ids_of({30}));
  EXPECT_EQ(noted(first), std::vector<int64_t>{table.row_of(30)});
  // The second reader took nothing yet: it gets every row noted since it began, each once.
  std::vector<int64_t> all = expected;
  EXPECT_EQ(noted(second), all);
  table.forward(ids_of({30}));
  EXPECT_EQ(noted(first), std::vector<int64_t>{});
  EXPECT_EQ(noted(second), std::vector<int64_t>{});
  // A reader that has not started (its optimizer has no state yet) keeps nothing: its first
  // take starts it and returns nothing, and it sees only what is noted after.
  detail::ReassignedRowsReader third(table.weight);
  table.forward(ids_of({40}));
  EXPECT_EQ(noted(first), std::vector<int64_t>{table.row_of(40)});
  EXPECT_EQ(noted(third), std::vector<int64_t>{});
  table.forward(ids_of({50}));
  EXPECT_EQ(noted(third), std::vector<int64_t>{table.row_of(50)});
}

// A reader that falls behind by more than twice the table's rows is told to reset everything;
// the others, which kept up, read their rows as before.
TEST(IdEmbeddingShard, AReaderFarBehindIsToldEveryRowMayBeNew) {
  IdEmbeddingShard table = shard(2, 2, /*seed=*/9);
  detail::ReassignedRowsReader behind(table.weight), current(table.weight);
  behind.start();
  current.start();
  bool everything = false;
  int64_t id = 100;
  // Each new id takes a row of the 3 (2 and the default row): 7 hand-outs exceed 2 x 3 rows.
  for (int i = 0; i < 7; ++i) {
    table.forward(ids_of({id++}));
    const std::vector<int64_t> rows = current.take(everything);
    EXPECT_FALSE(everything);
    EXPECT_EQ(rows.size(), 1u);
  }
  EXPECT_TRUE(behind.take(everything).empty());
  EXPECT_TRUE(everything);
  // Caught up, it reads rows again.
  table.forward(ids_of({id++}));
  EXPECT_EQ(behind.take(everything).size(), 1u);
  EXPECT_FALSE(everything);
}

// What a step reads of a gradient from before a hand-out: the rows handed out from a pin's
// position on, kept while the pin lives though every reader took them, and the gradient without
// them.
TEST(IdEmbeddingShard, APinKeepsTheRowsHandedOutSinceItsPosition) {
  IdEmbeddingShard table = shard(2, 2, /*seed=*/9);
  detail::ReassignedRowsReader reader(table.weight);
  reader.start();
  bool everything = true;
  table.forward(ids_of({10}));
  table.forward(ids_of({20}));
  const auto pin = std::make_unique<detail::ReassignedRowsPin>();
  const int64_t row_of_10 = table.row_of(10), row_of_20 = table.row_of(20);
  table.forward(ids_of({30}));  // takes 10's row, the least recently used
  ASSERT_EQ(table.row_of(30), row_of_10);
  // The reader takes the three hand-outs (two rows: 30 took 10's); the pin keeps the last.
  EXPECT_EQ(reader.take(everything),
            (std::vector<int64_t>{std::min(row_of_10, row_of_20), std::max(row_of_10, row_of_20)}));
  EXPECT_EQ(detail::rows_reassigned_since(table.weight, pin->position(), everything),
            std::vector<int64_t>{row_of_10});
  EXPECT_FALSE(everything);
  const detail::ReassignedRowsPin later;
  EXPECT_TRUE(detail::rows_reassigned_since(table.weight, later.position(), everything).empty());
  EXPECT_FALSE(everything);

  // A gradient of both rows from before the hand-out keeps 20's entries only.
  const at::Tensor gradient = at::_sparse_coo_tensor_unsafe(
      at::tensor({row_of_10, row_of_20, row_of_10}, at::kLong).reshape({1, 3}),
      at::arange(6, at::kFloat).reshape({3, 2}), table.weight.sizes());
  const at::Tensor kept =
      detail::without_rows_reassigned_since(table.weight, gradient, pin->position());
  at::Tensor expected = at::zeros(table.weight.sizes());
  expected[row_of_20] = at::tensor({2.0F, 3.0F});
  EXPECT_TRUE(at::equal(kept.to_dense(), expected)) << kept.to_dense();
  EXPECT_TRUE(detail::without_rows_reassigned_since(table.weight, gradient, later.position())
                  .is_same(gradient));

  // More hand-outs than the bound (twice the 3 rows) since the pin: every row may be new, and
  // the gradient keeps nothing.
  for (int64_t id = 100; id < 107; ++id) table.forward(ids_of({id}));
  EXPECT_TRUE(detail::rows_reassigned_since(table.weight, pin->position(), everything).empty());
  EXPECT_TRUE(everything);
  EXPECT_EQ(detail::without_rows_reassigned_since(table.weight, gradient, pin->position())._nnz(),
            0);
}

TEST(IdEmbeddingShard, BadArgumentsAreNamed) {
  try {
    shard(0, 4, 1);
    FAIL() << "no error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("capacity = 0"), std::string::npos) << e.what();
  }
  try {
    IdEmbeddingShard(4, 4, static_cast<int64_t>(c10::ScalarType::Int), 1, 1, 0, 0);
    FAIL() << "no error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("float32 or float64"), std::string::npos) << e.what();
  }
  IdEmbeddingShard table = shard(4, 2, 1);
  try {
    table.forward(at::zeros({2, 2}, at::kLong));
    FAIL() << "no error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("1-D int64"), std::string::npos) << e.what();
  }
  EXPECT_THROW(table.forward(at::zeros({2}, at::kInt)), c10::ValueError);
  try {
    IdEmbeddingShard(4, 4, kFloat, 1, 1, /*expire_after=*/5, 0, /*expire_after_seconds=*/2.5);
    FAIL() << "no error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("expire_after = 5 and expire_after_seconds = 2.5; give at "
                                         "most one"),
              std::string::npos)
        << e.what();
  }
  try {
    IdEmbeddingShard(4, 4, kFloat, 1, 1, 0, 0, /*expire_after_seconds=*/-1);
    FAIL() << "no error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("expire_after_seconds = -1; must be from 0"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(table.counters().at("live_rows"), 0);
  EXPECT_EQ(table.counters().at("pending_ids"), 0);
}

TEST(IdEmbeddingShard, RowsNotLookedUpForExpireAfterSecondsAreDropped) {
  // The same lookups a quarter of a second apart: a table whose rows expire after 0.1 s drops the
  // first id's row, one whose rows expire after an hour keeps it.
  IdEmbeddingShard brief(8, 2, kFloat, 1, 1, 0, 0, /*expire_after_seconds=*/0.1);
  IdEmbeddingShard lasting(8, 2, kFloat, 1, 1, 0, 0, /*expire_after_seconds=*/3600);
  for (IdEmbeddingShard* table : {&brief, &lasting}) table->forward(ids_of({5}));
  // The time that passes is what the test is about: a slower machine lets more pass.
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  for (IdEmbeddingShard* table : {&brief, &lasting}) table->forward(ids_of({6}));
  EXPECT_EQ(brief.row_of(5), 0);
  EXPECT_NE(brief.row_of(6), 0);
  EXPECT_EQ(brief.counters().at("expired"), 1);
  EXPECT_EQ(brief.counters().at("live_rows"), 1);
  EXPECT_NE(lasting.row_of(5), 0);
  EXPECT_EQ(lasting.counters().at("expired"), 0);
  EXPECT_EQ(lasting.counters().at("live_rows"), 2);
}

TEST(IdEmbeddingShard, DebugInfoSumsTheLiveShardsWhileOthersComeAndGo) {
  EXPECT_EQ(detail::debug_info_from_sources().count("id_table.shards"), 0u);
  {
    IdEmbeddingShard first = shard(4, 2, /*seed=*/1);
    IdEmbeddingShard second = shard(4, 2, /*seed=*/1, /*admit_after=*/2);
    first.forward(ids_of({1, 2, 3}));
    second.forward(ids_of({7, 8}));
    const detail::DebugCounters info = detail::debug_info_from_sources();
    EXPECT_EQ(info.at("id_table.shards"), 2);
    for (const auto& [name, value] : first.counters()) {
      EXPECT_EQ(info.at("id_table." + name), value + second.counters().at(name)) << name;
    }
    // A thread makes and drops shards while this one reads the sums: each read sees the two
    // shards above, and at most the one being made besides.
    std::thread churn([] {
      for (int i = 0; i < 100; ++i) shard(2, 2, /*seed=*/i).forward(ids_of({i}));
    });
    for (int i = 0; i < 100; ++i) {
      const int64_t shards = detail::debug_info_from_sources().at("id_table.shards");
      EXPECT_TRUE(shards == 2 || shards == 3) << shards;
    }
    churn.join();
    EXPECT_EQ(detail::debug_info_from_sources().at("id_table.shards"), 2);
  }
  EXPECT_EQ(detail::debug_info_from_sources().count("id_table.shards"), 0u);
}

}  // namespace id_embedding_shard_test
}  // namespace rpc
}  // namespace distoptim
