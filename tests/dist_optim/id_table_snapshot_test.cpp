// Snapshots of collisionless id tables (rpc::ShardedIdEmbeddingBag), across real processes on
// loopback: a table trained on 2 shards and saved loads into 3, 1 or 2 shards of another table
// (other owners, other initial rows, a previous life of its own): exactly the saved live ids
// hold rows, each on the shard that places it now, with the saved value and optimizer state
// (Adagrad's sum, SparseAdam's moments) and step count, so that a further step gives bit for bit
// the rows the saved table's own further step gives. Ids counted towards admission are not saved.
// A snapshot of another dim or dtype, a shard that cannot hold the ids it would receive, and a
// missing block file are refused before anything changes; a SnapshotSchedule's snapshots load.
// A server SIGKILLed and started again under its name gets its shard of the latest snapshot back
// through recover_lost_owners (suite IdTableRecovery).

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/dist_optim/recovery.h>
#include <distoptim/dist_optim/snapshot.h>
#include <distoptim/rpc.h>
#include <distoptim/rpc/id_embedding_bag.h>

#include "harness/multiprocess.h"
#include "harness/rpc_workers.h"
#include "id_table_rows.h"
#include "support/process_memory.h"
#include "support/test_util.h"

namespace distoptim {
namespace id_table_snapshot_test {

namespace fs = std::filesystem;
using dist_optim::DistributedOptimizer;
using rpc::IdEmbeddingShard;
using rpc::RRef;
using rpc::ShardedIdEmbeddingBag;
using rpc::ShardedIdEmbeddingBagOptions;

constexpr int64_t kDim = 4, kCapacity = 16, kBagSize = 3, kSteps = 3;

// The ids every step looks up, from all over the 64-bit space: on 2 shards 9 and 3 of them, on 3
// shards 8, 3 and 1 (checked where it matters).
const std::vector<int64_t> kPool = {3,
                                    17,
                                    42,
                                    1000,
                                    65537,
                                    -1,
                                    -12345,
                                    INT64_MAX,
                                    INT64_MIN,
                                    0x123456789ABCDEFLL,
                                    -0x7EDCBA9876543210LL,
                                    1LL << 40};
// Seen once before the snapshot: counted towards admission (admit_after 2), never admitted.
constexpr int64_t kPending = -9;
// An id of the loading tables' previous lives only.
constexpr int64_t kStranger = 777;

std::vector<int64_t> candidates() {
  std::vector<int64_t> ids = kPool;
  ids.push_back(kPending);
  ids.push_back(kStranger);
  return ids;
}

ShardedIdEmbeddingBagOptions options(std::vector<std::string> workers, int64_t seed = 5,
                                     int64_t capacity = kCapacity) {
  return ShardedIdEmbeddingBagOptions(capacity, kDim, std::move(workers))
      .admit_after(2)
      .mode(torch::kSum)
      .dtype(at::kDouble)
      .seed(seed);
}

optim::OptionBag optimizer_options(const std::string& name) {
  return name == "adagrad" ? optim::OptionBag()
                                 .set("lr", 0.1)
                                 .set("lr_decay", 0.05)
                                 .set("initial_accumulator_value", 0.1)
                           : optim::OptionBag().set("lr", 0.05);
}

// Step `step`'s bags: every pool id once, in a random order, and 3 of them again.
struct Batch {
  at::Tensor ids, offsets, target;
};
Batch batch(int step) {
  auto generator = at::detail::createCPUGenerator(300 + step);
  const int64_t n = static_cast<int64_t>(kPool.size());
  const at::Tensor order = at::randperm(n, generator, at::kLong);
  const at::Tensor again = at::randint(n, {kBagSize}, generator, at::kLong);
  const at::Tensor ids = at::tensor(kPool, at::kLong).index_select(0, at::cat({order, again}));
  return {ids, at::arange(0, ids.numel(), kBagSize, at::kLong),
          at::randn({ids.numel() / kBagSize, kDim}, generator, at::kDouble)};
}

// One step; returns the pooled output.
at::Tensor train_step(ShardedIdEmbeddingBag& table, DistributedOptimizer& optimizer, int step) {
  const Batch b = batch(step);
  dist_autograd::ContextGuard context;
  const at::Tensor out = table.forward(b.ids, b.offsets);
  dist_autograd::backward(context.id(), {at::mse_loss(out, b.target)});
  optimizer.step(context.id());
  return out.detach();
}

at::Tensor ids_of(const std::vector<int64_t>& ids) { return at::tensor(ids, at::kLong); }

// One sighting of each of `ids` (a lookup outside any autograd context).
void sight(ShardedIdEmbeddingBag& table, const std::vector<int64_t>& ids) {
  table.forward(ids_of(ids).reshape({-1, 1}));
}

// The saved table's life: every pool id seen once (admitted at its next sighting, in the first
// step), kPending once, then kSteps steps.
void train(ShardedIdEmbeddingBag& table, DistributedOptimizer& optimizer) {
  sight(table, kPool);
  sight(table, {kPending});
  for (int step = 0; step < kSteps; ++step) train_step(table, optimizer, step);
}

// A loading table's previous life: rows (and optimizer state, and a step count) for ids of the
// pool and for kStranger, and an id of the pool counted towards admission; all to be dropped.
void previous_life(ShardedIdEmbeddingBag& table, DistributedOptimizer& optimizer) {
  sight(table, {3, kStranger, -1, 42, 17});
  dist_autograd::ContextGuard context;
  const at::Tensor out = table.forward(ids_of({3, kStranger, -1, 42}).reshape({2, 2}));
  dist_autograd::backward(context.id(), {out.pow(2).sum()});
  optimizer.step(context.id());
}

DISTOPTIM_RPC_FUNCTION("id_table_snapshot_test.live_rows", id_table_test::live_rows);

// What a table holds for the candidate ids, and its optimizer's state of them.
struct Observed {
  std::map<int64_t, size_t> shard;                             // live id -> its shard
  std::map<int64_t, int64_t> row;                              // live id -> its weight row
  std::map<int64_t, at::Tensor> value;                         // live id -> its row's value
  std::map<int64_t, std::map<std::string, at::Tensor>> state;  // live id -> its state rows
  std::map<size_t, int64_t> steps;                             // shard -> its step count
  int64_t live_rows = 0, pending_ids = 0;                      // the shards' counters, summed
};

Observed observe(const ShardedIdEmbeddingBag& table, const DistributedOptimizer& optimizer) {
  Observed out;
  const at::Tensor ids = at::tensor(candidates(), at::kLong);
  const auto shards = table.shard_module_rrefs();
  for (size_t s = 0; s < shards.size(); ++s) {
    const auto [live, rows, values] = rpc::rpc_sync<std::tuple<at::Tensor, at::Tensor, at::Tensor>>(
        table.options().workers().at(s), "id_table_snapshot_test.live_rows",
        std::tuple{shards[s], ids});
    for (int64_t i = 0; i < live.numel(); ++i) {
      const int64_t id = live[i].item<int64_t>();
      EXPECT_EQ(out.shard.count(id), 0u) << "id " << id << " holds rows on two shards";
      out.shard[id] = s;
      out.row[id] = rows[i].item<int64_t>();
      out.value[id] = values[i].clone();
    }
  }
  // The optimizer's parameters are the table's shards, in shard order.
  const dist_optim::DistributedOptimizerStateDict dict = optimizer.state_dict();
  for (const auto& owner : dict.owners) {
    for (const auto& [index, state] : owner.state.state) {
      const auto s = static_cast<size_t>(owner.positions.at(index));
      out.steps[s] = state.step;
      for (const auto& [id, shard] : out.shard) {
        if (shard != s) continue;
        for (const auto& [name, buffer] : state.buffers) {
          if (buffer.dim() > 0) out.state[id][name] = buffer[out.row.at(id)].clone();
        }
      }
    }
  }
  for (const auto& counters : table.shard_counters()) {
    out.live_rows += counters.at("live_rows");
    out.pending_ids += counters.at("pending_ids");
  }
  return out;
}

// The same live ids with bit-for-bit the same values (rows of the weight may differ).
void expect_same_values(const Observed& actual, const Observed& expected) {
  std::vector<int64_t> actual_ids, expected_ids;
  for (const auto& [id, value] : actual.value) actual_ids.push_back(id);
  for (const auto& [id, value] : expected.value) expected_ids.push_back(id);
  ASSERT_EQ(actual_ids, expected_ids);
  for (const auto& [id, value] : expected.value) {
    EXPECT_TRUE(at::equal(actual.value.at(id), value))
        << "id " << id << ": " << actual.value.at(id) << " against " << value;
  }
}

// The same live ids with the same values and state rows; with `unchanged`, also on the same
// shards and rows, with the same step counts and counters (a table nothing happened to).
void expect_same(const Observed& actual, const Observed& expected, bool unchanged) {
  expect_same_values(actual, expected);
  ASSERT_EQ(actual.state.size(), expected.state.size());
  for (const auto& [id, buffers] : expected.state) {
    ASSERT_EQ(actual.state.count(id), 1u) << "id " << id << " has no optimizer state";
    const auto& loaded = actual.state.at(id);
    ASSERT_EQ(loaded.size(), buffers.size()) << "id " << id;
    for (const auto& [name, row] : buffers) {
      ASSERT_EQ(loaded.count(name), 1u) << "id " << id << ": no " << name;
      EXPECT_TRUE(at::equal(loaded.at(name), row))
          << "id " << id << ", " << name << ": " << loaded.at(name) << " against " << row;
    }
  }
  if (!unchanged) return;
  EXPECT_EQ(actual.shard, expected.shard);
  EXPECT_EQ(actual.row, expected.row);
  EXPECT_EQ(actual.steps, expected.steps);
  EXPECT_EQ(actual.live_rows, expected.live_rows);
  EXPECT_EQ(actual.pending_ids, expected.pending_ids);
}

// `fn` throws c10::ValueError whose message holds every one of `parts`.
template <class Fn>
void expect_value_error(Fn&& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected a c10::ValueError";
  } catch (const c10::ValueError& error) {
    const std::string message = error.what_without_backtrace();
    for (const auto& part : parts) {
      EXPECT_NE(message.find(part), std::string::npos)
          << "message lacks '" << part << "': " << message;
    }
  } catch (const c10::Error& error) {
    ADD_FAILURE() << "expected a c10::ValueError: " << error.what_without_backtrace();
  }
}

class TempDir {
 public:
  TempDir()
      : path_(fs::temp_directory_path() / ("id_table_snapshot_" + std::to_string(::getpid()))) {
    fs::remove_all(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

// Saves a table of 2 shards trained with `name`, continues it one step, and loads the snapshot
// into a new table on each of `splits` (other owners, another seed, a previous life): checks the
// rows, state and step counts it loaded, then that one further step matches the saved table's.
void resume_on_other_splits(const std::string& name,
                            const std::vector<std::vector<std::string>>& splits,
                            int64_t rows_per_file) {
  using testing::worker;
  TempDir dir;
  const std::string snapshot = dir / "snapshot";
  ShardedIdEmbeddingBag saved(options({worker(1), worker(2)}));
  DistributedOptimizer optimizer(name, saved.remote_parameters(), optimizer_options(name));
  train(saved, optimizer);
  dist_optim::save_snapshot(snapshot, optimizer, {}, rows_per_file, {&saved});
  const Observed at_save = observe(saved, optimizer);

  // The premises: every pool id live on its shard, kPending counted and not admitted, both
  // shards stepped as often (so the snapshot loads into any number of shards).
  ASSERT_EQ(at_save.value.size(), kPool.size());
  EXPECT_EQ(at_save.shard.count(kPending), 0u);
  EXPECT_GT(at_save.pending_ids, 0);
  EXPECT_EQ(at_save.live_rows, static_cast<int64_t>(kPool.size()));
  ASSERT_EQ(at_save.steps.size(), 2u);
  ASSERT_EQ(at_save.steps.at(0), at_save.steps.at(1));
  ASSERT_EQ(at_save.state.size(), kPool.size());
  // Blocks of at most rows_per_file rows: as many as a shard's live rows need.
  std::vector<int64_t> per_shard(2, 0);
  for (const auto& [id, shard] : at_save.shard) ++per_shard.at(shard);
  for (size_t s = 0; s < 2; ++s) {
    const int64_t blocks =
        rows_per_file > 0 ? (per_shard[s] + rows_per_file - 1) / rows_per_file : 1;
    const std::string prefix = snapshot + "/idtable-0.shard-" + std::to_string(s) + "-of-2.block-";
    EXPECT_TRUE(fs::exists(prefix + std::to_string(blocks - 1) + ".pt")) << prefix;
    EXPECT_FALSE(fs::exists(prefix + std::to_string(blocks) + ".pt")) << prefix;
  }

  // The saved table goes on: the step the loaded tables must repeat.
  const at::Tensor expected_out = train_step(saved, optimizer, kSteps);
  const Observed expected = observe(saved, optimizer);

  for (const std::vector<std::string>& workers : splits) {
    SCOPED_TRACE(name + " into " + std::to_string(workers.size()) + " shards");
    ShardedIdEmbeddingBag loaded(options(workers, /*seed=*/9));
    DistributedOptimizer loaded_optimizer(name, loaded.remote_parameters(),
                                          optimizer_options(name));
    // The premise: every shard receives ids.
    std::set<size_t> receiving;
    for (int64_t id : kPool) receiving.insert(loaded.shard_of(id));
    ASSERT_EQ(receiving.size(), workers.size());
    previous_life(loaded, loaded_optimizer);
    ASSERT_EQ(observe(loaded, loaded_optimizer).shard.count(kStranger), 1u);
    dist_optim::load_snapshot(snapshot, loaded_optimizer, {}, {&loaded});

    const Observed after_load = observe(loaded, loaded_optimizer);
    // Exactly the saved live ids hold rows, each on the shard that places it in this table.
    for (const auto& [id, shard] : after_load.shard) {
      EXPECT_EQ(shard, loaded.shard_of(id)) << "id " << id;
    }
    EXPECT_EQ(after_load.live_rows, at_save.live_rows);
    EXPECT_EQ(after_load.pending_ids, 0);
    EXPECT_EQ(after_load.shard.count(kStranger), 0u);
    EXPECT_EQ(after_load.shard.count(kPending), 0u);
    // Their saved values and state rows, and the saved step count on every shard.
    expect_same(after_load, at_save, /*unchanged=*/false);
    EXPECT_EQ(after_load.steps.size(), workers.size());
    for (const auto& [shard, step] : after_load.steps) {
      EXPECT_EQ(step, at_save.steps.at(0)) << "shard " << shard;
    }
    // A lookup of one id per bag reads the saved row.
    std::vector<int64_t> live_ids;
    std::vector<at::Tensor> live_values;
    for (const auto& [id, value] : at_save.value) {
      live_ids.push_back(id);
      live_values.push_back(value);
    }
    EXPECT_TRUE(at::equal(loaded.forward(at::tensor(live_ids, at::kLong).reshape({-1, 1})).detach(),
                          at::stack(live_values)));

    // The further step, bit for bit as the saved table's.
    EXPECT_TRUE(at::equal(train_step(loaded, loaded_optimizer, kSteps), expected_out));
    const Observed after_step = observe(loaded, loaded_optimizer);
    expect_same(after_step, expected, /*unchanged=*/false);
    for (const auto& [shard, step] : after_step.steps) {
      EXPECT_EQ(step, expected.steps.at(0)) << "shard " << shard;
    }
  }
}

TEST(IdTableSnapshot, AdagradTableOfTwoShardsResumesOnThreeAndOneBitForBit) {
  testing::with_workers(4, [] {
    using testing::worker;
    resume_on_other_splits("adagrad", {{worker(3), worker(1), worker(2)}, {worker(3)}},
                           /*rows_per_file=*/4);
  });
}

TEST(IdTableSnapshot, SparseAdamTableResumesOnTwoOtherShardsBitForBit) {
  testing::with_workers(3, [] {
    using testing::worker;
    resume_on_other_splits("sparse_adam", {{worker(2), worker(1)}}, /*rows_per_file=*/0);
  });
}

// A row handed to a new id after the optimizer's last step still holds its previous id's state
// in the optimizer (the reset waits for the next step): the snapshot saves the new id's row with a
// new state, so a step after the load moves it bit for bit as the saved table's own next step.
TEST(IdTableSnapshot, ARowHandedToANewIdAfterTheLastStepIsSavedWithANewState) {
  testing::with_workers(2, [] {
    using testing::worker;
    TempDir dir;
    const std::string snapshot = dir / "snapshot";
    // One shard of 2 rows: a third id takes the row of one of the first two.
    ShardedIdEmbeddingBag saved(options({worker(1)}, /*seed=*/5, /*capacity=*/2));
    DistributedOptimizer optimizer("adagrad", saved.remote_parameters(),
                                   optimizer_options("adagrad"));
    const int64_t first = 3, second = 17, third = 42;
    const auto step_on = [](ShardedIdEmbeddingBag& table, DistributedOptimizer& steps,
                            const std::vector<int64_t>& ids) {
      dist_autograd::ContextGuard context;
      dist_autograd::backward(context.id(), {table.forward(ids_of(ids).reshape({-1, 1})).sum()});
      steps.step(context.id());
    };
    sight(saved, {first, second});
    for (int step = 0; step < 3; ++step) step_on(saved, optimizer, {first, second});
    sight(saved, {third});
    sight(saved, {third});  // admitted: evicts one of the first two
    ASSERT_EQ(saved.shard_counters().at(0).at("evicted"), 1);
    dist_optim::save_snapshot(snapshot, optimizer, {}, /*rows_per_file=*/0, {&saved});
    step_on(saved, optimizer, {third});
    const Observed expected = observe(saved, optimizer);

    ShardedIdEmbeddingBag loaded(options({worker(1)}, /*seed=*/9, /*capacity=*/2));
    DistributedOptimizer loaded_optimizer("adagrad", loaded.remote_parameters(),
                                          optimizer_options("adagrad"));
    dist_optim::load_snapshot(snapshot, loaded_optimizer, {}, {&loaded});
    step_on(loaded, loaded_optimizer, {third});
    const Observed actual = observe(loaded, loaded_optimizer);
    ASSERT_EQ(expected.value.count(third), 1u);
    expect_same(actual, expected, /*unchanged=*/false);
  });
}

TEST(IdTableSnapshot, BadLoadsAreRefusedAndChangeNothing) {
  testing::with_workers(3, [] {
    using testing::worker;
    TempDir dir;
    const std::string snapshot = dir / "good";
    ShardedIdEmbeddingBag saved(options({worker(1), worker(2)}));
    DistributedOptimizer optimizer("adagrad", saved.remote_parameters(),
                                   optimizer_options("adagrad"));
    train(saved, optimizer);
    dist_optim::save_snapshot(snapshot, optimizer, {}, /*rows_per_file=*/0, {&saved});
    const Observed at_save = observe(saved, optimizer);

    // Another embedding dim, another dtype: refused naming the manifest.
    for (const ShardedIdEmbeddingBagOptions& other :
         {options({worker(1)}).embedding_dim(kDim + 1), options({worker(1)}).dtype(at::kFloat)}) {
      SCOPED_TRACE(std::to_string(other.embedding_dim()) + " " + c10::toString(other.dtype()));
      ShardedIdEmbeddingBag table(other);
      DistributedOptimizer table_optimizer("adagrad", table.remote_parameters(),
                                           optimizer_options("adagrad"));
      sight(table, {3, kStranger});
      sight(table, {3, kStranger});
      const std::vector<at::Tensor> before =
          testing::clone_all({table.forward(ids_of({3, kStranger}).reshape({2, 1}))});
      expect_value_error(
          [&] { dist_optim::load_snapshot(snapshot, table_optimizer, {}, {&table}); },
          {snapshot + "/manifest.pt"});
      testing::expect_all_equal({table.forward(ids_of({3, kStranger}).reshape({2, 1}))}, before);
      EXPECT_EQ(table.shard_counters().at(0).at("live_rows"), 2);
    }

    // Two shards whose first would receive more ids than it holds rows: refused by its owner,
    // naming the capacity, and neither shard changes.
    constexpr int64_t kSmall = 5;
    ShardedIdEmbeddingBag small(options({worker(2), worker(1)}, /*seed=*/9, kSmall));
    DistributedOptimizer small_optimizer("adagrad", small.remote_parameters(),
                                         optimizer_options("adagrad"));
    previous_life(small, small_optimizer);
    std::vector<int64_t> receives(2, 0);
    for (const auto& [id, value] : at_save.value) ++receives.at(small.shard_of(id));
    ASSERT_GT(receives[0], kSmall);
    ASSERT_LE(receives[1], kSmall);
    const Observed small_before = observe(small, small_optimizer);
    ASSERT_GT(small_before.live_rows, 0);
    try {
      dist_optim::load_snapshot(snapshot, small_optimizer, {}, {&small});
      ADD_FAILURE() << "a shard loaded more ids than its capacity";
    } catch (const rpc::RemoteError& error) {
      EXPECT_EQ(error.worker_name(), worker(2));
      EXPECT_NE(std::string(error.what()).find("capacity"), std::string::npos) << error.what();
    }
    expect_same(observe(small, small_optimizer), small_before, /*unchanged=*/true);

    // Fewer id tables than saved.
    testing::expect_error_containing([&] { dist_optim::load_snapshot(snapshot, small_optimizer); },
                                     {snapshot + "/manifest.pt"});
    expect_same(observe(small, small_optimizer), small_before, /*unchanged=*/true);

    // A block file missing: named, nothing changed.
    const std::string bad = dir / "bad";
    fs::copy(snapshot, bad);
    std::vector<std::string> blocks;
    for (const auto& entry : fs::directory_iterator(bad)) {
      if (entry.path().filename().string().rfind("idtable-", 0) == 0) {
        blocks.push_back(entry.path().string());
      }
    }
    std::sort(blocks.begin(), blocks.end());
    ASSERT_EQ(blocks.size(), 2u);  // one block per shard
    const std::string missing = blocks.back();
    fs::remove(missing);
    ShardedIdEmbeddingBag good(options({worker(1), worker(2)}, /*seed=*/9));
    DistributedOptimizer good_optimizer("adagrad", good.remote_parameters(),
                                        optimizer_options("adagrad"));
    previous_life(good, good_optimizer);
    const Observed good_before = observe(good, good_optimizer);
    testing::expect_error_containing(
        [&] { dist_optim::load_snapshot(bad, good_optimizer, {}, {&good}); }, {missing});
    expect_same(observe(good, good_optimizer), good_before, /*unchanged=*/true);

    // The intact snapshot loads into it after all (the same split: the same shards and steps).
    dist_optim::load_snapshot(snapshot, good_optimizer, {}, {&good});
    const Observed good_after = observe(good, good_optimizer);
    expect_same(good_after, at_save, /*unchanged=*/false);
    EXPECT_EQ(good_after.shard, at_save.shard);
    EXPECT_EQ(good_after.steps, at_save.steps);
  });
}

TEST(IdTableSnapshot, AScheduleWritesSnapshotsThatLoadLatestLoads) {
  testing::with_workers(3, [] {
    using testing::worker;
    TempDir dir;
    const std::string snapshots = dir / "schedule";
    ShardedIdEmbeddingBag table(options({worker(1), worker(2)}));
    DistributedOptimizer optimizer("adagrad", table.remote_parameters(),
                                   optimizer_options("adagrad"));
    sight(table, kPool);
    std::map<int64_t, Observed> after;  // by steps taken
    std::vector<int64_t> finished;
    {
      dist_optim::SnapshotSchedule schedule(dist_optim::SnapshotOptions(snapshots).every_steps(2),
                                            optimizer, {}, /*step=*/0, {&table});
      for (int step = 0; step < 4; ++step) {
        train_step(table, optimizer, step);
        after[step + 1] = observe(table, optimizer);
        if (auto done = schedule.step()) finished.push_back(*done);
        // The first snapshot finished before the second is due, whatever the owners' pace.
        if (step == 1) {
          if (auto done = schedule.flush()) finished.push_back(*done);
        }
      }
      if (auto done = schedule.flush()) finished.push_back(*done);
    }
    EXPECT_EQ(finished, (std::vector<int64_t>{2, 4}));
    const auto latest = dist_optim::latest_snapshot(snapshots);
    ASSERT_TRUE(latest.has_value());
    EXPECT_EQ(latest->step, 4);

    // The snapshot of step 2 as the table was after it, into one shard.
    {
      ShardedIdEmbeddingBag one(options({worker(2)}, /*seed=*/9));
      DistributedOptimizer one_optimizer("adagrad", one.remote_parameters(),
                                         optimizer_options("adagrad"));
      dist_optim::load_snapshot(snapshots + "/step-000000000002", one_optimizer, {}, {&one});
      expect_same(observe(one, one_optimizer), after.at(2), /*unchanged=*/false);
    }
    ShardedIdEmbeddingBag resumed(options({worker(2), worker(1)}, /*seed=*/9));
    DistributedOptimizer resumed_optimizer("adagrad", resumed.remote_parameters(),
                                           optimizer_options("adagrad"));
    EXPECT_EQ(dist_optim::load_latest_snapshot(snapshots, resumed_optimizer, {}, {&resumed}),
              std::optional<int64_t>(4));
    const Observed loaded = observe(resumed, resumed_optimizer);
    expect_same(loaded, after.at(4), /*unchanged=*/false);
    EXPECT_EQ(loaded.steps.size(), 2u);
    for (const auto& [shard, step] : loaded.steps) {
      EXPECT_EQ(step, after.at(4).steps.at(0)) << "shard " << shard;
    }
    EXPECT_EQ(dist_optim::load_latest_snapshot(dir / "none", resumed_optimizer, {}, {&resumed}),
              std::nullopt);
  });
}

// What `observed` holds of shard `shard` alone.
Observed on_shard(const Observed& observed, size_t shard) {
  Observed out;
  for (const auto& [id, s] : observed.shard) {
    if (s != shard) continue;
    out.shard[id] = s;
    out.row[id] = observed.row.at(id);
    out.value[id] = observed.value.at(id);
    if (observed.state.count(id) > 0) out.state[id] = observed.state.at(id);
  }
  if (observed.steps.count(shard) > 0) out.steps[shard] = observed.steps.at(shard);
  return out;
}

// Whether a step fails as lost (the table names a server that died).
bool step_fails_as_lost(ShardedIdEmbeddingBag& table, DistributedOptimizer& optimizer, int step) {
  try {
    train_step(table, optimizer, step);
  } catch (const PeerLostError&) {
    return true;
  }
  return false;
}

// The first trainer's references to its table, for the second trainer's handle.
using References = std::tuple<std::vector<RRef<IdEmbeddingShard>>, std::vector<std::string>>;
std::mutex g_references_mutex;
References g_references;  // guarded by g_references_mutex
References references() {
  std::lock_guard<std::mutex> lock(g_references_mutex);
  return g_references;
}
DISTOPTIM_RPC_FUNCTION("id_table_recovery.references", references);

// The trainer: a table over ps0 and ps1 stepped with Adagrad, a snapshot after step 2; ps1 dies
// after step 3, and its next incarnation gets ps1's shard of that snapshot back (its live ids,
// their rows and this trainer's state of them, its step count), while ps0's shard keeps step 3;
// training goes on over both. With `writer_restores` this trainer, which wrote the snapshot,
// makes the shard anew and loads it; else the second trainer does (the values alone), and this
// one binds to it and loads its own state there, id by id.
void train_through_a_restart(const std::string& directory, bool writer_restores) {
  using namespace std::chrono_literals;
  testing::StoreTurns turns(2, "test/id_table_recovery");
  ASSERT_TRUE(testing::wait_until(
      [] {
        try {
          rpc::get_worker_info("ps1");
          return true;
        } catch (const c10::ValueError&) {
          return false;
        }
      },
      30s));
  ShardedIdEmbeddingBag table(options({"ps0", "ps1"}));
  DistributedOptimizer optimizer("adagrad", table.remote_parameters(),
                                 optimizer_options("adagrad"));
  dist_optim::SnapshotSchedule snapshots(dist_optim::SnapshotOptions(directory), optimizer, {}, 0,
                                         {&table});
  sight(table, kPool);
  Observed at_snapshot;
  for (int step = 1; step <= 3; ++step) {
    train_step(table, optimizer, step);
    snapshots.step();
    if (step == 2) {
      ASSERT_EQ(snapshots.save_now(), 2);
      at_snapshot = observe(table, optimizer);
    }
  }
  const Observed before_death = observe(table, optimizer);
  {
    std::lock_guard<std::mutex> lock(g_references_mutex);
    g_references = References{table.shard_module_rrefs(), table.shard_keys()};
  }
  turns.say("references");
  turns.store->wait({"second_trainer_ready"}, 120s);
  // The premise: both shards hold ids, and ps1's changed since the snapshot.
  ASSERT_FALSE(on_shard(at_snapshot, 0).value.empty());
  ASSERT_FALSE(on_shard(at_snapshot, 1).value.empty());
  ASSERT_NE(on_shard(before_death, 1).steps.at(1), on_shard(at_snapshot, 1).steps.at(1));

  turns.say("kill_ps1");
  ASSERT_TRUE(testing::wait_until(
      [] {
        try {
          rpc::rpc_sync<std::string>("ps1", "id_table_recovery.name", std::tuple<>{}, 5s);
        } catch (const PeerLostError&) {
          return true;
        } catch (const c10::ValueError&) {  // already dropped
          return true;
        }
        return false;
      },
      60s))
      << "ps1 did not die";
  EXPECT_TRUE(step_fails_as_lost(table, optimizer, 4)) << "the step after ps1's death did not fail";
  turns.say("ps1_lost");
  turns.store->wait({"second_trainer_failed"}, 120s);
  // Without the collisionless table, ps1's shard counts as a parameter of no table: refused.
  expect_value_error(
      [&] {
        dist_optim::recover_lost_owners(optimizer, {}, {},
                                        dist_optim::RecoveryOptions(directory).timeout(60s));
      },
      {"worker 'ps1' was lost holding 1 parameter(s) of the optimizer that are no table's shard"});
  // A backup's copies are rows without their ids: such a table comes back from snapshots only.
  expect_value_error(
      [&] {
        dist_optim::recover_lost_owners(optimizer, {}, {},
                                        dist_optim::RecoveryOptions(directory)
                                            .backups({{"ps1", "ps0"}})
                                            .hot_standby(true)
                                            .timeout(60s),
                                        {&table});
      },
      {"worker 'ps1' was lost holding 1 shard(s) of a collisionless table",
       "names its backup 'ps0': such tables come back from snapshots only"});
  if (!writer_restores) {
    turns.say("restore_first");
    turns.store->wait({"restored"}, 120s);
  }
  const std::vector<dist_optim::RecoveredOwner> recovered = dist_optim::recover_lost_owners(
      optimizer, {}, {}, dist_optim::RecoveryOptions(directory).timeout(60s), {&table});
  ASSERT_EQ(recovered.size(), 1u);
  EXPECT_EQ(recovered[0].worker, "ps1");
  EXPECT_EQ(recovered[0].restored_here, writer_restores);
  EXPECT_EQ(recovered[0].snapshot_step.value_or(-1), 2);
  EXPECT_EQ(recovered[0].state_step.value_or(-1), 2);
  EXPECT_EQ(rpc::rpc_sync<std::string>("ps1", "id_table_recovery.name", std::tuple<>{}),
            "second ps1");

  const Observed after = observe(table, optimizer);
  const Observed ps1_after = on_shard(after, 1), ps1_expected = on_shard(at_snapshot, 1);
  expect_same(ps1_after, ps1_expected, /*unchanged=*/false);
  EXPECT_EQ(ps1_after.steps, ps1_expected.steps);
  expect_same(on_shard(after, 0), on_shard(before_death, 0), /*unchanged=*/true);
  turns.say(writer_restores ? "restored" : "first_trainer_bound");
  turns.store->wait({"second_trainer_done"}, 120s);
  // Training goes on over both shards: every live id's row moves.
  train_step(table, optimizer, 4);
  const Observed stepped = observe(table, optimizer);
  for (const auto& [id, value] : after.value) {
    EXPECT_FALSE(at::equal(stepped.value.at(id), value)) << "id " << id << " did not move";
  }
  turns.say("done");
  rpc::shutdown();
}

// The second trainer: a handle built from the first trainer's references and keys, and an
// Adagrad of its own that has not stepped when ps1 dies. It binds to the shard the first trainer
// restored (by its key), or with `writer_restores` false restores it itself; either way its state
// there starts anew, as the snapshot holds the first trainer's.
void train_beside(const std::string& directory, bool writer_restores) {
  using namespace std::chrono_literals;
  testing::StoreTurns turns(4, "test/id_table_recovery");
  turns.store->wait({"references"}, 200s);
  auto [shards, keys] = rpc::rpc_sync<References>("trainer", "id_table_recovery.references");
  ShardedIdEmbeddingBag table(options({"ps0", "ps1"}), std::move(shards), keys);
  EXPECT_EQ(table.shard_keys(), keys);
  DistributedOptimizer optimizer("adagrad", table.remote_parameters(),
                                 optimizer_options("adagrad"));
  turns.say("second_trainer_ready");
  turns.store->wait({"ps1_lost"}, 200s);
  EXPECT_TRUE(step_fails_as_lost(table, optimizer, 10));
  turns.say("second_trainer_failed");
  turns.store->wait({writer_restores ? "restored" : "restore_first"}, 200s);
  const std::vector<dist_optim::RecoveredOwner> recovered = dist_optim::recover_lost_owners(
      optimizer, {}, {}, dist_optim::RecoveryOptions(directory).timeout(60s), {&table});
  ASSERT_EQ(recovered.size(), 1u);
  EXPECT_EQ(recovered[0].restored_here, !writer_restores);
  EXPECT_EQ(recovered[0].snapshot_step.value_or(-1), 2);
  EXPECT_FALSE(recovered[0].state_step.has_value());
  EXPECT_EQ(table.shard_keys(), keys);
  // A new Adagrad's state on the restored shard (no step, every sum at its initial value); one
  // step later, stepped once.
  const Observed bound = on_shard(observe(table, optimizer), 1);
  ASSERT_FALSE(bound.value.empty());
  EXPECT_EQ(bound.steps.at(1), 0);
  ASSERT_EQ(bound.state.size(), bound.value.size());
  for (const auto& [id, buffers] : bound.state) {
    const at::Tensor& sum = buffers.at("sum");
    EXPECT_TRUE(at::equal(sum, at::full_like(sum, 0.1))) << "id " << id << ": " << sum;
  }
  if (!writer_restores) {
    // The first trainer binds and checks the shard as the snapshot left it before this one steps.
    turns.say("restored");
    turns.store->wait({"first_trainer_bound"}, 200s);
  }
  train_step(table, optimizer, 10);
  EXPECT_EQ(observe(table, optimizer).steps.at(1), 1);
  turns.say("second_trainer_done");
  rpc::shutdown();
}

std::string g_name;
DISTOPTIM_RPC_FUNCTION("id_table_recovery.name", [] { return g_name; });

// Processes: rank 0 "ps0", the dynamic group's store host; rank 1 the first "ps1", which
// SIGKILLs itself when told; rank 2 the trainer; rank 3 the second "ps1", which joins once the
// trainer has seen the first lost; rank 4 the second trainer. The parameter: whether the trainer
// that wrote the snapshot restores the shard (else the other one does first).
class IdTableRecovery : public ::testing::TestWithParam<bool> {};

TEST_P(IdTableRecovery, ALostServerGetsItsShardOfTheLatestSnapshotBack) {
  using namespace std::chrono_literals;
  const bool writer_restores = GetParam();
  testing::RunRanksOptions run;
  run.deadline = 240s;
  run.expected_signals = {{1, SIGKILL}};
  testing::run_ranks(
      5,
      [writer_restores](int rank, int) {
        // The same directory in every rank: named after the run's MASTER_PORT.
        const char* port = std::getenv("MASTER_PORT");
        const std::string directory =
            (fs::temp_directory_path() / ("id_table_recovery_" + std::string(port ? port : "0")))
                .string();
        rpc::RpcBackendOptions rpc_options = testing::test_options(30s).liveness_timeout(2s);
        if (rank == 0) {
          fs::remove_all(directory);  // before anyone can step: no earlier run's snapshots
          g_name = "ps0";
          rpc::init_rpc("ps0", 0, rpc_options);
          testing::StoreTurns turns(0, "test/id_table_recovery");
          turns.store->wait({"done"}, 200s);
          rpc::shutdown();
          fs::remove_all(directory);
          return;
        }
        testing::StoreTurns turns(rank, "test/id_table_recovery");
        if (rank == 1) {
          g_name = "first ps1";
          rpc::init_rpc("ps1", rpc::kAssignRank, rpc_options);
          turns.store->wait({"kill_ps1"}, 200s);
          ::kill(::getpid(), SIGKILL);
          return;
        }
        if (rank == 2) {
          rpc::init_rpc("trainer", rpc::kAssignRank, rpc_options);
          train_through_a_restart(directory, writer_restores);
          return;
        }
        if (rank == 4) {
          rpc::init_rpc("trainer2", rpc::kAssignRank, rpc_options);
          train_beside(directory, writer_restores);
          return;
        }
        g_name = "second ps1";
        turns.store->wait({"ps1_lost"}, 200s);
        rpc::init_rpc("ps1", rpc::kAssignRank, rpc_options.name_wait(60s));
        turns.store->wait({"done"}, 200s);
        rpc::shutdown();
      },
      run);
}

INSTANTIATE_TEST_SUITE_P(WhoRestores, IdTableRecovery, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("TheSnapshotsWriter")
                                             : std::string("AnotherTrainer");
                         });

}  // namespace id_table_snapshot_test
}  // namespace distoptim
