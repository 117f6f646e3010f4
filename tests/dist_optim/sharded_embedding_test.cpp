// ShardedEmbeddingBag across real processes on loopback: one table split over three parameter
// servers trains exactly as the same table in one shard and as LibTorch's sparse EmbeddingBag in
// one process (same ids, same initial rows; bit for bit), through distributed autograd and the
// DistributedOptimizer. Handles built from another handle's shards, here and on another worker,
// look up and train the same rows.

#include <tuple>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/embedding.h>
#include <torch/optim/sgd.h>

#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/rpc.h>

#include "harness/rpc_workers.h"
#include "support/test_util.h"

namespace distoptim {
namespace sharded_embedding_test {

using rpc::RRef;
using rpc::ShardedEmbeddingBag;
using rpc::ShardedEmbeddingBagOptions;

constexpr int64_t kRows = 100, kDim = 6, kBags = 12;
constexpr double kLr = 0.1;

// The whole table, shard after shard.
at::Tensor fetch_table(const ShardedEmbeddingBag& table) {
  std::vector<at::Tensor> parts;
  for (const auto& rref : table.remote_parameters()) parts.push_back(rref.to_here());
  return at::cat(parts);
}

TEST(ShardedEmbeddingBag, ThreeShardsTrainAsOneAndAsAnUnshardedTable) {
  testing::with_workers(4, [] {
    using testing::worker;
    auto options = [](std::vector<std::string> workers) {
      return ShardedEmbeddingBagOptions(kRows, kDim, std::move(workers)).mode(torch::kSum).seed(5);
    };
    ShardedEmbeddingBag three(options({worker(1), worker(2), worker(3)}));
    ShardedEmbeddingBag one(options({worker(1)}));
    EXPECT_EQ(three.shard_rows(0), std::make_pair(int64_t{0}, int64_t{34}));
    EXPECT_EQ(three.shard_rows(2), std::make_pair(int64_t{67}, int64_t{100}));

    // The same initial rows whatever the sharding, and LibTorch's sparse EmbeddingBag over them.
    const at::Tensor initial = fetch_table(three);
    ASSERT_TRUE(at::equal(initial, fetch_table(one)));
    torch::nn::EmbeddingBag reference(
        torch::nn::EmbeddingBagOptions(kRows, kDim).mode(torch::kSum).sparse(true));
    {
      at::NoGradGuard no_grad;
      reference->weight.copy_(initial);
    }
    torch::optim::SGD reference_sgd(reference->parameters(), torch::optim::SGDOptions(kLr));

    dist_optim::DistributedOptimizer three_sgd("sgd", three.remote_parameters(),
                                               optim::OptionBag().set("lr", kLr));
    dist_optim::DistributedOptimizer one_sgd("sgd", one.remote_parameters(),
                                             optim::OptionBag().set("lr", kLr));
    auto generator = at::detail::createCPUGenerator(3);
    for (int step = 0; step < 6; ++step) {
      // Bags of 1 to 5 ids, some rows twice, spread over every shard (or, at step 2, only one).
      const at::Tensor sizes = at::randint(1, 6, {kBags}, generator, at::kLong);
      const at::Tensor offsets =
          at::cat({at::zeros({1}, at::kLong), sizes.cumsum(0).slice(0, 0, -1)});
      const int64_t high = step == 2 ? 30 : kRows;
      const at::Tensor ids = at::randint(high, {sizes.sum().item<int64_t>()}, generator, at::kLong);
      const at::Tensor target = at::randn({kBags, kDim}, generator);
      at::Tensor outputs[2];
      ShardedEmbeddingBag* tables[2] = {&three, &one};
      dist_optim::DistributedOptimizer* optimizers[2] = {&three_sgd, &one_sgd};
      for (int t = 0; t < 2; ++t) {
        dist_autograd::ContextGuard context;
        outputs[t] = tables[t]->forward(ids, offsets);
        dist_autograd::backward(context.id(), {at::mse_loss(outputs[t], target)});
        optimizers[t]->step(context.id());
      }
      reference_sgd.zero_grad();
      const at::Tensor expected = reference->forward(ids, offsets);
      at::mse_loss(expected, target).backward();
      reference_sgd.step();
      EXPECT_TRUE(at::equal(outputs[0].detach(), expected.detach())) << "step " << step;
      EXPECT_TRUE(at::equal(outputs[1].detach(), expected.detach())) << "step " << step;
    }
    const at::Tensor trained = fetch_table(three);
    EXPECT_TRUE(at::equal(trained, reference->weight.detach()));
    EXPECT_TRUE(at::equal(fetch_table(one), reference->weight.detach()));
    EXPECT_FALSE(at::equal(trained, initial));

    // 2-D input (each row a bag) and mean pooling, as LibTorch's EmbeddingBag takes them.
    ShardedEmbeddingBag mean(
        ShardedEmbeddingBagOptions(kRows, kDim, {worker(2), worker(3)}).seed(5));
    torch::nn::EmbeddingBag reference_mean(torch::nn::EmbeddingBagOptions(kRows, kDim));
    {
      at::NoGradGuard no_grad;
      reference_mean->weight.copy_(initial);
    }
    const at::Tensor grid = at::randint(kRows, {4, 3}, generator, at::kLong);
    EXPECT_TRUE(at::equal(mean.forward(grid), reference_mean->forward(grid).detach()));

    // Bad input is refused here, naming it.
    testing::expect_error_containing(
        [&] {
          three.forward(at::tensor({3, 100}, at::kLong), at::zeros({1}, at::kLong));
        },
        {"id 100 is outside the table's 100 rows"});
    testing::expect_error_containing(
        [&] {
          three.forward(at::tensor({3, 4}, at::kLong));
        },
        {"a 1-D input needs 1-D offsets"});
    testing::expect_error_containing(
        [&] {
          ShardedEmbeddingBag(
              ShardedEmbeddingBagOptions(2, kDim, {worker(1), worker(2), worker(3)}));
        },
        {"3 workers for 2 rows"});
  });
}

// On the worker it is sent to: a handle on the sender's table from its shards, and the lookup of
// `ids` (one bag each) through it.
at::Tensor look_up_elsewhere(std::vector<std::string> workers,
                             std::vector<RRef<rpc::EmbeddingShard>> shards, const at::Tensor& ids) {
  ShardedEmbeddingBag table(
      ShardedEmbeddingBagOptions(kRows, kDim, std::move(workers)).mode(torch::kSum).seed(5),
      std::move(shards));
  return table.forward(ids.reshape({-1, 1}));
}
DISTOPTIM_RPC_FUNCTION("sharded_embedding_test.look_up_elsewhere", look_up_elsewhere);

TEST(ShardedEmbeddingBag, HandlesFromShardModuleRrefsShareTheTable) {
  testing::with_workers(4, [] {
    using testing::worker;
    const std::vector<std::string> workers = {worker(1), worker(2)};
    const auto options = ShardedEmbeddingBagOptions(kRows, kDim, workers).mode(torch::kSum).seed(5);
    ShardedEmbeddingBag first(options);
    const auto shards = first.shard_module_rrefs();
    ASSERT_EQ(shards.size(), 2u);
    EXPECT_EQ(shards[0].owner_name(), worker(1));
    EXPECT_EQ(shards[1].owner_name(), worker(2));
    ShardedEmbeddingBag second(options, shards);
    EXPECT_EQ(second.shard_rows(1), first.shard_rows(1));
    // Without keys, a handle names each shard by its reference, as the first does; with keys,
    // by those it is given.
    EXPECT_EQ(second.shard_keys(), first.shard_keys());
    EXPECT_EQ(ShardedEmbeddingBag(options, shards, {"a", "b"}).shard_key(1), "b");
    EXPECT_EQ(second.remote_parameters().size(), 2u);

    // A step through the second handle moves the rows the first one and a handle on worker 3
    // (built from the shards sent there) see.
    const at::Tensor ids = at::tensor({0, 49, 50, 99}, at::kLong);
    const at::Tensor before = first.forward(ids.reshape({-1, 1})).detach();
    dist_optim::DistributedOptimizer sgd("sgd", second.remote_parameters(),
                                         optim::OptionBag().set("lr", kLr));
    {
      dist_autograd::ContextGuard context;
      dist_autograd::backward(context.id(), {second.forward(ids.reshape({-1, 1})).sum()});
      sgd.step(context.id());
    }
    const at::Tensor after = first.forward(ids.reshape({-1, 1})).detach();
    EXPECT_TRUE(at::allclose(after, before - kLr));
    const at::Tensor elsewhere = rpc::rpc_sync<at::Tensor>(
        worker(3), "sharded_embedding_test.look_up_elsewhere", std::tuple{workers, shards, ids});
    EXPECT_TRUE(at::equal(elsewhere, after));

    // Shards that do not match the options are refused, naming what differs.
    testing::expect_error_containing(
        [&] { ShardedEmbeddingBag(ShardedEmbeddingBagOptions(kRows, kDim, {worker(1)}), shards); },
        {"2 shards for 1 workers"});
    testing::expect_error_containing(
        [&] {
          ShardedEmbeddingBag(options, {shards[1], shards[0]});
        },
        {"shard 0 (on worker '" + worker(2) +
         "') holds rows [50, 100) of the table; the options "
         "give it rows [0, 50)"});
    // A shard's owner is its reference's, whatever worker the options name (a backup may have
    // taken it over).
    EXPECT_EQ(
        ShardedEmbeddingBag(ShardedEmbeddingBagOptions(kRows, kDim, {worker(2), worker(1)}), shards)
            .shard_owner(0),
        worker(1));
    testing::expect_error_containing([&] { ShardedEmbeddingBag(options, shards, {"a"}); },
                                     {"1 shard keys for 2 shards"});
    testing::expect_error_containing(
        [&] {
          ShardedEmbeddingBag(options, shards, {"a", ""});
        },
        {"shard key 1 is empty"});
  });
}

}  // namespace sharded_embedding_test
}  // namespace distoptim
