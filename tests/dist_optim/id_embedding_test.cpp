// ShardedIdEmbeddingBag (rpc/id_embedding_bag.h) across real processes on loopback: raw 64-bit
// ids over three servers train exactly as over one and as LibTorch's sparse EmbeddingBag over
// one row per id (same initial rows; bit for bit), through distributed autograd and the
// DistributedOptimizer; and a row handed to a new id steps from a new parameter's Adagrad state,
// not from its predecessor's, with the server's debug info counting it; in eval mode a lookup
// only reads; and a step leaves out the rows handed to new ids after the backward pass that moved
// them.

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/embedding.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/sgd.h>

#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/rpc.h>
#include <distoptim/rpc/id_embedding_bag.h>

#include "harness/rpc_workers.h"
#include "support/test_util.h"

namespace distoptim {
namespace id_embedding_test {

using rpc::ShardedIdEmbeddingBag;
using rpc::ShardedIdEmbeddingBagOptions;

constexpr int64_t kDim = 5, kBags = 10, kSeed = 7;
constexpr double kLr = 0.1;

// A worker's rpc::get_debug_info, asked for by another.
DISTOPTIM_RPC_FUNCTION("id_table_debug_info", [] { return rpc::get_debug_info(); });

// The initial row of every id in `ids`, computed here: a function of the id and the seed alone.
at::Tensor initial_rows(const std::vector<int64_t>& ids) {
  rpc::IdEmbeddingShard local(1, kDim, static_cast<int64_t>(c10::ScalarType::Float), kSeed, 1, 0,
                              0);
  std::vector<at::Tensor> rows;
  for (int64_t id : ids) rows.push_back(local.initial_row(id));
  return at::stack(rows);
}

TEST(ShardedIdEmbeddingBag, ThreeServersTrainAsOneAndAsATableOfOneRowPerId) {
  testing::with_workers(4, [] {
    using testing::worker;
    // 40 raw ids from all over the 64-bit space, each with a row of its own in the reference.
    std::mt19937_64 raw_ids(11);
    std::vector<int64_t> pool_ids;
    for (int i = 0; i < 40; ++i) pool_ids.push_back(static_cast<int64_t>(raw_ids()));
    const at::Tensor pool = at::tensor(pool_ids, at::kLong);
    auto generator = at::detail::createCPUGenerator(11);
    ASSERT_EQ(std::set<int64_t>(pool_ids.begin(), pool_ids.end()).size(), pool_ids.size());
    auto options = [](std::vector<std::string> workers) {
      return ShardedIdEmbeddingBagOptions(64, kDim, std::move(workers))
          .mode(torch::kSum)
          .seed(kSeed);
    };
    ShardedIdEmbeddingBag three(options({worker(1), worker(2), worker(3)}));
    ShardedIdEmbeddingBag one(options({worker(1)}));
    std::vector<int> per_shard(3, 0);
    for (int64_t id : pool_ids) ++per_shard.at(three.shard_of(id));
    EXPECT_GT(*std::min_element(per_shard.begin(), per_shard.end()), 0);

    torch::nn::EmbeddingBag reference(
        torch::nn::EmbeddingBagOptions(40, kDim).mode(torch::kSum).sparse(true));
    {
      at::NoGradGuard no_grad;
      reference->weight.copy_(initial_rows(pool_ids));
    }
    torch::optim::SGD reference_sgd(reference->parameters(), torch::optim::SGDOptions(kLr));
    dist_optim::DistributedOptimizer three_sgd("sgd", three.remote_parameters(),
                                               optim::OptionBag().set("lr", kLr));
    dist_optim::DistributedOptimizer one_sgd("sgd", one.remote_parameters(),
                                             optim::OptionBag().set("lr", kLr));
    for (int step = 0; step < 5; ++step) {
      const at::Tensor sizes = at::randint(1, 5, {kBags}, generator, at::kLong);
      const at::Tensor offsets =
          at::cat({at::zeros({1}, at::kLong), sizes.cumsum(0).slice(0, 0, -1)});
      // Positions in the pool (the reference's rows) and the raw ids they stand for.
      const at::Tensor rows = at::randint(40, {sizes.sum().item<int64_t>()}, generator, at::kLong);
      const at::Tensor ids = pool.index_select(0, rows);
      const at::Tensor target = at::randn({kBags, kDim}, generator);
      at::Tensor outputs[2];
      ShardedIdEmbeddingBag* tables[2] = {&three, &one};
      dist_optim::DistributedOptimizer* optimizers[2] = {&three_sgd, &one_sgd};
      for (int t = 0; t < 2; ++t) {
        dist_autograd::ContextGuard context;
        outputs[t] = tables[t]->forward(ids, offsets);
        dist_autograd::backward(context.id(), {at::mse_loss(outputs[t], target)});
        optimizers[t]->step(context.id());
      }
      reference_sgd.zero_grad();
      const at::Tensor expected = reference->forward(rows, offsets);
      at::mse_loss(expected, target).backward();
      reference_sgd.step();
      EXPECT_TRUE(at::equal(outputs[0].detach(), expected.detach())) << "step " << step;
      EXPECT_TRUE(at::equal(outputs[1].detach(), expected.detach())) << "step " << step;
    }
    // Every id's row after the steps, one bag each, as the reference's.
    const at::Tensor trained = three.forward(pool.reshape({-1, 1})).detach();
    EXPECT_TRUE(at::equal(trained, reference->weight.detach()));
    EXPECT_TRUE(at::equal(one.forward(pool.reshape({-1, 1})).detach(), trained));
    int64_t live = 0;
    for (const auto& counters : three.shard_counters()) live += counters.at("live_rows");
    EXPECT_EQ(live, 40);

    // In eval mode a lookup only reads: the trained rows, the default row (zeros) for ids
    // without one, no gradient, and no counter moved (no id admitted, no sighting counted).
    const auto counters_before = three.shard_counters();
    three.eval();
    const at::Tensor unseen =
        at::tensor({static_cast<int64_t>(raw_ids()), static_cast<int64_t>(raw_ids())}, at::kLong);
    const at::Tensor read = three.forward(at::cat({pool, unseen}).reshape({-1, 1}));
    EXPECT_FALSE(read.requires_grad());
    EXPECT_TRUE(at::equal(read.narrow(0, 0, 40), trained));
    EXPECT_TRUE(at::equal(read.narrow(0, 40, 2), at::zeros({2, kDim})));
    EXPECT_EQ(three.shard_counters(), counters_before);
    three.train();

    testing::expect_error_containing(
        [&] {
          three.forward(at::tensor({3, 4}, at::kLong));
        },
        {"a 1-D input needs 1-D offsets"});
    testing::expect_error_containing(
        [&] { ShardedIdEmbeddingBag(options({worker(1)}).rows_per_shard(0)); },
        {"rows_per_shard = 0; must be at least 1"});
    testing::expect_error_containing(
        [&] {
          ShardedIdEmbeddingBag(options({worker(1)}).expire_after(3).expire_after_seconds(1));
        },
        {"expire_after = 3 and expire_after_seconds = 1; give at most one"});
  });
}

TEST(ShardedIdEmbeddingBag, ARowHandedToANewIdStepsFromANewAdagradState) {
  testing::with_workers(2, [] {
    using testing::worker;
    // Two rows: a third id takes the row of one of the first two.
    ShardedIdEmbeddingBag table(
        ShardedIdEmbeddingBagOptions(2, kDim, {worker(1)}).mode(torch::kSum).seed(kSeed));
    dist_optim::DistributedOptimizer adagrad("adagrad", table.remote_parameters(),
                                             optim::OptionBag().set("lr", kLr));
    const int64_t first = 1001, second = -2002, third = 3003;
    auto step_on = [&](const at::Tensor& ids) {
      dist_autograd::ContextGuard context;
      // Each id its own bag and a loss of their sum: every row looked up gets a gradient of ones.
      dist_autograd::backward(context.id(), {table.forward(ids.reshape({-1, 1})).sum()});
      adagrad.step(context.id());
    };
    for (int step = 0; step < 3; ++step) step_on(at::tensor({first, second}, at::kLong));
    step_on(at::tensor({third}, at::kLong));
    const at::Tensor third_row = table.forward(at::tensor({third}, at::kLong).reshape({1, 1}));

    // LibTorch's Adagrad, one step of a gradient of ones from a new state, on third's initial row.
    at::Tensor expected = initial_rows({third})[0].clone().requires_grad_(true);
    torch::optim::Adagrad reference({expected}, torch::optim::AdagradOptions(kLr));
    expected.mutable_grad() = at::ones({kDim});
    reference.step();
    EXPECT_TRUE(at::allclose(third_row.detach()[0], expected.detach(), 1e-6, 1e-7))
        << third_row << " against " << expected;
    const std::map<std::string, int64_t> counters = table.shard_counters().at(0);
    EXPECT_EQ(counters.at("admitted"), 3);
    EXPECT_EQ(counters.at("evicted"), 1);
    EXPECT_EQ(counters.at("live_rows"), 2);

    // The server's debug info has the same counters, of its one shard; the trainer, whose own
    // shard (initial_rows') is gone, has none.
    const auto info =
        rpc::rpc_sync<std::map<std::string, int64_t>>(worker(1), "id_table_debug_info");
    EXPECT_EQ(info.at("id_table.shards"), 1);
    for (const auto& [name, value] : counters)
      EXPECT_EQ(info.at("id_table." + name), value) << name;
    EXPECT_EQ(rpc::get_debug_info().count("id_table.shards"), 0u);
  });
}

// Two optimizers over one table (two trainers' DistributedOptimizers, here in one process), each
// with an Adagrad state of its own: a row handed to a new id starts afresh in both, whichever
// steps first (once, only the first to step reset its state).
TEST(ShardedIdEmbeddingBag, ARowHandedToANewIdStepsFromANewStateInEveryOptimizerOverIt) {
  testing::with_workers(2, [] {
    using testing::worker;
    ShardedIdEmbeddingBag table(
        ShardedIdEmbeddingBagOptions(2, kDim, {worker(1)}).mode(torch::kSum).seed(kSeed));
    dist_optim::DistributedOptimizer first_trainer("adagrad", table.remote_parameters(),
                                                   optim::OptionBag().set("lr", kLr));
    dist_optim::DistributedOptimizer second_trainer("adagrad", table.remote_parameters(),
                                                    optim::OptionBag().set("lr", kLr));
    const int64_t first = 1001, second = -2002, third = 3003;
    auto step_on = [&](const at::Tensor& ids) {
      dist_autograd::ContextGuard context;
      // Every row looked up gets a gradient of ones; both optimizers step it.
      dist_autograd::backward(context.id(), {table.forward(ids.reshape({-1, 1})).sum()});
      first_trainer.step(context.id());
      second_trainer.step(context.id());
    };
    for (int step = 0; step < 3; ++step) step_on(at::tensor({first, second}, at::kLong));
    step_on(at::tensor({third}, at::kLong));
    const at::Tensor third_row = table.forward(at::tensor({third}, at::kLong).reshape({1, 1}));

    // LibTorch: two Adagrads, each from a new state, one step each of a gradient of ones on
    // third's initial row.
    at::Tensor expected = initial_rows({third})[0].clone().requires_grad_(true);
    torch::optim::Adagrad one({expected}, torch::optim::AdagradOptions(kLr));
    torch::optim::Adagrad other({expected}, torch::optim::AdagradOptions(kLr));
    expected.mutable_grad() = at::ones({kDim});
    one.step();
    other.step();
    EXPECT_TRUE(at::allclose(third_row.detach()[0], expected.detach(), 1e-6, 1e-7))
        << third_row << " against " << expected;
    EXPECT_EQ(table.shard_counters().at(0).at("evicted"), 1);
  });
}

// Another trainer's lookup may hand a row to a new id between a backward pass and its step (here
// a lookup from another thread, outside the context): the step leaves that row as the new id
// has it, and moves the rest as LibTorch's SGD would (SGD: a step moves a row by its whole
// gradient, so a gradient left in shows). Over two passes into one context, the
// first pass's rows handed out before the second are left out, and the second's own rows of the
// new id are not.
TEST(ShardedIdEmbeddingBag, AStepLeavesOutRowsHandedToNewIdsAfterItsBackward) {
  testing::with_workers(2, [] {
    using testing::worker;
    ShardedIdEmbeddingBag table(
        ShardedIdEmbeddingBagOptions(2, kDim, {worker(1)}).mode(torch::kSum).seed(kSeed));
    dist_optim::DistributedOptimizer sgd("sgd", table.remote_parameters(),
                                         optim::OptionBag().set("lr", kLr));
    const int64_t first = 1001, second = -2002, third = 3003, fourth = 4004;
    // Each lookup one tick of the shard's clock: of two rows, the one looked up first goes first.
    auto lookup = [&](int64_t id) {
      return table.forward(at::tensor({id}, at::kLong).reshape({1, 1}));
    };
    auto lookup_elsewhere = [&](int64_t id) { std::thread([&] { lookup(id); }).join(); };
    auto row = [&](int64_t id) { return lookup(id).detach()[0]; };

    // LibTorch's SGD over second's row and, later, fourth's.
    at::Tensor second_expected = initial_rows({second})[0].clone().requires_grad_(true);
    at::Tensor fourth_expected = initial_rows({fourth})[0].clone().requires_grad_(true);
    torch::optim::SGD second_reference({second_expected}, torch::optim::SGDOptions(kLr));
    torch::optim::SGD fourth_reference({fourth_expected}, torch::optim::SGDOptions(kLr));

    {
      dist_autograd::ContextGuard context;
      const at::Tensor first_read = lookup(first), second_read = lookup(second);
      dist_autograd::backward(context.id(), {first_read.sum() + second_read.sum()});
      lookup_elsewhere(third);  // takes first's row
      sgd.step(context.id());
    }
    second_expected.mutable_grad() = at::ones({kDim});
    second_reference.step();
    EXPECT_EQ(table.shard_counters().at(0).at("evicted"), 1);
    const at::Tensor third_row = row(third);
    at::Tensor second_row = row(second);
    EXPECT_TRUE(at::equal(third_row, initial_rows({third})[0]))
        << third_row << " against " << initial_rows({third})[0];
    EXPECT_TRUE(at::allclose(second_row, second_expected.detach(), 1e-6, 1e-7))
        << second_row << " against " << second_expected;

    {
      dist_autograd::ContextGuard context;
      const at::Tensor third_read = lookup(third), second_read = lookup(second);
      dist_autograd::backward(context.id(), {third_read.sum() + second_read.sum()},
                              /*retain_graph=*/true);
      lookup_elsewhere(fourth);  // takes third's row
      const at::Tensor second_again = lookup(second), fourth_read = lookup(fourth);
      dist_autograd::backward(context.id(), {second_again.sum() + fourth_read.sum()});
      sgd.step(context.id());
    }
    second_expected.mutable_grad() = at::full({kDim}, 2.0);
    second_reference.step();
    fourth_expected.mutable_grad() = at::ones({kDim});
    fourth_reference.step();
    EXPECT_EQ(table.shard_counters().at(0).at("evicted"), 2);
    const at::Tensor fourth_row = row(fourth);
    second_row = row(second);
    EXPECT_TRUE(at::allclose(fourth_row, fourth_expected.detach(), 1e-6, 1e-7))
        << fourth_row << " against " << fourth_expected;
    EXPECT_TRUE(at::allclose(second_row, second_expected.detach(), 1e-6, 1e-7))
        << second_row << " against " << second_expected;
  });
}

}  // namespace id_embedding_test
}  // namespace distoptim
