// Snapshots that the parameters' owners write and read themselves, across real processes on
// loopback. A table with a RemoteModule beside it resumes on other owners bit for bit; a
// SnapshotSchedule keeps the last snapshots and the latest loads as it was taken; a step taken
// right after a snapshot began is not in it, however slow an owner is to copy, and steps still
// outstanding (max_staleness) are; damaged snapshots are refused naming the file and the owner
// that read it; a schedule has every owner map the memory of its copies when it is made. The
// sharded table's checkpoints (save_sharded_table, a snapshot of one table alone): a run
// checkpointed with 3 shards (in one block per shard, or in blocks of 7 rows) and resumed with 2 or
// 1 (or 3) continues bit for bit as the uninterrupted 3-shard run, with Adagrad (lr_decay, so the
// step count matters) and SparseAdam; a shard without optimizer state loads into the same split;
// bad checkpoints are refused naming the file (and the owner that read it), the table and optimizer
// unchanged.

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/dist_optim/sharded_table_checkpoint.h>
#include <distoptim/dist_optim/snapshot.h>
#include <distoptim/rpc.h>

#include "harness/rpc_workers.h"
#include "support/process_memory.h"
#include "support/test_util.h"

namespace {
// A float Linear layer held by a RemoteModule beside the table.
struct SnapshotLinear : torch::nn::LinearImpl {
  SnapshotLinear(int64_t in, int64_t out) : torch::nn::LinearImpl(in, out) {}
};
}  // namespace
DISTOPTIM_REMOTE_MODULE(SnapshotLinear, int64_t, int64_t);
DISTOPTIM_RPC_FUNCTION("snapshot_test.resident_bytes",
                       [] { return distoptim::testing::resident_bytes(); });

namespace distoptim {
namespace snapshot_test {

namespace fs = std::filesystem;
using dist_optim::DistributedOptimizer;
using rpc::ShardedEmbeddingBag;
using rpc::ShardedEmbeddingBagOptions;

constexpr int64_t kRows = 100, kDim = 6, kBags = 10;

ShardedEmbeddingBagOptions options(std::vector<std::string> workers, int64_t seed = 5) {
  return ShardedEmbeddingBagOptions(kRows, kDim, std::move(workers)).mode(torch::kSum).seed(seed);
}

optim::OptionBag optimizer_options(const std::string& name) {
  return name == "adagrad" ? optim::OptionBag().set("lr", 0.1).set("lr_decay", 0.05)
                           : optim::OptionBag().set("lr", 0.01);
}

// Step `step`'s bags: every shard of every split gets ids (0, 50 and 99 are always there).
struct Batch {
  at::Tensor ids, offsets, target;
};
Batch batch(int step) {
  auto generator = at::detail::createCPUGenerator(100 + step);
  const at::Tensor random = at::randint(kRows, {3 * kBags - 3}, generator, at::kLong);
  return {at::cat({at::tensor({0, 50, 99}, at::kLong), random}),
          at::arange(0, 3 * kBags, 3, at::kLong), at::randn({kBags, kDim}, generator)};
}

// One step; returns the pooled output.
at::Tensor train_step(ShardedEmbeddingBag& table, DistributedOptimizer& optimizer, int step) {
  const Batch b = batch(step);
  dist_autograd::ContextGuard context;
  const at::Tensor out = table.forward(b.ids, b.offsets);
  dist_autograd::backward(context.id(), {at::mse_loss(out, b.target)});
  optimizer.step(context.id());
  return out.detach();
}

class TempDir {
 public:
  TempDir() : path_(fs::temp_directory_path() / ("sharded_table_" + std::to_string(::getpid()))) {
    fs::remove_all(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

TEST(ShardedTableCheckpoint, ResumesOnAnotherNumberOfShardsBitForBit) {
  testing::with_workers(4, [] {
    using testing::worker;
    TempDir dir;
    for (const auto& [name, rows_per_file] : std::vector<std::pair<std::string, int64_t>>{
             {"adagrad", 0}, {"sparse_adam", 0}, {"adagrad", 7}}) {
      SCOPED_TRACE(name + " in blocks of " + std::to_string(rows_per_file) + " rows");
      const std::string checkpoint = dir / (name + std::to_string(rows_per_file));
      ShardedEmbeddingBag three(options({worker(1), worker(2), worker(3)}));
      DistributedOptimizer optimizer(name, three.remote_parameters(), optimizer_options(name));
      for (int step = 0; step < 3; ++step) train_step(three, optimizer, step);
      dist_optim::save_sharded_table(checkpoint, three, optimizer, rows_per_file);
      // Shard 1 holds rows [34, 67): in blocks of 7 rows, its last block is [62, 67).
      EXPECT_EQ(fs::exists(checkpoint + "/table-0.shard-1-of-3.block-4.pt"), rows_per_file == 7);
      std::vector<at::Tensor> expected;
      for (int step = 3; step < 6; ++step) expected.push_back(train_step(three, optimizer, step));
      const at::Tensor expected_table = three.weight();

      for (const std::vector<std::string>& workers : std::vector<std::vector<std::string>>{
               {worker(1), worker(2)}, {worker(3)}, {worker(2), worker(3), worker(1)}}) {
        SCOPED_TRACE(workers.size());
        // Other initial rows, so only the checkpoint can make them equal.
        ShardedEmbeddingBag resumed(options(workers, /*seed=*/9));
        DistributedOptimizer resumed_optimizer(name, resumed.remote_parameters(),
                                               optimizer_options(name));
        dist_optim::load_sharded_table(checkpoint, resumed, resumed_optimizer);
        for (int step = 3; step < 6; ++step) {
          EXPECT_TRUE(at::equal(train_step(resumed, resumed_optimizer, step), expected[step - 3]))
              << "step " << step;
        }
        EXPECT_TRUE(at::equal(resumed.weight(), expected_table));
      }
    }
  });
}

TEST(ShardedTableCheckpoint, BadCheckpointsAreRefusedNamingTheFileAndChangeNothing) {
  testing::with_workers(3, [] {
    using testing::worker;
    TempDir dir;
    const std::string checkpoint = dir / "good";
    ShardedEmbeddingBag three(options({worker(1), worker(2), worker(1)}));
    DistributedOptimizer optimizer("adagrad", three.remote_parameters(),
                                   optimizer_options("adagrad"));
    train_step(three, optimizer, 0);
    dist_optim::save_sharded_table(checkpoint, three, optimizer);

    ShardedEmbeddingBag two(options({worker(1), worker(2)}, /*seed=*/9));
    DistributedOptimizer two_optimizer("adagrad", two.remote_parameters(),
                                       optimizer_options("adagrad"));
    const at::Tensor rows_before = two.weight();
    const auto state_before = two_optimizer.state_dict();
    auto expect_unchanged = [&] {
      EXPECT_TRUE(at::equal(two.weight(), rows_before));
      const auto state = two_optimizer.state_dict();
      ASSERT_EQ(state.owners.size(), state_before.owners.size());
      for (size_t k = 0; k < state.owners.size(); ++k) {
        for (const auto& [index, s] : state.owners[k].state.state) {
          const auto& before = state_before.owners[k].state.state.at(index);
          EXPECT_EQ(s.step, before.step);
          for (const auto& [buffer, value] : s.buffers) {
            EXPECT_TRUE(at::equal(value, before.buffers.at(buffer)));
          }
        }
      }
    };

    // A table of another dim, another optimizer.
    ShardedEmbeddingBag wide(ShardedEmbeddingBagOptions(kRows, kDim + 1, {worker(1)}));
    DistributedOptimizer wide_optimizer("adagrad", wide.remote_parameters(),
                                        optimizer_options("adagrad"));
    testing::expect_error_containing(
        [&] { dist_optim::load_sharded_table(checkpoint, wide, wide_optimizer); },
        {"load_snapshot: '" + checkpoint + "/manifest.pt' holds a table of 100 x 6",
         "this table is 100 x 7"});
    DistributedOptimizer sgd("sgd", two.remote_parameters(), optim::OptionBag().set("lr", 0.1));
    testing::expect_error_containing([&] { dist_optim::load_sharded_table(checkpoint, two, sgd); },
                                     {"holds the state of optimizer 'adagrad', this one is 'sgd'"});

    // A shard file from another split (its rows do not match the manifest's range).
    const std::string other = dir / "other";
    ShardedEmbeddingBag four(options({worker(1), worker(2), worker(1), worker(2)}));
    DistributedOptimizer four_optimizer("adagrad", four.remote_parameters(),
                                        optimizer_options("adagrad"));
    dist_optim::save_sharded_table(other, four, four_optimizer);
    const std::string bad = dir / "bad";
    fs::copy(checkpoint, bad);
    fs::copy_file(other + "/table-0.shard-1-of-4.block-0.pt",
                  bad + "/table-0.shard-1-of-3.block-0.pt", fs::copy_options::overwrite_existing);
    testing::expect_error_containing(
        [&] { dist_optim::load_sharded_table(bad, two, two_optimizer); },
        {"'" + bad +
         "/table-0.shard-1-of-3.block-0.pt' is a block of shard 1 with rows [25, 50); the manifest "
         "names a block of shard 1 with rows [34, 67)"});
    expect_unchanged();

    // A block missing, or damaged: named by the owner that needed it (shard 2 of 3, rows
    // [67, 100), goes to the second of two shards alone).
    fs::remove(bad + "/table-0.shard-1-of-3.block-0.pt");
    testing::expect_error_containing(
        [&] { dist_optim::load_sharded_table(bad, two, two_optimizer); },
        {"load_snapshot", bad + "/table-0.shard-1-of-3.block-0.pt"});
    fs::copy_file(checkpoint + "/table-0.shard-1-of-3.block-0.pt",
                  bad + "/table-0.shard-1-of-3.block-0.pt");
    {
      std::fstream file(bad + "/table-0.shard-2-of-3.block-0.pt",
                        std::ios::in | std::ios::out | std::ios::binary);
      file.seekg(200);
      const char byte = static_cast<char>(file.get());
      file.seekp(200);
      file.put(static_cast<char>(~byte));
    }
    try {
      dist_optim::load_sharded_table(bad, two, two_optimizer);
      ADD_FAILURE() << "a damaged block loaded";
    } catch (const rpc::RemoteError& error) {
      EXPECT_EQ(error.worker_name(), worker(2));
      EXPECT_NE(std::string(error.what()).find(bad + "/table-0.shard-2-of-3.block-0.pt"),
                std::string::npos)
          << error.what();
      EXPECT_EQ(std::string(error.what()).find("worker '" + worker(1) + "'"), std::string::npos)
          << error.what();
    }
    expect_unchanged();

    // Shards that counted different steps load only into as many shards.
    const std::string uneven = dir / "uneven";
    {
      dist_autograd::ContextGuard context;
      dist_autograd::backward(
          context.id(),
          {three.forward(at::tensor({0, 1}, at::kLong), at::tensor({0}, at::kLong)).sum()});
      optimizer.step(context.id());  // shard 0 only
    }
    dist_optim::save_sharded_table(uneven, three, optimizer);
    testing::expect_error_containing(
        [&] { dist_optim::load_sharded_table(uneven, two, two_optimizer); },
        {"'" + uneven +
             "/manifest.pt': shard 1 counted 1 steps (buffers sum), shard 0 counted 2 "
             "steps (buffers sum)",
         "loads only into 3 shards"});
    expect_unchanged();
    ShardedEmbeddingBag three_again(options({worker(2), worker(1), worker(2)}, /*seed=*/9));
    DistributedOptimizer three_again_optimizer("adagrad", three_again.remote_parameters(),
                                               optimizer_options("adagrad"));
    dist_optim::load_sharded_table(uneven, three_again, three_again_optimizer);
    EXPECT_TRUE(at::equal(three_again.weight(), three.weight()));
  });
}

// A checkpoint in which a later shard has no optimizer state (SparseAdam creates it at a shard's
// first gradient) loads into as many shards, state and all, and is refused, naming the shard,
// by another number of shards.
TEST(ShardedTableCheckpoint, AShardWithoutStateLoadsIntoTheSameSplit) {
  testing::with_workers(3, [] {
    using testing::worker;
    TempDir dir;
    const std::string checkpoint = dir / "partial";
    ShardedEmbeddingBag three(options({worker(1), worker(2), worker(1)}));
    DistributedOptimizer optimizer("sparse_adam", three.remote_parameters(),
                                   optimizer_options("sparse_adam"));
    {
      dist_autograd::ContextGuard context;
      dist_autograd::backward(
          context.id(),
          {three.forward(at::tensor({0, 1}, at::kLong), at::tensor({0}, at::kLong)).sum()});
      optimizer.step(context.id());  // shard 0 only
    }
    const auto saved_state = optimizer.state_dict();
    dist_optim::save_sharded_table(checkpoint, three, optimizer);

    ShardedEmbeddingBag again(options({worker(2), worker(1), worker(2)}, /*seed=*/9));
    DistributedOptimizer again_optimizer("sparse_adam", again.remote_parameters(),
                                         optimizer_options("sparse_adam"));
    dist_optim::load_sharded_table(checkpoint, again, again_optimizer);
    EXPECT_TRUE(at::equal(again.weight(), three.weight()));
    // By shard: shard 0 has a step and both moments, shards 1 and 2 nothing.
    auto by_shard = [](const dist_optim::DistributedOptimizerStateDict& dict) {
      std::map<int64_t, optim::OptimizerStateDict::State> out;
      for (const auto& owner : dict.owners) {
        for (const auto& [index, state] : owner.state.state) out[owner.positions[index]] = state;
      }
      return out;
    };
    const auto expected = by_shard(saved_state), loaded = by_shard(again_optimizer.state_dict());
    ASSERT_EQ(expected.size(), 1u);
    ASSERT_EQ(loaded.size(), 1u);
    const auto& state = loaded.at(0);
    EXPECT_EQ(state.step, expected.at(0).step);
    ASSERT_EQ(state.buffers.size(), expected.at(0).buffers.size());
    for (const auto& [name, buffer] : expected.at(0).buffers) {
      EXPECT_TRUE(at::equal(state.buffers.at(name), buffer)) << name;
    }

    ShardedEmbeddingBag two(options({worker(1), worker(2)}, /*seed=*/9));
    DistributedOptimizer two_optimizer("sparse_adam", two.remote_parameters(),
                                       optimizer_options("sparse_adam"));
    const at::Tensor rows_before = two.weight();
    testing::expect_error_containing(
        [&] { dist_optim::load_sharded_table(checkpoint, two, two_optimizer); },
        {"'" + checkpoint +
             "/manifest.pt': shard 1 has no optimizer state, shard 0 counted 1 steps",
         "loads only into 3 shards"});
    EXPECT_TRUE(at::equal(two.weight(), rows_before));
  });
}

namespace {  // as SnapshotLinear, which its field names

// A table and a RemoteModule over its pooled rows, trained by one optimizer of two groups.
struct Model {
  Model(const std::vector<std::string>& table_workers, const std::string& linear_worker,
        int64_t seed)
      : table(options(table_workers, seed)),
        linear(std::make_shared<rpc::RemoteModule<SnapshotLinear>>(linear_worker,
                                                                   std::tuple{kDim, int64_t{2}})),
        optimizer("adagrad",
                  {{table.remote_parameters(), optim::OptionBag().set("lr", 0.1)},
                   {linear->remote_parameters(), optim::OptionBag().set("lr", 0.05)}},
                  optim::OptionBag().set("lr_decay", 0.05)) {}

  // One step; returns the output.
  at::Tensor step(int step) {
    const Batch b = batch(step);
    dist_autograd::ContextGuard context;
    const at::Tensor out = linear->forward(table.forward(b.ids, b.offsets));
    dist_autograd::backward(context.id(), {at::mse_loss(out, b.target.narrow(1, 0, 2))});
    optimizer.step(context.id());
    return out.detach();
  }

  // Every parameter's value: the table's rows, then the layer's.
  std::vector<at::Tensor> values() const {
    std::vector<at::Tensor> out{table.weight()};
    for (const auto& param : linear->remote_parameters()) out.push_back(param.to_here());
    return out;
  }

  ShardedEmbeddingBag table;
  std::shared_ptr<rpc::RemoteModule<SnapshotLinear>> linear;
  DistributedOptimizer optimizer;
};

}  // namespace

TEST(Snapshot, ATableAndAModuleResumeOnOtherOwnersBitForBit) {
  testing::with_workers(4, [] {
    using testing::worker;
    TempDir dir;
    const std::string snapshot = dir / "snapshot";
    Model model({worker(1), worker(2)}, worker(1), /*seed=*/5);
    for (int step = 0; step < 3; ++step) model.step(step);
    dist_optim::save_snapshot(snapshot, model.optimizer, {&model.table}, /*rows_per_file=*/16);
    std::vector<at::Tensor> expected;
    for (int step = 3; step < 6; ++step) expected.push_back(model.step(step));
    const std::vector<at::Tensor> expected_values = model.values();

    // Three shards on other owners, the layer on another worker, other initial values.
    Model resumed({worker(3), worker(1), worker(2)}, worker(3), /*seed=*/9);
    dist_optim::load_snapshot(snapshot, resumed.optimizer, {&resumed.table});
    for (int step = 3; step < 6; ++step) {
      EXPECT_TRUE(at::equal(resumed.step(step), expected[step - 3])) << "step " << step;
    }
    testing::expect_all_equal(resumed.values(), expected_values);
  });
}

TEST(Snapshot, AScheduleKeepsTheLastSnapshotsAndTheLatestLoadsAsTaken) {
  testing::with_workers(3, [] {
    using testing::worker;
    TempDir dir;
    const std::string snapshots = dir / "schedule";
    Model model({worker(1), worker(2)}, worker(2), /*seed=*/5);
    // The values after each step, to compare whichever snapshot the schedule took.
    std::map<int64_t, std::vector<at::Tensor>> values{{0, model.values()}};
    std::vector<int64_t> finished;
    {
      // Written a third of the time at most (each write followed by a rest twice its length):
      // the same files.
      dist_optim::SnapshotSchedule schedule(
          dist_optim::SnapshotOptions(snapshots).every_steps(2).keep_last(2).disk_share(1.0 / 3),
          model.optimizer, {&model.table});
      for (int step = 0; step < 9; ++step) {
        model.step(step);
        values[step + 1] = model.values();
        if (auto done = schedule.step()) finished.push_back(*done);
        // One snapshot finished mid-run whatever the owners' pace: on a loaded machine none may
        // have finished by itself yet, and the test needs three to see the oldest removed.
        if (step == 4) {
          if (auto done = schedule.flush()) finished.push_back(*done);
        }
      }
      if (auto done = schedule.flush()) finished.push_back(*done);
      EXPECT_EQ(schedule.steps(), 9);
      // Taken now, whatever the count: the newest.
      finished.push_back(schedule.save_now());
      EXPECT_EQ(finished.back(), 9);
    }
    ASSERT_GE(finished.size(), 3u);
    EXPECT_TRUE(std::is_sorted(finished.begin(), finished.end()));
    // The newest two are kept, the others removed.
    std::vector<std::string> kept;
    for (const auto& entry : fs::directory_iterator(snapshots)) {
      if (entry.is_directory()) kept.push_back(entry.path().filename().string());
    }
    std::sort(kept.begin(), kept.end());
    ASSERT_EQ(kept.size(), 2u);
    EXPECT_EQ(kept[1], "step-000000000009");
    const auto latest = dist_optim::latest_snapshot(snapshots);
    ASSERT_TRUE(latest.has_value());
    EXPECT_EQ(latest->step, 9);

    // Every kept snapshot loads as the model was after its step.
    for (const std::string& name : kept) {
      SCOPED_TRACE(name);
      const int64_t step = std::stoll(name.substr(std::string("step-").size()));
      Model resumed({worker(2)}, worker(1), /*seed=*/9);
      dist_optim::load_snapshot(snapshots + "/" + name, resumed.optimizer, {&resumed.table});
      testing::expect_all_equal(resumed.values(), values.at(step));
    }
    Model resumed({worker(2), worker(1)}, worker(1), /*seed=*/9);
    EXPECT_EQ(dist_optim::load_latest_snapshot(snapshots, resumed.optimizer, {&resumed.table}),
              std::optional<int64_t>(9));
    testing::expect_all_equal(resumed.values(), values.at(9));
    EXPECT_EQ(dist_optim::load_latest_snapshot(dir / "none", resumed.optimizer, {&resumed.table}),
              std::nullopt);
  });
}

// A scheduled snapshot is a cut of its trainer's steps however slow an owner is to copy: here the
// first snapshot's copies need fresh memory for SparseAdam's state (none existed when the schedule
// reserved its copies), which an owner maps before it copies, while the trainer's next step is
// sent at once. And steps still outstanding (max_staleness) are in the snapshot begun after them.
TEST(Snapshot, AStepTakenRightAfterASnapshotBeganIsNotInItNorOneBeforeItLeftOut) {
  testing::with_workers(3, [] {
    using testing::worker;
    TempDir dir;
    // 64 MB of rows over two owners: each maps 64 MB for the state's two buffers of its shard.
    constexpr int64_t kRowsHeld = int64_t{1} << 20, kWidth = 16;
    const auto table_options = [](int64_t seed) {
      return ShardedEmbeddingBagOptions(kRowsHeld, kWidth, {worker(1), worker(2)})
          .mode(torch::kSum)
          .seed(seed);
    };
    struct Trained {
      explicit Trained(ShardedEmbeddingBagOptions options)
          : table(std::move(options)),
            optimizer("sparse_adam", table.remote_parameters(),
                      optim::OptionBag().set("lr", 0.01)) {}
      // Step `step`'s bags, spread over both shards.
      void step(int step) {
        const Batch b = batch(step);
        auto generator = at::detail::createCPUGenerator(200 + step);
        dist_autograd::ContextGuard context;
        const at::Tensor out = table.forward(b.ids * (kRowsHeld / kRows), b.offsets);
        dist_autograd::backward(context.id(),
                                {at::mse_loss(out, at::randn({kBags, kWidth}, generator))});
        optimizer.step(context.id());
      }
      ShardedEmbeddingBag table;
      DistributedOptimizer optimizer;
    };
    // The snapshot in `path` loaded into a table of other rows holds `expected`, and its state
    // too: step `then` from it gives `expected_then`.
    const auto expect_loads_as = [&](const std::string& path, const at::Tensor& expected, int then,
                                     const at::Tensor& expected_then) {
      Trained resumed(table_options(/*seed=*/9));
      dist_optim::load_snapshot(path, resumed.optimizer, {&resumed.table});
      EXPECT_TRUE(at::equal(resumed.table.weight(), expected));
      resumed.step(then);
      EXPECT_TRUE(at::equal(resumed.table.weight(), expected_then));
    };

    Trained trained(table_options(/*seed=*/5));
    dist_optim::SnapshotSchedule schedule(dist_optim::SnapshotOptions(dir / "cut").every_steps(1),
                                          trained.optimizer, {&trained.table});
    trained.step(0);
    const at::Tensor after_first = trained.table.weight();
    EXPECT_EQ(schedule.step(), std::nullopt);
    ASSERT_EQ(schedule.writing(), std::optional<int64_t>(1));
    trained.step(1);
    EXPECT_EQ(schedule.flush(), std::optional<int64_t>(1));
    // The first step, without the second.
    expect_loads_as(dist_optim::latest_snapshot(dir / "cut")->path, after_first, 1,
                    trained.table.weight());

    // Steps that returned before their owners applied them are in the snapshot begun next.
    trained.optimizer.set_max_staleness(2);
    trained.step(2);
    trained.step(3);
    dist_optim::save_snapshot(dir / "stale", trained.optimizer, {&trained.table});
    trained.optimizer.flush();
    const at::Tensor after_fourth = trained.table.weight();
    trained.step(4);
    trained.optimizer.flush();
    expect_loads_as(dir / "stale", after_fourth, 4, trained.table.weight());
  });
}

TEST(Snapshot, AScheduleHasEveryOwnerMapTheMemoryOfItsCopiesWhenMade) {
  testing::with_workers(3, [] {
    using testing::worker;
    TempDir dir;
    // 32 MB of rows over two owners, and as much of Adagrad's sums: far above what an owner's
    // resident memory moves by otherwise.
    constexpr int64_t kRowsHeld = int64_t{1} << 19, kWidth = 16;
    ShardedEmbeddingBag table(
        ShardedEmbeddingBagOptions(kRowsHeld, kWidth, {worker(1), worker(2)}).mode(torch::kSum));
    auto linear = std::make_shared<rpc::RemoteModule<SnapshotLinear>>(
        worker(2), std::tuple{kWidth, int64_t{2}});
    DistributedOptimizer optimizer("adagrad",
                                   {{table.remote_parameters(), optim::OptionBag()},
                                    {linear->remote_parameters(), optim::OptionBag()}},
                                   optim::OptionBag().set("lr", 0.1));
    const auto resident = [](const std::string& owner) {
      return rpc::rpc_sync<int64_t>(owner, "snapshot_test.resident_bytes", std::tuple{});
    };
    const std::map<std::string, int64_t> before{{worker(1), resident(worker(1))},
                                                {worker(2), resident(worker(2))}};
    dist_optim::SnapshotSchedule schedule(
        dist_optim::SnapshotOptions(dir / "reserved").every_steps(100), optimizer, {&table});

    // Each owner keeps a copy of its parameters and of Adagrad's sum of each.
    std::map<std::string, int64_t> expected;
    for (size_t s = 0; s < 2; ++s) {
      const auto [first, end] = table.shard_rows(s);
      expected[worker(1 + static_cast<int>(s))] +=
          2 * (end - first) * kWidth * static_cast<int64_t>(sizeof(float));
    }
    expected[worker(2)] += 2 * (2 * kWidth + 2) * static_cast<int64_t>(sizeof(float));
    EXPECT_EQ(schedule.reserved_bytes(), expected);
    // ... and holds it from now on, not from the first snapshot.
    for (const auto& [owner, bytes] : expected) {
      EXPECT_GE(resident(owner) - before.at(owner), bytes * 9 / 10) << owner;
    }

    // The first snapshot copies into that memory and loads as the table was.
    const at::Tensor rows = table.weight();
    EXPECT_EQ(schedule.save_now(), 0);
    ShardedEmbeddingBag loaded(
        ShardedEmbeddingBagOptions(kRowsHeld, kWidth, {worker(2)}).mode(torch::kSum).seed(9));
    auto loaded_linear = std::make_shared<rpc::RemoteModule<SnapshotLinear>>(
        worker(1), std::tuple{kWidth, int64_t{2}});
    DistributedOptimizer loaded_optimizer(
        "adagrad",
        {{loaded.remote_parameters(), optim::OptionBag()},
         {loaded_linear->remote_parameters(), optim::OptionBag()}},
        optim::OptionBag().set("lr", 0.1));
    EXPECT_EQ(dist_optim::load_latest_snapshot(dir / "reserved", loaded_optimizer, {&loaded}),
              std::optional<int64_t>(0));
    EXPECT_TRUE(at::equal(loaded.weight(), rows));
  });
}

TEST(Snapshot, BadSnapshotsAreRefusedNamingTheFileAndTheOwnerAndChangeNothing) {
  testing::with_workers(3, [] {
    using testing::worker;
    TempDir dir;
    const std::string snapshot = dir / "good";
    Model model({worker(1), worker(2)}, worker(2), /*seed=*/5);
    model.step(0);
    dist_optim::save_snapshot(snapshot, model.optimizer, {&model.table});

    // Tables that are not the optimizer's, or given twice: refused before anything is written.
    ShardedEmbeddingBag stranger(options({worker(1)}));
    testing::expect_error_containing(
        [&] { dist_optim::save_snapshot(dir / "x", model.optimizer, {&stranger}); },
        {"save_snapshot: shard 0 of tables[0] (on worker '" + worker(1) +
         "') is not a parameter of the optimizer"});
    testing::expect_error_containing(
        [&] {
          dist_optim::save_snapshot(dir / "x", model.optimizer, {&model.table, &model.table});
        },
        {"save_snapshot: tables[1] shares its shard 0 with an earlier table"});
    EXPECT_FALSE(fs::exists(dir / "x"));
    testing::expect_error_containing(
        [&] {
          dist_optim::SnapshotSchedule(dist_optim::SnapshotOptions(dir / "x").keep_last(0),
                                       model.optimizer, {&model.table});
        },
        {"SnapshotSchedule: keep_last is 0; it must be at least 1"});
    for (const double share : {0.0, 1.5, std::nan("")}) {
      testing::expect_error_containing(
          [&] {
            dist_optim::SnapshotSchedule(dist_optim::SnapshotOptions(dir / "x").disk_share(share),
                                         model.optimizer, {&model.table});
          },
          {c10::str("SnapshotSchedule: disk_share is ", share,
                    "; it must be more than 0 and at most 1")});
    }

    // An owner that cannot write its file (a directory stands where its block goes): named with
    // the file, and no manifest is written.
    const std::string blocked = dir / "blocked";
    const std::string block = blocked + "/table-0.shard-1-of-2.block-0.pt";
    fs::create_directories(block);
    try {
      dist_optim::save_snapshot(blocked, model.optimizer, {&model.table});
      ADD_FAILURE() << "a snapshot whose block could not be written was saved";
    } catch (const rpc::RemoteError& error) {
      EXPECT_EQ(error.worker_name(), worker(2));
      EXPECT_NE(std::string(error.what()).find(block), std::string::npos) << error.what();
    }
    EXPECT_FALSE(fs::exists(blocked + "/manifest.pt"));
    // The same for a shard's third block: the block that failed is named.
    const std::string blocked_later = dir / "blocked_later";
    const std::string later_block = blocked_later + "/table-0.shard-1-of-2.block-2.pt";
    fs::create_directories(later_block);
    try {
      dist_optim::save_snapshot(blocked_later, model.optimizer, {&model.table},
                                /*rows_per_file=*/16);
      ADD_FAILURE() << "a snapshot whose third block could not be written was saved";
    } catch (const rpc::RemoteError& error) {
      EXPECT_EQ(error.worker_name(), worker(2));
      EXPECT_NE(std::string(error.what()).find(later_block), std::string::npos) << error.what();
    }
    EXPECT_FALSE(fs::exists(blocked_later + "/manifest.pt"));

    Model other({worker(1)}, worker(1), /*seed=*/9);
    const std::vector<at::Tensor> before = other.values();
    // Without the table, its shards count among the other parameters.
    testing::expect_error_containing(
        [&] { dist_optim::load_snapshot(snapshot, other.optimizer); },
        {"load_snapshot: '" + snapshot + "/manifest.pt': 'tables' has 1 entries, not 0"});

    // The layer's file missing, or holding a layer of another shape: named by the owner that
    // read it (worker 1, the layer's owner now).
    std::string params;
    for (const auto& entry : fs::directory_iterator(snapshot)) {
      if (entry.path().filename().string().rfind("params-", 0) == 0) params = entry.path().string();
    }
    ASSERT_FALSE(params.empty());
    const std::string bad = dir / "bad";
    fs::copy(snapshot, bad);
    const std::string bad_params = bad + "/" + fs::path(params).filename().string();
    fs::remove(bad_params);
    try {
      dist_optim::load_snapshot(bad, other.optimizer, {&other.table});
      ADD_FAILURE() << "a snapshot without its parameters' file loaded";
    } catch (const rpc::RemoteError& error) {
      EXPECT_EQ(error.worker_name(), worker(1));
      EXPECT_NE(std::string(error.what()).find(bad_params), std::string::npos) << error.what();
    }
    testing::expect_all_equal(other.values(), before);

    const std::string wide = dir / "wide";
    {
      ShardedEmbeddingBag table(options({worker(2)}));
      auto linear = std::make_shared<rpc::RemoteModule<SnapshotLinear>>(
          worker(2), std::tuple{kDim, int64_t{3}});
      DistributedOptimizer optimizer("adagrad",
                                     {{table.remote_parameters()}, {linear->remote_parameters()}},
                                     optim::OptionBag().set("lr", 0.1).set("lr_decay", 0.05));
      dist_optim::save_snapshot(wide, optimizer, {&table});
    }
    testing::expect_error_containing(
        [&] { dist_optim::load_snapshot(wide, other.optimizer, {&other.table}); },
        {"parameter 0's value has shape [3, 6] and dtype Float; the parameter has [2, 6] and "
         "Float"});
    testing::expect_all_equal(other.values(), before);
  });
}

}  // namespace snapshot_test
}  // namespace distoptim
