// ZeroRedundancyOptimizer: PyTorch's partition (computed by the reference), DDP + ZeRO equal to
// one process training on the concatenated batch, consolidated state equal to that process's
// optimizer state, resharding a checkpoint to another world size, and bad input.

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <distoptim/comm.h>
#include <distoptim/data_parallel.h>
#include <distoptim/optim.h>

#include "global_batch.h"
#include "harness/absent_rank.h"
#include "harness/command.h"
#include "harness/multiprocess.h"
#include "support/state_dicts.h"
#include "support/test_util.h"

namespace distoptim {
namespace data_parallel {
namespace zero_redundancy_optimizer_test {

using distoptim::testing::expect_error_containing;
using distoptim::testing::expect_state_dicts_close;
using distoptim::testing::run_ranks;
using namespace std::chrono_literals;

void init(std::chrono::milliseconds timeout = 30s) {
  comm::init_process_group(comm::ProcessGroupOptions("env://").timeout(timeout));
}

// Parameter numels 96, 16, 64, 4: with two ranks, rank 0 owns only the first weight. The first
// layer is float64, the second float64 or float32 (mixed dtypes), cast around.
struct NetImpl : torch::nn::Module {
  NetImpl(torch::Dtype second_layer)
      : first(register_module("first", torch::nn::Linear(6, 16))),
        second(register_module("second", torch::nn::Linear(16, 4))) {
    first->to(torch::kFloat64);
    second->to(second_layer);
  }
  at::Tensor forward(const at::Tensor& x) {
    const auto hidden = torch::tanh(first->forward(x));
    return second->forward(hidden.to(second->weight.scalar_type())).to(torch::kFloat64);
  }
  torch::nn::Linear first;
  torch::nn::Linear second;
};
TORCH_MODULE(Net);

Net make_model(int64_t seed, torch::Dtype second_layer = torch::kFloat64) {
  torch::manual_seed(seed);
  return Net(second_layer);
}

// Two groups: the first layer with the defaults, the second with its own lr.
std::vector<optim::ParamGroup> param_groups(Net& model) {
  return {optim::ParamGroup(model->first->parameters()),
          optim::ParamGroup(model->second->parameters(), optim::OptionBag{{"lr", 0.02}})};
}

const optim::OptionBag kAdamDefaults{{"lr", 0.01}, {"weight_decay", 0.01}, {"amsgrad", true}};

// One process training `reference` on the whole batch of every iteration: what ZeRO must equal.
class SingleProcessRun {
 public:
  explicit SingleProcessRun(torch::Dtype second_layer = torch::kFloat64)
      : model_(make_model(100, second_layer)),
        optimizer_(optim::create_optimizer("adam", param_groups(model_), kAdamDefaults)) {}

  void train(int iteration, int world_size) {
    const Batch batch(7 + iteration, world_size);
    model_->zero_grad();
    torch::mse_loss(model_->forward(batch.x), batch.y).backward();
    std::vector<at::Tensor> gradients;
    for (const auto& p : optimizer_->params()) gradients.push_back(p.grad());
    optimizer_->step(gradients);
  }

  std::vector<at::Tensor> params() const { return optimizer_->params(); }
  optim::OptimizerStateDict state_dict() const { return optimizer_->state_dict(); }

 private:
  Net model_;
  std::unique_ptr<optim::FunctionalOptimizer> optimizer_;
};

// One iteration on this rank's rows; gradients averaged by `ddp` when given.
void ddp_zero_iteration(DistributedDataParallel<Net>* ddp, Net& model,
                        ZeroRedundancyOptimizer& zero, int iteration, int rank, int world_size) {
  const Batch batch(7 + iteration, world_size);
  zero.zero_grad();
  const auto x = batch.local_x(rank);
  const auto output = ddp != nullptr ? ddp->forward(x) : model->forward(x);
  torch::mse_loss(output, batch.local_y(rank)).backward();
  zero.step();
}

// Relative tolerance 1e-10, or 1e-5 when float32 took part (`float32_in_graph` for float64
// parameters whose gradients flowed through float32 arithmetic).
void expect_params_close(const std::vector<at::Tensor>& params,
                         const std::vector<at::Tensor>& expected, const std::string& what,
                         bool float32_in_graph = false) {
  ASSERT_EQ(params.size(), expected.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const bool float32 = float32_in_graph || params[i].scalar_type() == at::kFloat;
    const double rtol = float32 ? 1e-5 : 1e-10;
    EXPECT_TRUE(at::allclose(params[i], expected[i], rtol, rtol * 1e-2))
        << what << ": parameter " << i << "\n"
        << params[i] << "\nexpected\n"
        << expected[i];
  }
}

// Every rank's parameters are bit-identical to rank 0's.
void expect_replicas_identical(const std::vector<at::Tensor>& params) {
  for (size_t i = 0; i < params.size(); ++i) {
    std::vector<at::Tensor> root = {params[i].detach().clone()};
    comm::world().process_group()->broadcast(root)->wait();
    EXPECT_TRUE(at::equal(root[0], params[i])) << "parameter " << i << " differs from rank 0's";
  }
}

// ---------------------------------------------------------------------------------------------

TEST(ZeroPartition, EqualsPyTorchsForTheSameParametersAndWorldSize) {
  // Random groups with many ties and empty parameters, for world sizes 1 to 5.
  std::mt19937 random(1234);
  nlohmann::json cases = nlohmann::json::array();
  std::vector<std::pair<int, std::vector<std::vector<int64_t>>>> inputs;
  for (int c = 0; c < 60; ++c) {
    const int world_size = 1 + c % 5;
    std::vector<std::vector<int64_t>> groups(1 + random() % 3);
    for (auto& group : groups) {
      group.resize(random() % 9);
      for (auto& numel : group) numel = (random() % 4 == 0) ? 0 : 1 + random() % 6;
    }
    cases.push_back({{"world_size", world_size}, {"groups", groups}});
    inputs.emplace_back(world_size, groups);
  }
  const auto result = distoptim::testing::run_command(
      distoptim::testing::shell_quote(DISTOPTIM_REFERENCE_PYTHON) + " " +
      distoptim::testing::shell_quote(DISTOPTIM_SOURCE_DIR
                                      "/tests/data_parallel/reference/zero_partition.py") +
      " " + distoptim::testing::shell_quote(cases.dump()));
  ASSERT_TRUE(result.ok) << result.output;
  const auto expected = nlohmann::json::parse(result.output);
  ASSERT_EQ(expected.size(), inputs.size());
  for (size_t c = 0; c < inputs.size(); ++c) {
    const auto partition = zero_partition(inputs[c].second, inputs[c].first);
    EXPECT_EQ(nlohmann::json(partition), expected[c]) << "case " << cases[c].dump();
  }
}

TEST(ZeroPartition, RejectsABadWorldSize) {
  expect_error_containing([] { zero_partition({{1, 2}}, 0); }, {"world_size = 0"});
}

class ZeroStep : public ::testing::TestWithParam<std::tuple<int, bool, int>> {};

// Stage 1 behind a DistributedDataParallel; stage 2 on the plain module (it averages the
// gradients itself).
TEST_P(ZeroStep, DdpPlusZeroEqualsOneProcessOnTheFullBatch) {
  const auto [world, bucket_view, stage] = GetParam();
  run_ranks(world, [bucket_view = bucket_view, stage = stage](int rank, int world_size) {
    init();
    // DDP gives every rank rank 0's weights; without it, every rank starts from the same.
    auto model = make_model(stage == 1 ? 100 + rank : 100);
    std::optional<DistributedDataParallel<Net>> ddp;
    if (stage == 1) ddp.emplace(model);
    ZeroRedundancyOptimizer zero(
        param_groups(model), "adam", kAdamDefaults,
        ZeroRedundancyOptimizerOptions().parameters_as_bucket_view(bucket_view).stage(stage));
    // The partition is the documented one, and this rank's optimizer holds its share of it.
    std::vector<std::vector<int64_t>> numels(2);
    for (int g = 0; g < 2; ++g) {
      for (const auto& p : (g == 0 ? model->first : model->second)->parameters())
        numels[g].push_back(p.numel());
    }
    EXPECT_EQ(zero.partition(), zero_partition(numels, world_size));
    EXPECT_EQ(zero.local_optimizer().params().size(), zero.partition()[rank].size());

    SingleProcessRun reference;
    for (int iteration = 0; iteration < 6; ++iteration) {
      ddp_zero_iteration(ddp ? &*ddp : nullptr, model, zero, iteration, rank, world_size);
      reference.train(iteration, world_size);
      expect_params_close(zero.params(), reference.params(),
                          "iteration " + std::to_string(iteration));
      expect_replicas_identical(zero.params());
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldBucketViewAndStage, ZeroStep,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Bool(),
                                            ::testing::Values(1, 2)));

// After backward, stage 2 leaves on each rank exactly the gradients of the parameters it owns,
// equal to the average a DistributedDataParallel computes for stage 1, and no other.
TEST(ZeroStage2, BackwardLeavesOnlyTheOwnedGradientsAveragedAsDdpDoes) {
  run_ranks(3, [](int rank, int world_size) {
    init();
    auto ddp_model = make_model(100, torch::kFloat32);
    DistributedDataParallel ddp(ddp_model);
    auto model = make_model(100, torch::kFloat32);
    ZeroRedundancyOptimizer zero(param_groups(model), "adam", kAdamDefaults,
                                 ZeroRedundancyOptimizerOptions().stage(2));
    for (int iteration = 0; iteration < 2; ++iteration) {
      {
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < zero.params().size(); ++i) {
          ddp_model->parameters()[i].copy_(zero.params()[i]);
        }
      }
      const Batch batch(7 + iteration, world_size);
      ddp_model->zero_grad();
      zero.zero_grad();
      torch::mse_loss(ddp.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
      torch::mse_loss(model->forward(batch.local_x(rank)), batch.local_y(rank)).backward();
      const auto averaged = ddp_model->parameters();
      const auto& params = zero.params();
      for (size_t i = 0; i < params.size(); ++i) {
        const bool mine = std::find(zero.partition()[rank].begin(), zero.partition()[rank].end(),
                                    static_cast<int64_t>(i)) != zero.partition()[rank].end();
        if (!mine) {
          EXPECT_FALSE(params[i].grad().defined()) << "parameter " << i << " of another rank";
          continue;
        }
        ASSERT_TRUE(params[i].grad().defined()) << "parameter " << i;
        const double rtol = params[i].scalar_type() == at::kFloat ? 1e-6 : 1e-12;
        EXPECT_TRUE(at::allclose(params[i].grad(), averaged[i].grad(), rtol, rtol * 1e-2))
            << "parameter " << i << "\n"
            << params[i].grad() << "\nDDP's\n"
            << averaged[i].grad();
      }
      zero.step();
    }
  });
}

// A parameter that gets no gradient in a pass counts as zeros: its owner gets a zero gradient,
// also when it shares a bucket with one that got its gradient.
TEST(ZeroStage2, AParameterWithoutAGradientCountsAsZeros) {
  run_ranks(2, [](int rank, int) {
    init();
    const auto options = torch::dtype(torch::kFloat64).requires_grad(true);
    // Greedy partition: rank 0 owns `big`, rank 1 owns `used` and `unused`, in one bucket.
    auto big = torch::ones({10}, options);
    auto used = torch::ones({4}, options);
    auto unused = torch::ones({4}, options);
    ZeroRedundancyOptimizer zero({big, used, unused}, "sgd", {{"lr", 0.1}},
                                 ZeroRedundancyOptimizerOptions().stage(2));
    ASSERT_EQ(zero.partition(), (std::vector<std::vector<int64_t>>{{0}, {1, 2}}));
    for (int iteration = 0; iteration < 2; ++iteration) {
      zero.zero_grad();
      ((big.sum() + used.sum()) * (rank + 1)).backward();
      // The average of 1 and 2.
      if (rank == 0) {
        EXPECT_TRUE(at::equal(big.grad(), torch::full({10}, 1.5, torch::kFloat64)));
        EXPECT_FALSE(used.grad().defined());
        EXPECT_FALSE(unused.grad().defined());
      } else {
        EXPECT_FALSE(big.grad().defined());
        EXPECT_TRUE(at::equal(used.grad(), torch::full({4}, 1.5, torch::kFloat64)));
        ASSERT_TRUE(unused.grad().defined());
        EXPECT_TRUE(at::equal(unused.grad(), torch::zeros({4}, torch::kFloat64)));
      }
      zero.step();
    }
  });
}

// Stage 2 installs the large block cache (by default) and its gradients of 1 MiB and more run
// through it: after the first passes no block is mapped afresh, the freed gradients being reused,
// and every rank ends with the parameters the average gradient gives.
TEST(ZeroStage2, InstallsTheLargeBlockCacheAndReusesItsFreedGradients) {
  run_ranks(2, [](int rank, int world_size) {
    init();
    torch::manual_seed(5);
    const auto options = torch::dtype(torch::kFloat64);
    // 256 x 512 float64: 1 MiB each, the cache's default threshold.
    std::vector<at::Tensor> params;
    for (int i = 0; i < 3; ++i) params.push_back(torch::randn({256, 512}, options));
    const at::Tensor direction = torch::randn({256, 512}, options);
    const std::vector<at::Tensor> initial = distoptim::testing::clone_all(params);
    for (auto& p : params) p.requires_grad_(true);
    ZeroRedundancyOptimizer zero(params, "sgd", {{"lr", 0.5}},
                                 ZeroRedundancyOptimizerOptions().stage(2));
    ASSERT_TRUE(large_block_cache_installed());
    LargeBlockCacheStats after_warmup;
    constexpr int kPasses = 4;
    for (int pass = 0; pass < kPasses; ++pass) {
      if (pass == 2) after_warmup = large_block_cache_stats();
      zero.zero_grad();
      at::Tensor loss = torch::zeros({}, options);
      for (const auto& p : params) loss = loss + (p * direction).sum() * (rank + 1);
      loss.backward();
      zero.step();
    }
    const LargeBlockCacheStats end = large_block_cache_stats();
    EXPECT_EQ(end.mapped, after_warmup.mapped);
    EXPECT_GT(end.reused, after_warmup.reused);
    // The average gradient of every parameter is direction * (1 + 2) / 2, as stage 2 sums it:
    // each rank's part divided by the world size.
    const at::Tensor average = direction * 1 / world_size + direction * 2 / world_size;
    for (size_t i = 0; i < params.size(); ++i) {
      torch::NoGradGuard no_grad;
      at::Tensor expected = initial[i].clone();
      for (int pass = 0; pass < kPasses; ++pass) expected -= 0.5 * average;
      EXPECT_TRUE(at::allclose(params[i], expected, 1e-12, 1e-12)) << "parameter " << i;
    }
  });
}

// large_block_cache(false) leaves LibTorch's CPU allocator as it was.
TEST(ZeroStage2, LargeBlockCacheFalseLeavesTheAllocatorAlone) {
  run_ranks(2, [](int, int) {
    init();
    c10::Allocator* before = c10::GetCPUAllocator();
    auto p = torch::ones({4}, torch::dtype(torch::kFloat64).requires_grad(true));
    auto q = torch::ones({4}, torch::dtype(torch::kFloat64).requires_grad(true));
    ZeroRedundancyOptimizer zero(
        {p, q}, "sgd", {{"lr", 0.1}},
        ZeroRedundancyOptimizerOptions().stage(2).large_block_cache(false));
    EXPECT_EQ(c10::GetCPUAllocator(), before);
  });
}

// Two float64 parameters of ones under stage 2 and SGD (lr 0.5): the greedy partition gives
// `big` (10 elements) to rank 0 and `small` (4) to rank 1.
struct OneParameterEach {
  at::Tensor big = torch::ones({10}, torch::dtype(torch::kFloat64).requires_grad(true));
  at::Tensor small = torch::ones({4}, torch::dtype(torch::kFloat64).requires_grad(true));
  ZeroRedundancyOptimizer zero{std::vector<at::Tensor>{big, small}, "sgd",
                               optim::OptionBag{{"lr", 0.5}},
                               ZeroRedundancyOptimizerOptions().stage(2)};
};

// Gradients accumulate over backward passes without zero_grad as in stage 1: the owner ends
// with the sum of each pass's average, and a step then applies that sum.
TEST(ZeroStage2, GradientsAccumulateOverBackwardPasses) {
  run_ranks(2, [](int rank, int) {
    init();
    OneParameterEach two;
    at::Tensor& big = two.big;
    at::Tensor& small = two.small;
    ZeroRedundancyOptimizer& zero = two.zero;
    ASSERT_EQ(zero.partition(), (std::vector<std::vector<int64_t>>{{0}, {1}}));
    zero.zero_grad();
    // Averages 1.5, then 3, then 4.5 (rank r contributes r + 1 times the pass number).
    for (int pass = 1; pass <= 3; ++pass) {
      ((big.sum() + small.sum()) * (rank + 1) * pass).backward();
    }
    at::Tensor& mine = rank == 0 ? big : small;
    const at::Tensor& other = rank == 0 ? small : big;
    EXPECT_TRUE(at::equal(mine.grad(), torch::full(mine.sizes(), 9.0, torch::kFloat64)))
        << mine.grad();
    EXPECT_FALSE(other.grad().defined());
    zero.step();
    // 1 - 0.5 * 9 on every rank, once the step has shared every owner's update.
    EXPECT_TRUE(at::equal(big.detach(), torch::full({10}, -3.5, torch::kFloat64))) << big;
    EXPECT_TRUE(at::equal(small.detach(), torch::full({4}, -3.5, torch::kFloat64))) << small;
  });
}

// An owner's bucket is used again by the next pass once zero_grad dropped its gradients, and
// not while the user still holds one: a gradient kept from an earlier pass keeps its values.
// Buckets are told apart by their storage, watched through weak references (which keep a freed
// storage's object from being reallocated at the same address, without holding its memory).
TEST(ZeroStage2, ABucketIsReusedOnlyOnceNoGradientOfItIsHeld) {
  run_ranks(2, [](int rank, int) {
    init();
    OneParameterEach two;
    at::Tensor& big = two.big;
    at::Tensor& small = two.small;
    ZeroRedundancyOptimizer& zero = two.zero;
    ASSERT_EQ(zero.partition(), (std::vector<std::vector<int64_t>>{{0}, {1}}));
    at::Tensor& mine = rank == 0 ? big : small;
    using WeakStorage = c10::weak_intrusive_ptr<c10::StorageImpl>;
    // Pass p: every rank's gradient is (rank + 1) * p, so the owner's average is 1.5 * p.
    auto pass = [&](int p) {
      zero.zero_grad();
      ((big.sum() + small.sum()) * (rank + 1) * p).backward();
      EXPECT_TRUE(at::equal(mine.grad(), torch::full(mine.sizes(), 1.5 * p, torch::kFloat64)))
          << "pass " << p << ": " << mine.grad();
      WeakStorage storage = mine.grad().storage().getWeakStorageImpl();
      zero.step();
      return storage;
    };
    auto same = [](const WeakStorage& a, const WeakStorage& b) {
      return !a.expired() && a.lock().get() == b.lock().get();
    };
    const WeakStorage first = pass(1);
    at::Tensor held = mine.grad();
    const at::Tensor held_values = held.clone();
    const WeakStorage second = pass(2);
    EXPECT_FALSE(same(second, first)) << "the held gradient's bucket was used again";
    EXPECT_TRUE(at::equal(held, held_values)) << held;
    held = at::Tensor();
    EXPECT_TRUE(same(pass(3), second)) << "nothing held pass 2's bucket: pass 3 should reuse it";
    EXPECT_TRUE(same(pass(4), second));
  });
}

// A DistributedDataParallel around a stage-2 model writes every gradient after the reduction:
// step refuses it before changing anything.
TEST(ZeroStage2, StepRefusesGradientsOfOtherRanksLeftByADdp) {
  run_ranks(2, [](int rank, int world_size) {
    init();
    auto model = make_model(100);
    DistributedDataParallel ddp(model);
    ZeroRedundancyOptimizer zero(param_groups(model), "adam", kAdamDefaults,
                                 ZeroRedundancyOptimizerOptions().stage(2));
    const Batch batch(7, world_size);
    torch::mse_loss(ddp.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
    std::vector<at::Tensor> before;
    for (const auto& p : zero.params()) before.push_back(p.detach().clone());
    expect_error_containing([&] { zero.step(); },
                            {"stage 2", "has a gradient on rank " + std::to_string(rank),
                             "not a DistributedDataParallel"});
    for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(at::equal(zero.params()[i], before[i]));
  });
}

// Behind a DistributedDataParallel with gradient_as_bucket_view, gradients are views of its
// buckets: zero_grad(false) zeroes them in place (detach_() would throw) and keeps them those
// views, so the next backward accumulates in the buckets; set to none and zeroed iterations
// alternate, and training equals one process's.
TEST(ZeroRedundancyOptimizer, ZeroGradKeepsGradientsThatAreViewsOfDdpBuckets) {
  run_ranks(2, [](int rank, int world_size) {
    init();
    auto model = make_model(100 + rank);
    DistributedDataParallel ddp(model,
                                DistributedDataParallelOptions().gradient_as_bucket_view(true));
    ZeroRedundancyOptimizer zero(param_groups(model), "adam", kAdamDefaults);
    SingleProcessRun reference;
    for (int iteration = 0; iteration < 6; ++iteration) {
      const bool set_to_none = iteration % 2 == 0;
      std::vector<at::Tensor> zeroed;
      zero.zero_grad(set_to_none);
      for (const auto& p : zero.params()) {
        if (set_to_none) {
          EXPECT_FALSE(p.grad().defined()) << "iteration " << iteration;
        } else {
          ASSERT_TRUE(p.grad().is_view()) << "iteration " << iteration;
          EXPECT_EQ(p.grad().count_nonzero().item<int64_t>(), 0) << "iteration " << iteration;
          zeroed.push_back(p.grad());
        }
      }
      const Batch batch(7 + iteration, world_size);
      torch::mse_loss(ddp.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
      // Accumulated in place: the zeroed views are the averaged gradients (from the third
      // iteration: the second forward rebuilds the buckets, and with them the views).
      for (size_t i = 0; iteration >= 2 && i < zeroed.size(); ++i) {
        EXPECT_TRUE(zeroed[i].is_same(zero.params()[i].grad()))
            << "iteration " << iteration << ", parameter " << i;
      }
      zero.step();
      reference.train(iteration, world_size);
      expect_params_close(zero.params(), reference.params(),
                          "iteration " + std::to_string(iteration));
      expect_replicas_identical(zero.params());
    }
  });
}

class ZeroOverlap : public ::testing::TestWithParam<int> {};

// The update runs inside backward, from the first iteration, on Gloo; with one bucket per
// parameter (tiny bucket_cap_mb) the updates and broadcasts interleave bucket by bucket.
TEST_P(ZeroOverlap, UpdatesInsideBackwardEqualOneProcessFromTheFirstIteration) {
  run_ranks(GetParam(), [](int rank, int world_size) {
    init();
    auto model = make_model(100 + rank);
    DistributedDataParallel ddp(model, DistributedDataParallelOptions().bucket_cap_mb(0.0005));
    ZeroRedundancyOptimizer zero(param_groups(model), "adam", kAdamDefaults,
                                 ZeroRedundancyOptimizerOptions().overlap_with_ddp(true));
    ddp.register_comm_hook(hook_with_zero_step(zero));
    SingleProcessRun reference;
    for (int iteration = 0; iteration < 5; ++iteration) {
      const Batch batch(7 + iteration, world_size);
      zero.zero_grad();
      torch::mse_loss(ddp.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
      zero.step();  // does nothing: backward did it
      reference.train(iteration, world_size);
      expect_params_close(zero.params(), reference.params(),
                          "iteration " + std::to_string(iteration));
      expect_replicas_identical(zero.params());
    }
    zero.consolidate_state_dict(0);
    if (rank == 0) expect_state_dicts_close(zero.state_dict(), reference.state_dict());
  });
}

INSTANTIATE_TEST_SUITE_P(World, ZeroOverlap, ::testing::Values(2, 3));

TEST(ZeroRedundancyOptimizer, OverlapHookRejectsAMismatchedDdpOrOptimizer) {
  run_ranks(2, [](int rank, int) {
    init();
    auto model = make_model(100);
    ZeroRedundancyOptimizer plain(param_groups(model), "adam");
    expect_error_containing([&] { hook_with_zero_step(plain); },
                            {"hook_with_zero_step", "overlap_with_ddp = false"});
    // The optimizer holds only the first layer: the second layer's bucket is refused.
    DistributedDataParallel ddp(model);
    ZeroRedundancyOptimizer first_layer_only(
        model->first->parameters(), "adam", {},
        ZeroRedundancyOptimizerOptions().overlap_with_ddp(true));
    ddp.register_comm_hook(hook_with_zero_step(first_layer_only));
    const Batch batch(7, 2);
    expect_error_containing(
        [&] { torch::mse_loss(ddp.forward(batch.local_x(rank)), batch.local_y(rank)).backward(); },
        {"hook_with_zero_step", "is not a parameter of this ZeroRedundancyOptimizer"});
  });
}

TEST(ZeroRedundancyOptimizer, LocalOptimizerByTypeEqualsByName) {
  run_ranks(2, [](int rank, int world_size) {
    init();
    auto model = make_model(100 + rank);
    DistributedDataParallel ddp(model);
    ZeroRedundancyOptimizer zero(param_groups(model), [](std::vector<optim::ParamGroup> shard) {
      return std::make_unique<optim::Adam>(
          std::move(shard), optim::AdamOptions().lr(0.01).weight_decay(0.01).amsgrad(true));
    });
    SingleProcessRun reference;
    for (int iteration = 0; iteration < 4; ++iteration) {
      ddp_zero_iteration(&ddp, model, zero, iteration, rank, world_size);
      reference.train(iteration, world_size);
    }
    expect_params_close(zero.params(), reference.params(), "after 4 iterations");
    // A factory that ignores its shard is refused.
    expect_error_containing(
        [&] {
          ZeroRedundancyOptimizer(
              {optim::ParamGroup({torch::zeros({5}, torch::kFloat64)})},
              [](std::vector<optim::ParamGroup>) {
                return std::make_unique<optim::Adam>(std::vector<optim::ParamGroup>{
                    optim::ParamGroup({torch::zeros({2}), torch::zeros({3})})});
              });
        },
        {"factory built an optimizer over 2 parameters"});
  });
}

// LibTorch's Adam as the local optimizer, with and without overlap: the same parameters as
// LibTorch's Adam in one process on the full batch.
TEST(ZeroRedundancyOptimizer, LibTorchLocalOptimizerTrainsLikeItDoesInOneProcess) {
  run_ranks(2, [](int rank, int world_size) {
    init();
    auto make_adam = [](std::vector<at::Tensor> shard) {
      return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(0.01));
    };
    auto model = make_model(100 + rank);
    DistributedDataParallel ddp(model);
    ZeroRedundancyOptimizer zero(model->parameters(), make_adam);
    ASSERT_NE(zero.libtorch_local_optimizer(), nullptr);
    EXPECT_EQ(zero.libtorch_local_optimizer()->parameters().size(), zero.partition()[rank].size());

    auto overlapped_model = make_model(100 + rank);
    DistributedDataParallel overlapped_ddp(overlapped_model,
                                           DistributedDataParallelOptions().bucket_cap_mb(0.0005));
    ZeroRedundancyOptimizer overlapped(overlapped_model->parameters(), make_adam,
                                       ZeroRedundancyOptimizerOptions().overlap_with_ddp(true));
    overlapped_ddp.register_comm_hook(hook_with_zero_step(overlapped));

    auto reference = make_model(100);
    torch::optim::Adam reference_adam(reference->parameters(), torch::optim::AdamOptions(0.01));
    for (int iteration = 0; iteration < 4; ++iteration) {
      const Batch batch(7 + iteration, world_size);
      zero.zero_grad();
      torch::mse_loss(ddp.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
      zero.step();
      overlapped.zero_grad();
      torch::mse_loss(overlapped_ddp.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
      reference_adam.zero_grad();
      torch::mse_loss(reference->forward(batch.x), batch.y).backward();
      reference_adam.step();
    }
    expect_params_close(zero.params(), reference->parameters(), "after 4 iterations");
    expect_params_close(overlapped.params(), reference->parameters(),
                        "after 4 overlapped iterations");
    expect_replicas_identical(zero.params());

    expect_error_containing([&] { zero.consolidate_state_dict(0); },
                            {"consolidate_state_dict", "LibTorch", "tensor address"});
    EXPECT_EQ(zero.local_optimizer().name(), "libtorch");
    expect_error_containing([&] { zero.local_optimizer().state_dict(); },
                            {"state_dict", "LibTorch", "tensor address"});
    auto extra = torch::zeros({3}, torch::kFloat64);
    expect_error_containing(
        [&] {
          zero.add_param_group(optim::ParamGroup({extra}, {{"lr", 0.1}}));
        },
        {"add_param_group", "lr", "LibTorch"});
    zero.add_param_group(optim::ParamGroup({extra}));
    EXPECT_EQ(zero.params().size(), 5u);
  });
}

TEST(ZeroRedundancyOptimizer, ParametersOfMixedDtypesAreBucketedPerDtype) {
  run_ranks(2, [](int rank, int world_size) {
    init();
    auto model = make_model(100 + rank, torch::kFloat32);
    DistributedDataParallel ddp(model);
    ZeroRedundancyOptimizer zero(param_groups(model), "adam", kAdamDefaults,
                                 ZeroRedundancyOptimizerOptions().parameters_as_bucket_view(true));
    SingleProcessRun reference(torch::kFloat32);
    for (int iteration = 0; iteration < 4; ++iteration) {
      ddp_zero_iteration(&ddp, model, zero, iteration, rank, world_size);
      reference.train(iteration, world_size);
    }
    EXPECT_EQ(zero.params()[2].scalar_type(), at::kFloat);
    expect_params_close(zero.params(), reference.params(), "after 4 iterations",
                        /*float32_in_graph=*/true);
    expect_replicas_identical(zero.params());
  });
}

TEST(ZeroRedundancyOptimizer, AddedParamGroupIsPartitionedAndTrained) {
  run_ranks(2, [](int rank, int world_size) {
    init();
    auto model = make_model(100);
    ZeroRedundancyOptimizer zero(model->first->parameters(), "sgd",
                                 {{"lr", 0.1}, {"momentum", 0.9}});
    const auto before = zero.partition();
    zero.add_param_group(optim::ParamGroup(model->second->parameters(), {{"lr", 0.05}}));
    // Parameters already there keep their rank.
    for (int r = 0; r < world_size; ++r) {
      for (int64_t i : before[r]) {
        EXPECT_NE(std::find(zero.partition()[r].begin(), zero.partition()[r].end(), i),
                  zero.partition()[r].end());
      }
    }
    EXPECT_EQ(zero.partition(), zero_partition({{96, 16}, {64, 4}}, world_size));
    auto expected = make_model(100);
    auto sgd =
        optim::create_optimizer("sgd",
                                {optim::ParamGroup(expected->first->parameters()),
                                 optim::ParamGroup(expected->second->parameters(), {{"lr", 0.05}})},
                                {{"lr", 0.1}, {"momentum", 0.9}});
    for (int iteration = 0; iteration < 3; ++iteration) {
      std::vector<at::Tensor> gradients;
      for (const auto& p : zero.params()) gradients.push_back(torch::full_like(p, 0.5 + iteration));
      zero.step(gradients);
      sgd->step(gradients);
    }
    (void)rank;
    expect_params_close(zero.params(), sgd->params(), "after 3 steps");
    expect_replicas_identical(zero.params());
  });
}

std::string checkpoint_path(const std::string& name) {
  return ::testing::TempDir() + "/distoptim_zero_" + name;
}

// Saved under one stage, resumed under the other: the state dict does not depend on it.
class ZeroCheckpoint : public ::testing::TestWithParam<int> {};

TEST_P(ZeroCheckpoint, ConsolidatedStateEqualsOneProcessAndLoadsUnderAnotherWorldSize) {
  const int stage = GetParam();
  const int resumed_stage = 3 - stage;
  const std::string suffix = "_stage" + std::to_string(stage);
  const std::string optimizer_file = checkpoint_path("optimizer" + suffix + ".pt");
  const std::string model_file = checkpoint_path("model" + suffix + ".pt");
  // Three ranks train 4 iterations; rank 1 gathers the state and saves it with the model.
  run_ranks(3, [&](int rank, int world_size) {
    init();
    auto model = make_model(stage == 1 ? 100 + rank : 100);
    std::optional<DistributedDataParallel<Net>> ddp;
    if (stage == 1) ddp.emplace(model);
    ZeroRedundancyOptimizer zero(param_groups(model), "adam", kAdamDefaults,
                                 ZeroRedundancyOptimizerOptions().stage(stage));
    SingleProcessRun reference;
    for (int iteration = 0; iteration < 4; ++iteration) {
      ddp_zero_iteration(ddp ? &*ddp : nullptr, model, zero, iteration, rank, world_size);
      reference.train(iteration, world_size);
    }
    zero.consolidate_state_dict(/*to=*/1);
    if (rank != 1) {
      expect_error_containing(
          [&] { zero.state_dict(); },
          {"not been consolidated on rank " + std::to_string(rank), "consolidate_state_dict"});
      return;
    }
    expect_state_dicts_close(zero.state_dict(), reference.state_dict());
    optim::save_state_dict(zero.state_dict(), optimizer_file);
    torch::save(model, model_file);
  });
  // Two ranks resume from it: their shards differ from the three ranks' ones.
  run_ranks(2, [&](int rank, int world_size) {
    init();
    auto model = make_model(100 + rank);
    torch::load(model, model_file);
    std::optional<DistributedDataParallel<Net>> ddp;
    if (resumed_stage == 1) ddp.emplace(model);
    ZeroRedundancyOptimizer zero(param_groups(model), "adam", kAdamDefaults,
                                 ZeroRedundancyOptimizerOptions().stage(resumed_stage));
    zero.load_state_dict(optim::load_state_dict_file(optimizer_file));
    SingleProcessRun reference;
    for (int iteration = 0; iteration < 4; ++iteration) reference.train(iteration, 3);
    for (int iteration = 4; iteration < 8; ++iteration) {
      ddp_zero_iteration(ddp ? &*ddp : nullptr, model, zero, iteration, rank, world_size);
      reference.train(iteration, world_size);
    }
    expect_params_close(zero.params(), reference.params(), "4 iterations after resuming");
    zero.consolidate_state_dict(0);
    if (rank == 0) expect_state_dicts_close(zero.state_dict(), reference.state_dict());
  });
  // Rank processes run the rest of the test body too: only the test process cleans up.
  if (!distoptim::testing::in_rank_process()) {
    std::remove(optimizer_file.c_str());
    std::remove(model_file.c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(Stage, ZeroCheckpoint, ::testing::Values(1, 2));

TEST(ZeroRedundancyOptimizer, ABadStateDictFailsOnEveryRankAndChangesNothing) {
  run_ranks(2, [](int rank, int world_size) {
    init();
    auto model = make_model(100);
    ZeroRedundancyOptimizer zero(param_groups(model), "adam", kAdamDefaults);
    for (int iteration = 0; iteration < 2; ++iteration) {
      ddp_zero_iteration(nullptr, model, zero, iteration, rank, world_size);
    }
    zero.consolidate_state_dict(0);
    // Every rank builds the same dicts, from rank 0's consolidated state.
    std::vector<at::Tensor> bytes;
    optim::OptimizerStateDict good;
    if (rank == 0) good = zero.state_dict();
    {
      const auto pickled = torch::pickle_save(good.to_ivalue());
      std::vector<at::Tensor> size = {torch::full({1}, static_cast<int64_t>(pickled.size()))};
      comm::world().process_group()->broadcast(size)->wait();
      std::vector<at::Tensor> payload = {torch::empty({size[0].item<int64_t>()}, torch::kByte)};
      if (rank == 0) std::memcpy(payload[0].data_ptr(), pickled.data(), pickled.size());
      comm::world().process_group()->broadcast(payload)->wait();
      const char* data = static_cast<const char*>(payload[0].data_ptr());
      good = optim::OptimizerStateDict::from_ivalue(
          torch::pickle_load(std::vector<char>(data, data + payload[0].numel())));
    }
    const auto local_before = zero.local_optimizer().state_dict();

    // Parameter 0 belongs to rank 0 alone; rank 1 must refuse the dict all the same.
    auto wrong_shape = good;
    wrong_shape.state[0].buffers["exp_avg"] = torch::zeros({3}, torch::kFloat64);
    expect_error_containing([&] { zero.load_state_dict(wrong_shape); },
                            {"load_state_dict", "exp_avg", "parameter 0", "shape"});
    auto wrong_groups = good;
    wrong_groups.param_groups.pop_back();
    expect_error_containing([&] { zero.load_state_dict(wrong_groups); },
                            {"load_state_dict", "1 param groups", "2"});
    auto wrong_optimizer = good;
    wrong_optimizer.optimizer = "sgd";
    expect_error_containing([&] { zero.load_state_dict(wrong_optimizer); },
                            {"load_state_dict", "'sgd'", "'adam'"});
    auto out_of_range = good;
    out_of_range.state[7] = good.state.begin()->second;
    expect_error_containing([&] { zero.load_state_dict(out_of_range); },
                            {"load_state_dict", "parameter 7", "has 4"});
    expect_state_dicts_close(zero.local_optimizer().state_dict(), local_before);
  });
}

// Three ranks train 2 iterations and rank 0 saves the consolidated state; every rank takes its
// own copy of the file (its checkpoint), then all train a third iteration, so loading the copy
// takes the state back and a refused load is seen to change nothing.
struct Checkpointed {
  Net model = make_model(100);
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
  optim::OptimizerStateDict saved;  // as read back from this rank's copy
  std::string file;                 // this rank's copy
};

std::string rank_copy(const std::string& name, int rank) {
  return checkpoint_path(name + ".rank" + std::to_string(rank));
}

std::unique_ptr<Checkpointed> train_and_checkpoint(const std::string& name, int rank,
                                                   int world_size) {
  init();
  auto c = std::make_unique<Checkpointed>();
  c->zero =
      std::make_unique<ZeroRedundancyOptimizer>(param_groups(c->model), "adam", kAdamDefaults);
  for (int iteration = 0; iteration < 2; ++iteration) {
    ddp_zero_iteration(nullptr, c->model, *c->zero, iteration, rank, world_size);
  }
  c->zero->consolidate_state_dict(0);
  if (rank == 0) optim::save_state_dict(c->zero->state_dict(), checkpoint_path(name));
  comm::world().barrier();
  c->file = rank_copy(name, rank);
  std::filesystem::copy_file(checkpoint_path(name), c->file,
                             std::filesystem::copy_options::overwrite_existing);
  c->saved = optim::load_state_dict_file(c->file);
  ddp_zero_iteration(nullptr, c->model, *c->zero, 2, rank, world_size);
  return c;
}

void remove_checkpoints(const std::string& name, int world_size) {
  if (distoptim::testing::in_rank_process()) return;
  std::remove(checkpoint_path(name).c_str());
  for (int r = 0; r < world_size; ++r) std::remove(rank_copy(name, r).c_str());
}

// The message of the c10::ValueError `fn` throws; empty when it throws nothing.
template <class Fn>
std::string value_error_of(Fn&& fn) {
  try {
    fn();
  } catch (const c10::ValueError& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// Every rank's `text` must equal rank 0's. Collective.
void expect_same_on_every_rank(const std::string& text) {
  constexpr int64_t kBytes = 8192;
  ASSERT_LT(static_cast<int64_t>(text.size()), kBytes);
  auto mine = torch::zeros({kBytes}, torch::kByte);
  std::memcpy(mine.data_ptr(), text.data(), text.size());
  std::vector<std::vector<at::Tensor>> all(1);
  for (int r = 0; r < comm::get_world_size(); ++r) all[0].push_back(torch::empty_like(mine));
  std::vector<at::Tensor> input = {mine};
  comm::world().process_group()->allgather(all, input)->wait();
  EXPECT_TRUE(at::equal(all[0][0], mine))
      << "rank " << comm::get_rank() << " threw another error than rank 0: " << text;
}

// A refused load: every rank throws the same c10::ValueError with `parts`, and its state is
// exactly what it was.
template <class Fn>
void expect_refused_everywhere(ZeroRedundancyOptimizer& zero, Fn&& load,
                               const std::vector<std::string>& parts) {
  const auto before = zero.local_optimizer().state_dict();
  const std::string message = value_error_of(load);
  EXPECT_FALSE(message.empty()) << "rank " << comm::get_rank() << " loaded the state dict";
  for (const auto& part : parts) {
    EXPECT_NE(message.find(part), std::string::npos)
        << "message lacks '" << part << "': " << message;
  }
  expect_same_on_every_rank(message);
  expect_state_dicts_close(zero.local_optimizer().state_dict(), before, /*exact=*/true);
}

TEST(ZeroLoadStateDict, IdenticalCopiesLoadOnEveryRankExactly) {
  run_ranks(3, [](int rank, int world_size) {
    auto c = train_and_checkpoint("identical.pt", rank, world_size);
    c->zero->load_state_dict_from_file(c->file);
    c->zero->consolidate_state_dict(0);
    if (rank == 0) expect_state_dicts_close(c->zero->state_dict(), c->saved, /*exact=*/true);

    // The digest covers values, not memory layout: rank 2's copy of a buffer is a transposed
    // view with the same elements.
    ddp_zero_iteration(nullptr, c->model, *c->zero, 3, rank, world_size);
    auto dict = c->saved;
    if (rank == 2) {
      auto& exp_avg = dict.state.at(0).buffers.at("exp_avg");
      exp_avg = exp_avg.t().contiguous().t();
      ASSERT_FALSE(exp_avg.is_contiguous());
    }
    c->zero->load_state_dict(dict);
    c->zero->consolidate_state_dict(0);
    if (rank == 0) expect_state_dicts_close(c->zero->state_dict(), c->saved, /*exact=*/true);
  });
  remove_checkpoints("identical.pt", 3);
}

TEST(ZeroLoadStateDict, ADifferentCopyOnOneRankIsRefusedOnEveryRank) {
  run_ranks(3, [](int rank, int world_size) {
    auto c = train_and_checkpoint("different.pt", rank, world_size);
    auto dict = c->saved;
    // Rank 2 holds an older file, say: one of the buffers it owns differs.
    if (rank == 2) dict.state.at(2).buffers.at("exp_avg_sq").add_(1e-3);
    expect_refused_everywhere(
        *c->zero, [&] { c->zero->load_state_dict(dict); },
        {"ZeroRedundancyOptimizer.load_state_dict: ranks disagree on the "
         "state dict: rank 2 differs from rank 0 (SHA-256 ",
         " on rank 2, ", " on ranks 0, 1)", "nothing was loaded on any rank"});
  });
  remove_checkpoints("different.pt", 3);
}

TEST(ZeroLoadStateDict, ATruncatedFileOnOneRankIsRefusedOnEveryRank) {
  run_ranks(3, [](int rank, int world_size) {
    auto c = train_and_checkpoint("truncated.pt", rank, world_size);
    if (rank == 2) {
      std::filesystem::resize_file(c->file, std::filesystem::file_size(c->file) / 2);
    }
    expect_refused_everywhere(
        *c->zero, [&] { c->zero->load_state_dict_from_file(c->file); },
        {"ZeroRedundancyOptimizer.load_state_dict: rank 2 cannot load the state dict: reading '" +
             rank_copy("truncated.pt", 2) + "' failed: ",
         "zip archive", "; nothing was loaded on any rank"});
    // A file that is no state dict at all.
    if (rank == 2) {
      std::ofstream(c->file, std::ios::binary | std::ios::trunc) << "not a checkpoint";
    }
    expect_refused_everywhere(*c->zero, [&] { c->zero->load_state_dict_from_file(c->file); },
                              {"rank 2 cannot load the state dict: reading '" +
                               rank_copy("truncated.pt", 2) + "' failed: "});
  });
  remove_checkpoints("truncated.pt", 3);
}

TEST(ZeroLoadStateDict, AWrongShapeOnOneRankIsRefusedOnEveryRank) {
  run_ranks(3, [](int rank, int world_size) {
    auto c = train_and_checkpoint("shape.pt", rank, world_size);
    auto dict = c->saved;
    if (rank == 2) dict.state.at(1).buffers["exp_avg"] = torch::zeros({6}, torch::kFloat64);
    expect_refused_everywhere(*c->zero, [&] { c->zero->load_state_dict(dict); },
                              {"ZeroRedundancyOptimizer.load_state_dict: rank 2 cannot load the "
                               "state dict: state 'exp_avg' of parameter 1 has shape [6], the "
                               "parameter [16]; nothing was loaded on any rank"});
  });
  remove_checkpoints("shape.pt", 3);
}

TEST(ZeroRedundancyOptimizer, BadInputIsRejectedNamingTheArgument) {
  run_ranks(2, [](int rank, int) {
    init();
    auto weight = torch::randn({4, 3}, torch::kFloat64);
    expect_error_containing(
        [&] { ZeroRedundancyOptimizer({torch::zeros({3}, torch::kLong)}, "adam"); },
        {"parameter 0", "Long", "floating point", "rank " + std::to_string(rank)});
    expect_error_containing(
        [&] {
          ZeroRedundancyOptimizer({weight, weight}, "adam");
        },
        {"parameter 1", "appears more than once"});
    expect_error_containing([&] { ZeroRedundancyOptimizer({torch::eye(3).to_sparse()}, "adam"); },
                            {"parameter 0", "sparse"});
    // No accelerator here: the meta device stands for any non-CPU one.
    expect_error_containing(
        [&] {
          ZeroRedundancyOptimizer({torch::empty({3}, torch::TensorOptions().device(at::kMeta))},
                                  "adam");
        },
        {"parameter 0", "meta", "only CPU parameters"});
    expect_error_containing([&] { ZeroRedundancyOptimizer({weight}, "no_such_optimizer"); },
                            {"no_such_optimizer"});
    expect_error_containing(
        [&] {
          ZeroRedundancyOptimizer({weight}, "adam", {{"lr", -1.0}});
        },
        {"lr", "-1"});
    // Parameters that differ across ranks: every rank gets the error, naming rank 1.
    auto mismatched = torch::randn({4, rank == 0 ? 3 : 5}, torch::kFloat64);
    expect_error_containing([&] { ZeroRedundancyOptimizer({mismatched}, "adam"); },
                            {"rank 1", "parameter 0"});

    expect_error_containing(
        [&] {
          ZeroRedundancyOptimizer({weight}, "adam", {}, ZeroRedundancyOptimizerOptions().stage(3));
        },
        {"stage = 3", "must be 1", "or 2"});
    expect_error_containing(
        [&] {
          ZeroRedundancyOptimizer({weight}, "adam", {},
                                  ZeroRedundancyOptimizerOptions().stage(2).overlap_with_ddp(true));
        },
        {"stage = 2", "overlap_with_ddp = true"});
    {
      ZeroRedundancyOptimizer stage2({weight}, "adam", {},
                                     ZeroRedundancyOptimizerOptions().stage(2));
      expect_error_containing([&] { stage2.join_hook({}); }, {"join_hook", "stage = 2", "Join"});
    }

    ZeroRedundancyOptimizer zero({weight}, "adam");
    expect_error_containing(
        [&] {
          zero.step({weight, weight});
        },
        {"step", "2 gradients", "1 parameters"});
    expect_error_containing([&] { zero.consolidate_state_dict(2); },
                            {"consolidate_state_dict", "to = 2", "size 2"});
    expect_error_containing([&] { zero.add_param_group(optim::ParamGroup({weight})); },
                            {"add_param_group", "appears more than once"});
    // Still usable: a step with a gradient works on both ranks.
    const auto before = weight.clone();
    zero.step({torch::ones_like(weight)});
    EXPECT_FALSE(at::equal(weight, before));
    expect_replicas_identical({weight});
  });
}

TEST(ZeroRedundancyOptimizer, AStepOnOnlySomeRanksFailsAfterTheTimeout) {
  run_ranks(2, [](int rank, int) {
    init(/*timeout=*/2s);
    auto weight = torch::randn({64}, torch::kFloat64);
    auto bias = torch::randn({8}, torch::kFloat64);
    ZeroRedundancyOptimizer zero({weight, bias}, "sgd", {{"lr", 0.1}});
    const testing::AbsentRank absent(rank, 2, 1);
    if (rank == 0) {
      expect_error_containing(
          [&] {
            zero.step({torch::ones_like(weight), torch::ones_like(bias)});
          },
          {"ZeroRedundancyOptimizer.step", "every rank must call step()", "rank 0"});
      absent.done();
    } else {
      absent.stay_until_the_others_are_done();  // rank 1 never steps, but stays connected
    }
  });
}

// Stage 2 reduces inside backward: a rank that runs no backward pass makes the others' backward
// fail after the group's timeout, naming the reduction.
TEST(ZeroStage2, ABackwardOnOnlySomeRanksFailsAfterTheTimeout) {
  run_ranks(2, [](int rank, int) {
    init(/*timeout=*/2s);
    auto weight = torch::randn({64}, torch::dtype(torch::kFloat64).requires_grad(true));
    auto bias = torch::randn({8}, torch::dtype(torch::kFloat64).requires_grad(true));
    ZeroRedundancyOptimizer zero({weight, bias}, "sgd", {{"lr", 0.1}},
                                 ZeroRedundancyOptimizerOptions().stage(2));
    const testing::AbsentRank absent(rank, 2, 1);
    if (rank == 0) {
      expect_error_containing([&] { (weight.sum() + bias.sum()).backward(); },
                              {"stage 2", "reducing the gradients of rank",
                               "every rank must run the same backward passes"});
      absent.done();
    } else {
      absent.stay_until_the_others_are_done();  // rank 1 never runs backward, but stays connected
    }
  });
}

// A schedule written against LibTorch's interface, as a user writes one: linear warm-up of every
// group's learning rate over `steps` steps.
class LinearWarmup : public torch::optim::LRScheduler {
 public:
  LinearWarmup(torch::optim::Optimizer& optimizer, unsigned steps)
      : LRScheduler(optimizer), steps_(steps), base_(get_current_lrs()) {}

 private:
  std::vector<double> get_lrs() override {
    const double factor = std::min(1.0, (step_count_ + 1.0) / steps_);
    std::vector<double> lrs;
    for (double lr : base_) lrs.push_back(lr * factor);
    return lrs;
  }
  unsigned steps_;
  std::vector<double> base_;
};

enum class Schedule { kStepLR, kWarmup };
enum class ZeroMode { kPlain, kBucketView, kOverlap };

std::unique_ptr<torch::optim::LRScheduler> make_schedule(Schedule schedule,
                                                         torch::optim::Optimizer& optimizer) {
  if (schedule == Schedule::kStepLR) {
    return std::make_unique<torch::optim::StepLR>(optimizer, /*step_size=*/5, /*gamma=*/0.5);
  }
  return std::make_unique<LinearWarmup>(optimizer, 8);
}

class ZeroSchedule : public ::testing::TestWithParam<std::tuple<Schedule, ZeroMode>> {};

// The same model twice, each under its own DDP on the same batches: one with ZeRO, one with the
// whole optimizer on every rank (optim::FunctionalOptimizerAdapter), each driven by its own
// instance of the same LibTorch scheduler over 20 steps. The gradients are the same bits, so
// the parameters must be too.
TEST_P(ZeroSchedule, ParametersEqualAWholeOptimizerUnderTheSameSchedule) {
  const auto [schedule, mode] = GetParam();
  run_ranks(2, [schedule = schedule, mode = mode](int rank, int world_size) {
    init();
    auto sharded_model = make_model(100 + rank);
    auto whole_model = make_model(100 + rank);
    DistributedDataParallel sharded_ddp(
        sharded_model,
        DistributedDataParallelOptions().bucket_cap_mb(mode == ZeroMode::kOverlap ? 0.0005 : 25.0));
    DistributedDataParallel whole_ddp(whole_model);
    ZeroRedundancyOptimizer zero(param_groups(sharded_model), "adam", kAdamDefaults,
                                 ZeroRedundancyOptimizerOptions()
                                     .parameters_as_bucket_view(mode == ZeroMode::kBucketView)
                                     .overlap_with_ddp(mode == ZeroMode::kOverlap));
    if (mode == ZeroMode::kOverlap) sharded_ddp.register_comm_hook(hook_with_zero_step(zero));
    optim::FunctionalOptimizerAdapter whole("adam", param_groups(whole_model), kAdamDefaults);
    auto zero_schedule = make_schedule(schedule, zero);
    auto whole_schedule = make_schedule(schedule, whole);
    const double initial_lr = zero.param_groups()[1].options().get_lr();
    bool schedule_moved_the_rate = false;
    for (int iteration = 0; iteration < 20; ++iteration) {
      const Batch batch(7 + iteration, world_size);
      zero.zero_grad();
      torch::mse_loss(sharded_ddp.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
      zero.step();
      zero_schedule->step();
      schedule_moved_the_rate |= zero.param_groups()[1].options().get_lr() != initial_lr;
      whole.zero_grad();
      torch::mse_loss(whole_ddp.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
      whole.step();
      whole_schedule->step();
    }
    const auto& expected = whole.functional().params();
    ASSERT_EQ(zero.params().size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_TRUE(at::equal(zero.params()[i], expected[i])) << "parameter " << i << "\n"
                                                            << zero.params()[i] << "\nexpected\n"
                                                            << expected[i];
    }
    EXPECT_TRUE(schedule_moved_the_rate);
    ASSERT_EQ(zero.param_groups().size(), 2u);
    for (size_t g = 0; g < 2; ++g) {
      const double lr = whole.param_groups()[g].options().get_lr();
      EXPECT_EQ(zero.param_groups()[g].options().get_lr(), lr) << "group " << g;
      EXPECT_EQ(zero.local_optimizer().group_options(g).get_double("lr"), lr) << "group " << g;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(ScheduleAndMode, ZeroSchedule,
                         ::testing::Values(std::tuple{Schedule::kStepLR, ZeroMode::kPlain},
                                           std::tuple{Schedule::kWarmup, ZeroMode::kBucketView},
                                           std::tuple{Schedule::kStepLR, ZeroMode::kOverlap}));

// A LibTorch local optimizer takes the scheduled rate too.
TEST(ZeroRedundancyOptimizer, StepLROnALibTorchLocalOptimizerEqualsTheSameOptimizerWhole) {
  run_ranks(2, [](int rank, int world_size) {
    init();
    auto sharded_model = make_model(100 + rank);
    auto whole_model = make_model(100 + rank);
    DistributedDataParallel sharded_ddp(sharded_model);
    DistributedDataParallel whole_ddp(whole_model);
    ZeroRedundancyOptimizer zero(sharded_model->parameters(), [](std::vector<at::Tensor> shard) {
      return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(0.01));
    });
    torch::optim::Adam whole(whole_model->parameters(), torch::optim::AdamOptions(0.01));
    torch::optim::StepLR zero_schedule(zero, 3, 0.5);
    torch::optim::StepLR whole_schedule(whole, 3, 0.5);
    for (int iteration = 0; iteration < 8; ++iteration) {
      const Batch batch(7 + iteration, world_size);
      zero.zero_grad();
      torch::mse_loss(sharded_ddp.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
      zero.step();
      zero_schedule.step();
      whole.zero_grad();
      torch::mse_loss(whole_ddp.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
      whole.step();
      whole_schedule.step();
    }
    const auto expected = whole_model->parameters();
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_TRUE(at::equal(zero.params()[i], expected[i])) << "parameter " << i;
    }
    EXPECT_EQ(zero.group_options(0).get_double("lr"), 0.01 * 0.5 * 0.5);
    EXPECT_EQ(zero.libtorch_local_optimizer()->param_groups()[0].options().get_lr(),
              0.01 * 0.5 * 0.5);
    expect_error_containing(
        [&] {
          zero.set_group_options(0, {{"betas", std::tuple{0.8, 0.9}}});
        },
        {"set_group_options", "'betas'", "only 'lr'"});
  });
}

// LibTorch-style typed options build the optimizer their type names, with the same options as
// the registry name and a bag (a tuple option written as a braced list).
TEST(ZeroRedundancyOptimizer, TypedOptionsEqualTheRegistryNameAndABag) {
  run_ranks(2, [](int, int) {
    init();
    auto typed_model = make_model(100);
    auto named_model = make_model(100);
    ZeroRedundancyOptimizer typed(param_groups(typed_model),
                                  optim::AdamOptions(0.01).betas({0.8, 0.95}).amsgrad(true));
    ZeroRedundancyOptimizer named(
        param_groups(named_model), "adam",
        optim::OptionBag().set("lr", 0.01).set("betas", {0.8, 0.95}).set("amsgrad", true));
    EXPECT_EQ(typed.local_optimizer().name(), "adam");
    ASSERT_EQ(typed.num_param_groups(), 2u);
    for (size_t g = 0; g < 2; ++g) {
      EXPECT_EQ(typed.group_options(g), named.group_options(g)) << "group " << g;
    }
    EXPECT_EQ(typed.group_options(1).get_pair("betas"), std::make_tuple(0.8, 0.95));
    ZeroRedundancyOptimizer sgd(typed_model->parameters(), optim::SGDOptions(0.1).momentum(0.9));
    EXPECT_EQ(sgd.local_optimizer().name(), "sgd");
    EXPECT_EQ(sgd.group_options(0).get_double("momentum"), 0.9);
  });
}

// Options are checked where they are set, compared across the ranks at each step (a rank that
// differs, or holds a value the optimizer refuses, makes every rank refuse the step before
// anything moves), and travel in checkpoints.
TEST(ZeroRedundancyOptimizer, GroupOptionsAreCheckedAgreedAcrossRanksAndCheckpointed) {
  const std::string file = checkpoint_path("options.pt");
  run_ranks(2, [&](int rank, int) {
    init();
    auto model = make_model(100);
    ZeroRedundancyOptimizer zero(param_groups(model), "adam", kAdamDefaults);
    const optim::OptionBag initial = zero.group_options(0);
    EXPECT_EQ(initial, zero.local_optimizer().group_options(0));
    EXPECT_EQ(initial.get_double("lr"), 0.01);
    EXPECT_EQ(zero.num_param_groups(), 2u);

    expect_error_containing(
        [&] {
          zero.set_group_options(2, {{"lr", 0.1}});
        },
        {"set_group_options", "param group 2 out of range (2 groups)"});
    expect_error_containing(
        [&] {
          zero.set_group_options(0, {{"lr", -1.0}});
        },
        {"set_group_options(0", "lr", "nothing changed"});
    expect_error_containing(
        [&] {
          zero.set_group_options(0, {{"momentum", 0.9}});
        },
        {"set_group_options(0", "momentum"});
    EXPECT_EQ(zero.group_options(0), initial);

    auto steps_are_refused = [&](const std::vector<std::string>& parts) {
      std::vector<at::Tensor> before;
      for (const auto& p : zero.params()) before.push_back(p.detach().clone());
      std::vector<at::Tensor> gradients;
      for (const auto& p : zero.params()) gradients.push_back(torch::ones_like(p));
      expect_error_containing([&] { zero.step(gradients); }, parts);
      for (size_t i = 0; i < before.size(); ++i) {
        EXPECT_TRUE(at::equal(zero.params()[i], before[i])) << "parameter " << i << " moved";
      }
      EXPECT_EQ(zero.local_optimizer().group_options(1).get_double("lr"), 0.02);
    };
    // Rank 1 alone changes a rate.
    if (rank == 1) zero.param_groups()[1].options().set_lr(0.5);
    steps_are_refused({"ZeroRedundancyOptimizer.step", "ranks hold different param group options",
                       "rank 1 differs", "no rank changed anything"});
    // Both hold it now, but rank 0 holds a rate Adam refuses (set through LibTorch's interface,
    // which checks nothing).
    zero.param_groups()[1].options().set_lr(0.5);
    if (rank == 0) zero.param_groups()[0].options().set_lr(-1.0);
    steps_are_refused({"ZeroRedundancyOptimizer.step",
                       "rank 0 cannot apply its param group "
                       "options",
                       "lr", "no rank changed anything"});
    if (rank == 0) zero.param_groups()[0].options().set_lr(0.01);
    std::vector<at::Tensor> gradients;
    for (const auto& p : zero.params()) gradients.push_back(torch::ones_like(p));
    zero.step(gradients);
    EXPECT_EQ(zero.local_optimizer().group_options(1).get_double("lr"), 0.5);

    // A change made since the last step is in the consolidated dict, and a load restores it.
    zero.set_group_options(0, {{"lr", 0.003}});
    zero.consolidate_state_dict(0);
    if (rank == 0) {
      EXPECT_EQ(zero.state_dict().param_groups[0].overrides.get_double("lr"), 0.003);
      EXPECT_EQ(zero.state_dict().param_groups[1].overrides.get_double("lr"), 0.5);
      optim::save_state_dict(zero.state_dict(), file);
    }
    comm::world().barrier();
    auto fresh_model = make_model(100);
    ZeroRedundancyOptimizer restored(param_groups(fresh_model), "adam", kAdamDefaults);
    restored.load_state_dict_from_file(file);
    EXPECT_EQ(restored.param_groups()[0].options().get_lr(), 0.003);
    EXPECT_EQ(restored.group_options(1).get_double("lr"), 0.5);

    // torch::save / torch::load carry the same dict (and so the options).
    const std::string archive_file = file + ".archive";
    if (rank == 0) torch::save(zero, archive_file);
    comm::world().barrier();
    auto third_model = make_model(100);
    ZeroRedundancyOptimizer loaded(param_groups(third_model), "adam", kAdamDefaults);
    torch::load(loaded, archive_file);
    EXPECT_EQ(loaded.group_options(0).get_double("lr"), 0.003);
    loaded.consolidate_state_dict(0);
    if (rank == 0) {
      expect_state_dicts_close(loaded.state_dict(), zero.state_dict(), /*exact=*/true);
    } else {
      expect_error_containing([&] { torch::save(zero, archive_file + ".1"); },
                              {"has not been consolidated on rank 1"});
    }
    comm::world().barrier();
    if (rank == 0) std::remove(archive_file.c_str());
  });
  std::remove(file.c_str());
}

}  // namespace zero_redundancy_optimizer_test
}  // namespace data_parallel
}  // namespace distoptim
