// ShardedEmbeddingBag across real processes on loopback: one table split over three parameter
// servers trains exactly as the same table in one shard and as LibTorch's sparse EmbeddingBag in
// one process (same ids, same initial rows; bit for bit), through distributed autograd and the
// DistributedOptimizer.

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
namespace {

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

}  // namespace
}  // namespace distoptim
