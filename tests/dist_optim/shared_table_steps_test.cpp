// Several trainers stepping one ShardedEmbeddingBag through their own DistributedOptimizers, the
// parameter servers real processes on loopback: no update is lost, no lookup or to_here carries a
// half-updated row, and a step of some rows does not wait for a step of others (a step held inside
// its row locks on the parameter server lets another trainer's step of other rows, and lookups of
// them, finish; a step, a lookup or a to_here of a held row waits for it); and replicated, every
// step that returned is on the shard's backup too. A dense step of a layer on the same server
// holds that layer only.
//
// Rows start at 0 and every step is SGD with lr 1 on the sum of one-id bags, so a step subtracts 1
// from every element of a row per time the row is named: rows hold exact integers whatever the
// order of the steps, and a row whose elements differ was read half-updated.

#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/optim/registry.h>
#include <distoptim/optim/sgd.h>
#include <distoptim/rpc.h>

#include "harness/rpc_workers.h"
#include "support/test_util.h"

namespace distoptim {
namespace shared_table_steps_test {

using rpc::EmbeddingShard;
using rpc::RRef;
using rpc::ShardedEmbeddingBag;
using rpc::ShardedEmbeddingBagOptions;

// The table of the held-step test: one stripe per row.
constexpr int64_t kRows = 64, kDim = 128;
// The table the trainers fight over: few wide rows, so that steps and lookups of the same rows
// overlap often and a row takes long to write (without the row locks the test fails: updates are
// lost and lookups return torn rows).
constexpr int64_t kHotRows = 16, kWideDim = 8192;
constexpr auto kBound = std::chrono::seconds(30);
// How long a call that must wait is watched still waiting (the test asserts only that it did
// not finish: a call that need not wait is never asserted to be quick).
constexpr auto kStillWaiting = std::chrono::milliseconds(500);

ShardedEmbeddingBagOptions table_options(std::vector<std::string> workers, int64_t rows = kRows,
                                         int64_t dim = kDim) {
  return ShardedEmbeddingBagOptions(rows, dim, std::move(workers)).mode(torch::kSum);
}

// On a shard's owner: its rows set to 0.
void zero_shard(RRef<EmbeddingShard> shard) {
  at::NoGradGuard no_grad;
  rpc::InPlaceUpdateGuard writing;
  shard.local_value()->weight.zero_();
}
DISTOPTIM_RPC_FUNCTION("shared_table_steps_test.zero_shard", zero_shard);

// One step of `optimizer` (an SGD, lr 1) over `table`: each id of `ids` a bag of its own, the sum
// of the pooled rows the loss.
void step_rows(ShardedEmbeddingBag& table, dist_optim::DistributedOptimizer& optimizer,
               const at::Tensor& ids) {
  dist_autograd::ContextGuard context;
  dist_autograd::backward(context.id(), {table.forward(ids.reshape({-1, 1})).sum()});
  optimizer.step(context.id());
}

// On a trainer: a handle on the table from its shards, an SGD of its own, and one step per row
// of `ids` ([steps, ids per step]).
void train(std::vector<std::string> workers, std::vector<RRef<EmbeddingShard>> shards, int64_t rows,
           int64_t dim, std::string optimizer, at::Tensor ids) {
  ShardedEmbeddingBag table(table_options(std::move(workers), rows, dim), std::move(shards));
  dist_optim::DistributedOptimizer sgd(optimizer, table.remote_parameters(),
                                       optim::OptionBag().set("lr", 1.0));
  for (int64_t step = 0; step < ids.size(0); ++step) step_rows(table, sgd, ids[step]);
}
DISTOPTIM_RPC_FUNCTION("shared_table_steps_test.train", train);

// An SGD that, on the parameter server, stops inside its sparse update (so inside the row locks
// of the step) until the test releases it: the first step of every instance waits.
struct Latch {
  std::mutex mutex;
  std::condition_variable changed;
  bool holding = false;   // guarded by mutex
  bool released = false;  // guarded by mutex
};
Latch& latch() {
  static Latch instance;
  return instance;
}

// Marks the latch held and waits (at most kBound) for the test to release it.
void hold_until_released(const char* who) {
  Latch& l = latch();
  std::unique_lock<std::mutex> lock(l.mutex);
  l.holding = true;
  l.changed.notify_all();
  TORCH_CHECK(l.changed.wait_for(lock, kBound, [&] { return l.released; }), who,
              ": not released within ", kBound.count(), " s");
}

class LatchedSGD : public optim::SGD {
 public:
  using optim::SGD::SGD;

 protected:
  void update_sparse(size_t group, const std::vector<ParamUpdate>& updates) override {
    hold_until_released("LatchedSGD");
    optim::SGD::update_sparse(group, updates);
  }
};
const optim::OptimizerRegistration kLatchedSgd(
    "latched_sgd", optim::typed_factory<LatchedSGD, optim::SGDOptions>());

// The same for a dense step: held inside its update (so inside the locks of the parameters it
// writes).
class LatchedDenseSGD : public optim::SGD {
 public:
  using optim::SGD::SGD;

 protected:
  void update(size_t group, const std::vector<ParamUpdate>& updates) override {
    hold_until_released("LatchedDenseSGD");
    optim::SGD::update(group, updates);
  }
};
const optim::OptimizerRegistration kLatchedDenseSgd(
    "latched_dense_sgd", optim::typed_factory<LatchedDenseSGD, optim::SGDOptions>());

// A dense layer's weight on the parameter server, beside the table: zeros, [kRows, kDim].
at::Tensor& dense_weight() {
  static at::Tensor weight = at::zeros({kRows, kDim}).requires_grad_();
  return weight;
}
DISTOPTIM_RPC_FUNCTION("shared_table_steps_test.dense_weight_rref",
                       [] { return RRef<at::Tensor>(dense_weight()); });
DISTOPTIM_RPC_FUNCTION("shared_table_steps_test.dense_sum", [] { return dense_weight().sum(); });

// A wide dense layer beside the hot table, for the lost-update test: zeros, [kHotRows, kWideDim].
at::Tensor& wide_weight() {
  static at::Tensor weight = at::zeros({kHotRows, kWideDim}).requires_grad_();
  return weight;
}
DISTOPTIM_RPC_FUNCTION("shared_table_steps_test.wide_weight_rref",
                       [] { return RRef<at::Tensor>(wide_weight()); });
DISTOPTIM_RPC_FUNCTION("shared_table_steps_test.wide_sum", [] { return wide_weight().sum(); });

// On a trainer: one SGD (lr 1) over the table and the wide layer, and one step per row of `ids`,
// each of those table rows and of the whole layer (every element of it -1 a step).
void train_with_layer(std::vector<std::string> workers, std::vector<RRef<EmbeddingShard>> shards,
                      RRef<at::Tensor> weight, at::Tensor ids) {
  ShardedEmbeddingBag table(table_options(std::move(workers), kHotRows, kWideDim),
                            std::move(shards));
  std::vector<RRef<at::Tensor>> params = table.remote_parameters();
  params.push_back(weight);
  dist_optim::DistributedOptimizer sgd("sgd", params, optim::OptionBag().set("lr", 1.0));
  for (int64_t step = 0; step < ids.size(0); ++step) {
    dist_autograd::ContextGuard context;
    const at::Tensor layer =
        rpc::rpc_sync<at::Tensor>(weight.owner_name(), "shared_table_steps_test.wide_sum");
    dist_autograd::backward(context.id(),
                            {table.forward(ids[step].reshape({-1, 1})).sum() + layer});
    sgd.step(context.id());
  }
}
DISTOPTIM_RPC_FUNCTION("shared_table_steps_test.train_with_layer", train_with_layer);

bool wait_until_held() {
  Latch& l = latch();
  std::unique_lock<std::mutex> lock(l.mutex);
  return l.changed.wait_for(lock, kBound, [&] { return l.holding; });
}
DISTOPTIM_RPC_FUNCTION("shared_table_steps_test.wait_until_held", wait_until_held);

void release() {
  Latch& l = latch();
  std::lock_guard<std::mutex> lock(l.mutex);
  l.released = true;
  l.changed.notify_all();
}
DISTOPTIM_RPC_FUNCTION("shared_table_steps_test.release", release);

at::Tensor fetch_table(const ShardedEmbeddingBag& table) {
  std::vector<at::Tensor> parts;
  for (const auto& rref : table.remote_parameters()) parts.push_back(rref.to_here());
  return at::cat(parts);
}

// The rows of `rows` ([n, dim]) whose elements are not all equal.
int64_t torn_rows(const at::Tensor& rows) {
  return (rows != rows.select(1, 0).unsqueeze(1)).any(1).sum().item<int64_t>();
}

// The table a run of steps leaves: every row minus the times it was named.
at::Tensor expected_table(const at::Tensor& named_ids, int64_t rows = kRows, int64_t dim = kDim) {
  return -at::bincount(named_ids.reshape({-1}), {}, rows)
              .to(at::kFloat)
              .unsqueeze(1)
              .expand({rows, dim});
}

TEST(SharedTableSteps, ThreeTrainersLoseNoUpdateAndLookupsSeeWholeRows) {
  // worker0 looks rows up, worker1 holds both shards, workers 2-4 train.
  testing::with_workers(5, [] {
    using testing::worker;
    const std::vector<std::string> workers = {worker(1), worker(1)};
    ShardedEmbeddingBag table(table_options(workers, kHotRows, kWideDim));
    const auto shards = table.shard_module_rrefs();
    for (const auto& shard : shards) {
      rpc::rpc_sync(worker(1), "shared_table_steps_test.zero_shard", std::tuple{shard});
    }
    // Steps of 12 ids over 16 rows: every step shares rows with the other trainers'.
    constexpr int64_t kSteps = 60, kIdsPerStep = 12;
    auto generator = at::detail::createCPUGenerator(11);
    std::vector<at::Tensor> ids;
    std::vector<rpc::RpcFuture<void>> trainers;
    for (int t = 2; t <= 4; ++t) {
      ids.push_back(at::randint(kHotRows, {kSteps, kIdsPerStep}, generator, at::kLong));
      trainers.push_back(rpc::rpc_async<void>(
          worker(t), "shared_table_steps_test.train",
          std::tuple{workers, shards, kHotRows, kWideDim, std::string("sgd"), ids.back()}));
    }
    const at::Tensor all_ids = at::arange(kHotRows, at::kLong);
    int64_t lookups = 0, torn = 0;
    auto trainers_done = [&] {
      for (const auto& trainer : trainers) {
        if (!trainer.completed()) return false;
      }
      return true;
    };
    do {
      // A lookup of every row, and every row fetched whole (to_here of the shards' weights).
      torn += torn_rows(table.forward(all_ids.reshape({-1, 1})));
      torn += torn_rows(fetch_table(table));
      ++lookups;
    } while (!trainers_done());
    for (auto& trainer : trainers) trainer.wait();
    EXPECT_EQ(torn, 0) << "rows read half-updated in " << lookups << " rounds of lookups";
    const at::Tensor trained = fetch_table(table);
    const at::Tensor expected = expected_table(at::cat(ids), kHotRows, kWideDim);
    EXPECT_TRUE(at::equal(trained, expected))
        << "updates lost: " << (trained - expected).abs().sum().item<float>() << " in all";
  });
}

// Dense and sparse parameters on one owner: three trainers step the table's rows and a wide
// dense layer beside it at once (each step writes the whole layer under that layer's locks only,
// and its rows under theirs), while the layer is fetched whole and the rows looked up: no update
// of either is lost and no read is torn.
TEST(SharedTableSteps, DenseAndSparseStepsOfOneOwnerLoseNothingAndReadWhole) {
  testing::with_workers(5, [] {
    using testing::worker;
    const std::vector<std::string> workers = {worker(1)};
    ShardedEmbeddingBag table(table_options(workers, kHotRows, kWideDim));
    const auto shards = table.shard_module_rrefs();
    rpc::rpc_sync(worker(1), "shared_table_steps_test.zero_shard", std::tuple{shards[0]});
    const auto weight =
        rpc::rpc_sync<RRef<at::Tensor>>(worker(1), "shared_table_steps_test.wide_weight_rref");
    constexpr int64_t kSteps = 40, kIdsPerStep = 6;
    auto generator = at::detail::createCPUGenerator(23);
    std::vector<at::Tensor> ids;
    std::vector<rpc::RpcFuture<void>> trainers;
    for (int t = 2; t <= 4; ++t) {
      ids.push_back(at::randint(kHotRows, {kSteps, kIdsPerStep}, generator, at::kLong));
      trainers.push_back(rpc::rpc_async<void>(worker(t), "shared_table_steps_test.train_with_layer",
                                              std::tuple{workers, shards, weight, ids.back()}));
    }
    const at::Tensor all_ids = at::arange(kHotRows, at::kLong);
    int64_t reads = 0, torn = 0;
    auto trainers_done = [&] {
      for (const auto& trainer : trainers) {
        if (!trainer.completed()) return false;
      }
      return true;
    };
    do {
      const at::Tensor layer = weight.to_here();
      torn += (layer.min() != layer.max()).item<bool>() ? 1 : 0;
      torn += torn_rows(table.forward(all_ids.reshape({-1, 1})));
      ++reads;
    } while (!trainers_done());
    for (auto& trainer : trainers) trainer.wait();
    EXPECT_EQ(torn, 0) << "reads torn in " << reads << " rounds";
    EXPECT_TRUE(at::equal(weight.to_here(), at::full({kHotRows, kWideDim}, -3.f * kSteps)));
    EXPECT_TRUE(at::equal(fetch_table(table), expected_table(at::cat(ids), kHotRows, kWideDim)));
  });
}

TEST(SharedTableSteps, AStepOfOtherRowsDoesNotWaitForAHeldStep) {
  // worker0 trains (two trainers on threads of its own) and checks, worker1 holds the one shard,
  // worker2 is a third trainer.
  testing::with_workers(3, [] {
    using testing::worker;
    const std::vector<std::string> workers = {worker(1)};
    ShardedEmbeddingBag table(table_options(workers));
    const auto shards = table.shard_module_rrefs();
    rpc::rpc_sync(worker(1), "shared_table_steps_test.zero_shard", std::tuple{shards[0]});
    auto ids = [](std::vector<int64_t> values) { return at::tensor(values, at::kLong); };
    auto look_up = [&](const at::Tensor& rows) {
      return std::async(std::launch::async, [&table, rows] {
        return table.forward(rows.reshape({-1, 1})).detach();
      });
    };

    // Trainer C looks up and back-propagates rows 1 and 20 now (row 1 is about to be held), and
    // steps when told to.
    std::promise<void> c_may_step;
    std::promise<void> c_has_gradients;
    auto trainer_c = std::async(std::launch::async, [&] {
      ShardedEmbeddingBag handle(table_options(workers), shards);
      dist_optim::DistributedOptimizer sgd("sgd", handle.remote_parameters(),
                                           optim::OptionBag().set("lr", 1.0));
      dist_autograd::ContextGuard context;
      dist_autograd::backward(context.id(), {handle.forward(ids({1, 20}).reshape({-1, 1})).sum()});
      c_has_gradients.set_value();
      c_may_step.get_future().wait();
      sgd.step(context.id());
    });
    c_has_gradients.get_future().wait();

    // Trainer A steps rows 0 and 1 with the latched SGD: held inside its row locks.
    auto trainer_a = std::async(std::launch::async, [&] {
      ShardedEmbeddingBag handle(table_options(workers), shards);
      dist_optim::DistributedOptimizer sgd("latched_sgd", handle.remote_parameters(),
                                           optim::OptionBag().set("lr", 1.0));
      step_rows(handle, sgd, ids({0, 1}));
    });
    ASSERT_TRUE(rpc::rpc_sync<bool>(worker(1), "shared_table_steps_test.wait_until_held"));

    // Meanwhile trainer B (another process) steps rows 10 and 11, and they are looked up.
    rpc::rpc_sync(worker(2), "shared_table_steps_test.train",
                  std::tuple{workers, shards, kRows, kDim, std::string("sgd"),
                             ids({10, 11}).reshape({1, -1})},
                  kBound);
    auto other_rows = look_up(ids({10, 11, 20}));
    ASSERT_EQ(other_rows.wait_for(kBound), std::future_status::ready);
    EXPECT_TRUE(
        at::equal(other_rows.get(), at::tensor({-1.f, -1.f, 0.f}).unsqueeze(1).expand({3, kDim})));

    // Trainer C's step of row 1, a lookup of row 0 and the whole weight wait for trainer A.
    c_may_step.set_value();
    auto held_row = look_up(ids({0}));
    auto whole = std::async(std::launch::async, [&] { return fetch_table(table); });
    EXPECT_EQ(trainer_c.wait_for(kStillWaiting), std::future_status::timeout);
    EXPECT_EQ(held_row.wait_for(std::chrono::milliseconds(1)), std::future_status::timeout);
    EXPECT_EQ(whole.wait_for(std::chrono::milliseconds(1)), std::future_status::timeout);
    EXPECT_FALSE(trainer_a.wait_for(std::chrono::milliseconds(1)) == std::future_status::ready);

    rpc::rpc_sync(worker(1), "shared_table_steps_test.release");
    for (auto* f : {&trainer_a, &trainer_c}) {
      ASSERT_EQ(f->wait_for(kBound), std::future_status::ready);
      f->get();
    }
    ASSERT_EQ(held_row.wait_for(kBound), std::future_status::ready);
    ASSERT_EQ(whole.wait_for(kBound), std::future_status::ready);
    // The lookup and the copy came after A's step, and the copy maybe after C's.
    EXPECT_TRUE(at::equal(held_row.get(), at::full({1, kDim}, -1.f)));
    const at::Tensor copied = whole.get();
    EXPECT_EQ(torn_rows(copied), 0);
    EXPECT_EQ(copied[0][0].item<float>(), -1.f);
    // Every step applied once: A (0, 1), B (10, 11), C (1, 20).
    EXPECT_TRUE(at::equal(fetch_table(table), expected_table(ids({0, 1, 10, 11, 1, 20}))));
  });
}

// A dense step on the server (one trainer's SGD of a layer beside the table, held inside its
// update) holds that layer only: another trainer's step of table rows, and lookups of them, finish
// meanwhile; a fetch of the layer waits for it. Afterwards both steps are applied exactly once.
TEST(SharedTableSteps, ADenseStepOfALayerDoesNotHoldTheTable) {
  testing::with_workers(3, [] {
    using testing::worker;
    const std::vector<std::string> workers = {worker(1)};
    ShardedEmbeddingBag table(table_options(workers));
    const auto shards = table.shard_module_rrefs();
    rpc::rpc_sync(worker(1), "shared_table_steps_test.zero_shard", std::tuple{shards[0]});
    const auto weight =
        rpc::rpc_sync<RRef<at::Tensor>>(worker(1), "shared_table_steps_test.dense_weight_rref");
    auto ids = [](std::vector<int64_t> values) { return at::tensor(values, at::kLong); };
    const auto step_table_on_worker2 = [&](const at::Tensor& rows) {
      rpc::rpc_sync(
          worker(2), "shared_table_steps_test.train",
          std::tuple{workers, shards, kRows, kDim, std::string("sgd"), rows.reshape({1, -1})},
          kBound);
    };
    // The table's first row step makes its row locks, which waits for every update in progress
    // (once per tensor): made here, before the held step.
    step_table_on_worker2(ids({30}));

    // Trainer A steps the layer with the latched SGD: held inside the layer's lock.
    auto trainer_a = std::async(std::launch::async, [&] {
      dist_optim::DistributedOptimizer sgd("latched_dense_sgd", {weight},
                                           optim::OptionBag().set("lr", 1.0));
      dist_autograd::ContextGuard context;
      dist_autograd::backward(context.id(), {rpc::rpc_sync<at::Tensor>(
                                                worker(1), "shared_table_steps_test.dense_sum")});
      sgd.step(context.id());
    });
    ASSERT_TRUE(rpc::rpc_sync<bool>(worker(1), "shared_table_steps_test.wait_until_held"));

    // Meanwhile trainer B (another process) steps rows 10 and 11 of the table, and they are
    // looked up.
    step_table_on_worker2(ids({10, 11}));
    auto rows = std::async(std::launch::async, [&] {
      return table.forward(ids({10, 11, 20}).reshape({-1, 1})).detach();
    });
    ASSERT_EQ(rows.wait_for(kBound), std::future_status::ready);
    EXPECT_TRUE(
        at::equal(rows.get(), at::tensor({-1.f, -1.f, 0.f}).unsqueeze(1).expand({3, kDim})));

    // A fetch of the layer waits for trainer A.
    auto fetched = std::async(std::launch::async, [&] { return weight.to_here(); });
    EXPECT_EQ(fetched.wait_for(kStillWaiting), std::future_status::timeout);
    EXPECT_FALSE(trainer_a.wait_for(std::chrono::milliseconds(1)) == std::future_status::ready);

    rpc::rpc_sync(worker(1), "shared_table_steps_test.release");
    ASSERT_EQ(trainer_a.wait_for(kBound), std::future_status::ready);
    trainer_a.get();
    ASSERT_EQ(fetched.wait_for(kBound), std::future_status::ready);
    EXPECT_TRUE(at::equal(fetched.get(), at::full({kRows, kDim}, -1.f)));
    EXPECT_TRUE(at::equal(fetch_table(table), expected_table(ids({30, 10, 11}))));
  });
}

// On a trainer of the replicated table: a handle from the shards and their keys, an optimizer of
// its own whose steps worker1 and worker2 copy to each other, a step per row of `ids`; then its
// own state's copies are checked against its optimizer's (they change with no one else's steps).
// Returns what differs ("" when nothing does).
std::string train_replicated(std::vector<std::string> workers,
                             std::vector<RRef<EmbeddingShard>> shards,
                             std::vector<std::string> keys, std::string optimizer,
                             c10::IValue options, at::Tensor ids) {
  ShardedEmbeddingBag table(table_options(workers), std::move(shards), keys);
  dist_optim::DistributedOptimizer trainer(optimizer, table.remote_parameters(),
                                           optim::OptionBag::from_ivalue(options));
  dist_optim::replicate_steps(
      trainer, {&table}, {},
      dist_optim::ReplicaOptions().backups({{workers[0], workers[1]}, {workers[1], workers[0]}}));
  for (int64_t step = 0; step < ids.size(0); ++step) step_rows(table, trainer, ids[step]);

  std::string differs;
  const std::string me = rpc::get_worker_info().name;
  for (const auto& owner : trainer.state_dict().owners) {
    const size_t shard = owner.positions.at(0);
    const std::string& backup = workers[1 - shard];
    for (const auto& [index, state] : owner.state.state) {
      const std::string prefix = keys[shard] + "/state/" + me + "/";
      const at::Tensor step = dist_optim::replica_copy(backup, owner.worker, prefix + "step");
      if (!step.defined() || step.item<int64_t>() != state.step) {
        differs += " the step count of shard " + std::to_string(shard) + ";";
      }
      for (const auto& [name, buffer] : state.buffers) {
        const at::Tensor copy = dist_optim::replica_copy(backup, owner.worker, prefix + name);
        if (!copy.defined() || !at::equal(copy, buffer)) {
          differs += " state '" + name + "' of shard " + std::to_string(shard) + ";";
        }
      }
    }
  }
  return differs;
}
DISTOPTIM_RPC_FUNCTION("shared_table_steps_test.train_replicated", train_replicated);

// Two trainers step one table, sharded over worker1 and worker2, each the other's backup: one
// trainer with Adagrad (sparse steps: their rows are sent, under the rows' locks), the other with
// SGD with momentum (dense steps: the whole shard and state), at once, often on the same rows.
// Once both have returned, each backup's copy of a shard is the shard bit for bit, and each
// trainer's copies of its state its optimizer's state.
TEST(SharedTableSteps, EachShardsBackupHoldsWhatEveryReturnedStepChanged) {
  testing::with_workers(5, [] {
    using testing::worker;
    const std::vector<std::string> workers = {worker(1), worker(2)};
    ShardedEmbeddingBag table(table_options(workers));
    const auto shards = table.shard_module_rrefs();
    {
      // Refused by name, before anything is sent.
      dist_optim::DistributedOptimizer sgd("sgd", table.remote_parameters(),
                                           optim::OptionBag().set("lr", 1.0));
      using Backups = dist_optim::ReplicaOptions::Backups;
      auto replicate = [&](Backups backups, std::vector<rpc::ShardedEmbeddingBag*> tables) {
        dist_optim::replicate_steps(sgd, tables, {},
                                    dist_optim::ReplicaOptions().backups(std::move(backups)));
      };
      testing::expect_error_containing(
          [&] {
            replicate({{worker(3), worker(1)}}, {&table});
          },
          {"replicate_steps: worker 'worker3' owns none of the optimizer's parameters"});
      testing::expect_error_containing(
          [&] {
            replicate({{worker(1), worker(1)}}, {&table});
          },
          {"worker 'worker1' cannot be its own backup"});
      testing::expect_error_containing(
          [&] {
            replicate({{worker(1), worker(2)}}, {});
          },
          {"parameter 0 of the optimizer (on worker 'worker1', replicated) is no given table's "
           "shard, and the modules given on that worker have 0 parameters in all"});
    }
    constexpr int64_t kSteps = 40, kIdsPerStep = 12;
    auto generator = at::detail::createCPUGenerator(5);
    const std::vector<std::pair<std::string, optim::OptionBag>> optimizers = {
        {"adagrad", optim::OptionBag().set("lr", 0.5)},
        {"sgd", optim::OptionBag().set("lr", 0.1).set("momentum", 0.9)}};
    std::vector<rpc::RpcFuture<std::string>> trainers;
    for (int t = 3; t <= 4; ++t) {
      const auto& [name, options] = optimizers[t - 3];
      trainers.push_back(rpc::rpc_async<std::string>(
          worker(t), "shared_table_steps_test.train_replicated",
          std::tuple{workers, shards, table.shard_keys(), name, options.to_ivalue(),
                     at::randint(kRows, {kSteps, kIdsPerStep}, generator, at::kLong)}));
    }
    for (int t = 3; t <= 4; ++t) {
      EXPECT_EQ(trainers[t - 3].wait(), "") << "trainer " << worker(t) << "'s state copies";
    }
    const std::vector<RRef<at::Tensor>> weights = table.remote_parameters();
    for (size_t s = 0; s < 2; ++s) {
      const at::Tensor copy =
          dist_optim::replica_copy(workers[1 - s], workers[s], table.shard_key(s));
      ASSERT_TRUE(copy.defined()) << "no copy of shard " << s;
      const at::Tensor shard = weights[s].to_here();
      EXPECT_TRUE(at::equal(copy, shard))
          << "shard " << s << " differs from its copy in "
          << (copy != shard).any(1).sum().item<int64_t>() << " rows";
      // The shard, the Adagrad trainer's sum and step, the SGD trainer's momentum and step.
      EXPECT_EQ(dist_optim::replica_keys(workers[1 - s], workers[s]).size(), 5u);
    }
  });
}

// A trainer of the replicated table with Adagrad: steps on `ids`, then returns its optimizer's
// state dict; its optimizer goes with the call, as a dead trainer's does (its state's copies stay
// on the backups).
c10::IValue train_and_leave(std::vector<std::string> workers,
                            std::vector<RRef<EmbeddingShard>> shards, std::vector<std::string> keys,
                            at::Tensor ids) {
  ShardedEmbeddingBag table(table_options(workers), std::move(shards), keys);
  dist_optim::DistributedOptimizer trainer("adagrad", table.remote_parameters(),
                                           optim::OptionBag().set("lr", 0.5));
  const dist_optim::ReplicaOptions replicas =
      dist_optim::ReplicaOptions().backups({{workers[0], workers[1]}, {workers[1], workers[0]}});
  dist_optim::replicate_steps(trainer, {&table}, {}, replicas);
  for (int64_t step = 0; step < ids.size(0); ++step) step_rows(table, trainer, ids[step]);
  return trainer.state_dict().to_ivalue();
}
DISTOPTIM_RPC_FUNCTION("shared_table_steps_test.train_and_leave", train_and_leave);

// A trainer in the place of `predecessor` ("" for none): a new optimizer over the table, which
// takes over the predecessor's state from the backups; returns its state dict.
c10::IValue take_over(std::vector<std::string> workers, std::vector<RRef<EmbeddingShard>> shards,
                      std::vector<std::string> keys, std::string predecessor) {
  ShardedEmbeddingBag table(table_options(workers), std::move(shards), keys);
  dist_optim::DistributedOptimizer trainer("adagrad", table.remote_parameters(),
                                           optim::OptionBag().set("lr", 0.5));
  const dist_optim::ReplicaOptions replicas =
      dist_optim::ReplicaOptions().backups({{workers[0], workers[1]}, {workers[1], workers[0]}});
  if (predecessor.empty()) {
    dist_optim::replicate_steps(trainer, {&table}, {}, replicas);
  } else {
    dist_optim::take_over_replicated_state(trainer, {&table}, {}, replicas, predecessor);
  }
  return trainer.state_dict().to_ivalue();
}
DISTOPTIM_RPC_FUNCTION("shared_table_steps_test.take_over", take_over);

// A trainer that replaces one that died takes over its optimizer state from the backups: its
// Adagrad sums and step counts on both shards are bit for bit those the dead trainer's steps
// left; a new trainer that does not take over starts as Adagrad begins.
TEST(SharedTableSteps, AReplacementTrainerTakesItsPredecessorsStateFromTheBackups) {
  testing::with_workers(5, [] {
    using testing::worker;
    const std::vector<std::string> workers = {worker(1), worker(2)};
    ShardedEmbeddingBag table(table_options(workers));
    const auto shards = table.shard_module_rrefs();
    auto generator = at::detail::createCPUGenerator(7);
    const auto left = dist_optim::DistributedOptimizerStateDict::from_ivalue(
        rpc::rpc_sync<c10::IValue>(worker(3), "shared_table_steps_test.train_and_leave",
                                   std::tuple{workers, shards, table.shard_keys(),
                                              at::randint(kRows, {20, 12}, generator, at::kLong)}));
    const auto fresh = dist_optim::DistributedOptimizerStateDict::from_ivalue(
        rpc::rpc_sync<c10::IValue>(worker(4), "shared_table_steps_test.take_over",
                                   std::tuple{workers, shards, table.shard_keys(), std::string()}));
    // Adagrad's state as it begins: no step, zero sums.
    for (const auto& owner : fresh.owners) {
      for (const auto& [index, state] : owner.state.state) {
        EXPECT_EQ(state.step, 0) << owner.worker;
        for (const auto& [name, buffer] : state.buffers) {
          EXPECT_EQ(buffer.count_nonzero().item<int64_t>(), 0)
              << owner.worker << " '" << name << "'";
        }
      }
    }
    const auto taken = dist_optim::DistributedOptimizerStateDict::from_ivalue(
        rpc::rpc_sync<c10::IValue>(worker(4), "shared_table_steps_test.take_over",
                                   std::tuple{workers, shards, table.shard_keys(), worker(3)}));
    ASSERT_EQ(taken.owners.size(), left.owners.size());
    for (size_t k = 0; k < left.owners.size(); ++k) {
      const auto& before = left.owners[k].state.state;
      const auto& after = taken.owners[k].state.state;
      ASSERT_EQ(before.size(), 1u) << left.owners[k].worker;
      ASSERT_EQ(after.size(), before.size()) << left.owners[k].worker;
      for (const auto& [index, state] : before) {
        EXPECT_EQ(after.at(index).step, state.step) << left.owners[k].worker;
        EXPECT_EQ(after.at(index).buffers.size(), state.buffers.size());
        for (const auto& [name, buffer] : state.buffers) {
          EXPECT_TRUE(at::equal(after.at(index).buffers.at(name), buffer))
              << left.owners[k].worker << " '" << name << "'";
        }
      }
    }
    // The predecessor's copies are dropped once taken over; its successor's are there.
    for (size_t s = 0; s < 2; ++s) {
      size_t predecessors = 0, successors = 0;
      for (const std::string& key : dist_optim::replica_keys(workers[1 - s], workers[s])) {
        predecessors += key.find("/state/" + worker(3) + "/") != std::string::npos ? 1 : 0;
        successors += key.find("/state/" + worker(4) + "/") != std::string::npos ? 1 : 0;
      }
      EXPECT_EQ(predecessors, 0u) << "shard " << s;
      EXPECT_GT(successors, 0u) << "shard " << s;
    }
    testing::expect_error_containing(
        [&] {
          dist_optim::DistributedOptimizer mine("adagrad", table.remote_parameters(),
                                                optim::OptionBag().set("lr", 0.5));
          dist_optim::take_over_replicated_state(
              mine, {&table}, {}, dist_optim::ReplicaOptions().backups({{workers[0], workers[1]}}),
              worker(0));
        },
        {"take_over_replicated_state: the predecessor 'worker0' is this trainer itself"});
  });
}

}  // namespace shared_table_steps_test
}  // namespace distoptim
