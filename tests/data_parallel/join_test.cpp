// Join: ranks given different numbers of batches all finish, and the result equals one process
// applying, at each iteration, the gradients of the ranks that still had a batch.

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <distoptim/comm.h>
#include <distoptim/data_parallel.h>
#include <distoptim/optim.h>

#include "global_batch.h"
#include "harness/absent_rank.h"
#include "harness/multiprocess.h"
#include "support/test_util.h"

namespace distoptim {
namespace data_parallel {
namespace join_test {

using distoptim::testing::expect_error_containing;
using distoptim::testing::run_ranks;
using namespace std::chrono_literals;

constexpr double kLr = 0.1;

void init(std::chrono::milliseconds timeout = 30s) {
  comm::init_process_group(comm::ProcessGroupOptions("env://").timeout(timeout));
}

torch::nn::Sequential make_model(int64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential model(torch::nn::Linear(6, 8), torch::nn::Tanh(), torch::nn::Linear(8, 4));
  model->to(torch::kFloat64);
  return model;
}

at::Tensor local_loss(torch::nn::Sequential& model, const Batch& batch, int rank) {
  return torch::mse_loss(model->forward(batch.local_x(rank)), batch.local_y(rank));
}

// What the ranks must end with: at iteration t, the gradients of the ranks with more than t
// batches, summed and divided by the world size (or by their number), applied by `optimizer`
// (a registry name with its options) in one process.
std::vector<at::Tensor> expected_params(const std::vector<int>& batches, bool divide_by_world,
                                        const std::string& optimizer,
                                        const optim::OptionBag& options) {
  const int world = static_cast<int>(batches.size());
  auto model = make_model(100);
  auto step = optim::create_optimizer(optimizer, {optim::ParamGroup(model->parameters())}, options);
  for (int t = 0; t < *std::max_element(batches.begin(), batches.end()); ++t) {
    const Batch batch(7 + t, world);
    model->zero_grad();
    int training = 0;
    for (int r = 0; r < world; ++r) {
      if (batches[r] <= t) continue;
      local_loss(model, batch, r).backward();  // gradients accumulate over the ranks
      ++training;
    }
    std::vector<at::Tensor> gradients;
    for (const auto& p : model->parameters()) {
      gradients.push_back(p.grad() / (divide_by_world ? world : training));
    }
    step->step(gradients);
  }
  return model->parameters();
}

void expect_params_close(const std::vector<at::Tensor>& params,
                         const std::vector<at::Tensor>& expected) {
  ASSERT_EQ(params.size(), expected.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(at::allclose(params[i], expected[i], 1e-10, 1e-12)) << "parameter " << i << "\n"
                                                                    << params[i] << "\nexpected\n"
                                                                    << expected[i];
  }
}

// 5, 7 and 9 batches on ranks 0, 1 and 2.
const std::vector<int> kUneven = {5, 7, 9};

class JoinDdp : public ::testing::TestWithParam<bool> {};

TEST_P(JoinDdp, UnevenInputsFinishWithTheTrainingRanksGradients) {
  const bool divide_by_world = GetParam();
  run_ranks(3, [divide_by_world](int rank, int world_size) {
    init();
    auto model = make_model(100 + rank);
    DistributedDataParallel ddp(model);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(kLr));
    {
      Join join({&ddp}, JoinOptions().hook_options(
                            JoinHookOptions().divide_by_initial_world_size(divide_by_world)));
      for (int t = 0; t < kUneven[rank]; ++t) {
        const Batch batch(7 + t, world_size);
        sgd.zero_grad();
        torch::mse_loss(ddp.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
        sgd.step();
      }
      join.join();
    }
    // The last joiner's parameters reached the ranks that stopped early.
    expect_params_close(model->parameters(),
                        expected_params(kUneven, divide_by_world, "sgd", {{"lr", kLr}}));
  });
}

INSTANTIATE_TEST_SUITE_P(DivideByInitialWorldSize, JoinDdp, ::testing::Bool());

TEST(Join, ZeroRanksThatRanOutStillUpdateTheirShare) {
  run_ranks(3, [](int rank, int world_size) {
    init();
    auto model = make_model(100 + rank);
    DistributedDataParallel ddp(model);
    const optim::OptionBag options{{"lr", kLr}, {"momentum", 0.9}};
    ZeroRedundancyOptimizer zero(model->parameters(), "sgd", options);
    {
      Join join({&ddp, &zero});  // the destructor joins
      for (int t = 0; t < kUneven[rank]; ++t) {
        const Batch batch(7 + t, world_size);
        zero.zero_grad();
        torch::mse_loss(ddp.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
        zero.step();
      }
    }
    expect_params_close(model->parameters(), expected_params(kUneven, true, "sgd", options));
  });
}

TEST(Join, ARankWithoutAnyBatch) {
  run_ranks(2, [](int rank, int world_size) {
    init();
    const std::vector<int> batches = {0, 3};
    auto model = make_model(100 + rank);
    DistributedDataParallel ddp(model);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(kLr));
    Join join({&ddp});
    for (int t = 0; t < batches[rank]; ++t) {
      const Batch batch(7 + t, world_size);
      sgd.zero_grad();
      torch::mse_loss(ddp.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
      sgd.step();
    }
    join.join();
    expect_params_close(model->parameters(), expected_params(batches, true, "sgd", {{"lr", kLr}}));
  });
}

TEST(Join, ThrowOnEarlyTerminationStopsEveryRank) {
  run_ranks(3, [](int rank, int world_size) {
    init();
    auto model = make_model(100 + rank);
    DistributedDataParallel ddp(model);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(kLr));
    int iterations = 0;
    expect_error_containing(
        [&] {
          Join join({&ddp}, JoinOptions().throw_on_early_termination(true));
          for (int t = 0; t < kUneven[rank]; ++t) {
            const Batch batch(7 + t, world_size);
            sgd.zero_grad();
            torch::mse_loss(ddp.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
            sgd.step();
            ++iterations;
          }
          join.join();
        },
        {"exhausted its inputs"});
    // Everyone stopped when rank 0 ran out.
    EXPECT_EQ(iterations, kUneven[0]);
  });
}

TEST(Join, DisabledBehavesAsPlainDdp) {
  run_ranks(2, [](int rank, int world_size) {
    init();
    const std::vector<int> batches = {3, 3};
    auto model = make_model(100 + rank);
    DistributedDataParallel ddp(model);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(kLr));
    Join join({&ddp}, JoinOptions().enable(false));
    for (int t = 0; t < batches[rank]; ++t) {
      const Batch batch(7 + t, world_size);
      sgd.zero_grad();
      torch::mse_loss(ddp.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
      sgd.step();
    }
    join.join();
    expect_params_close(model->parameters(), expected_params(batches, true, "sgd", {{"lr", kLr}}));
  });
}

TEST(Join, BadArgumentsAreRefused) {
  run_ranks(2, [](int rank, int) {
    init();
    auto model = make_model(100 + rank);
    DistributedDataParallel ddp(model);
    expect_error_containing([] { Join join({}); }, {"no Joinable"});
    expect_error_containing([] { Join join({nullptr}); }, {"joinable 0 is null"});
    DistributedDataParallel unused(make_model(100 + rank),
                                   DistributedDataParallelOptions().find_unused_parameters(true));
    expect_error_containing([&] { Join join({&unused}); }, {"find_unused_parameters"});
    Join outer({&ddp}, JoinOptions().enable(false));
    expect_error_containing([&] { Join inner({&ddp}); }, {"joinable 0 is already in another Join"});
  });
}

// Without Join, the rank that still has a batch does not hang: its next forward (which
// synchronizes DDP's bucket order after the first iteration) fails after the group's timeout,
// saying why, while the other rank waits, still connected.
TEST(Join, WithoutJoinUnevenInputsFailAfterTheTimeout) {
  run_ranks(2, [](int rank, int world_size) {
    init(/*timeout=*/2s);
    auto model = make_model(100 + rank);
    DistributedDataParallel ddp(model);
    const Batch first(7, world_size);
    torch::mse_loss(ddp.forward(first.local_x(rank)), first.local_y(rank)).backward();
    const testing::AbsentRank absent(rank, world_size, 0);
    if (rank == 0) {
      absent.stay_until_the_others_are_done();
      return;
    }
    const Batch second(8, world_size);
    expect_error_containing(
        [&] {
          torch::mse_loss(ddp.forward(second.local_x(rank)), second.local_y(rank)).backward();
        },
        {"DistributedDataParallel.forward", "rank 1", "for uneven inputs use Join",
         "these ranks never reached it: 0"});
    absent.done();
  });
}

// A Join left without join() joins in its destructor, which must not throw: when that join
// fails (here rank 0 never joins, so counting the ranks still training times out), the error
// comes back, with its class, at the next iteration of the Joinable, and only once.
TEST(Join, AJoinFailingInItsDestructorThrowsAtTheNextIteration) {
  run_ranks(2, [](int rank, int world_size) {
    init(/*timeout=*/2s);
    auto model = make_model(100 + rank);
    DistributedDataParallel ddp(model);
    const testing::AbsentRank absent(rank, world_size, 0);
    if (rank == 0) {
      absent.stay_until_the_others_are_done();  // never joins, but stays connected
      return;
    }
    { Join join({&ddp}); }
    const Batch batch(7, world_size);
    try {
      ddp.forward(batch.local_x(rank));
      ADD_FAILURE() << "the forward after the failed Join did not throw";
    } catch (const TimeoutError& e) {
      const std::string message = e.what();
      for (const char* part : {"Join: joining when the Join was destroyed failed",
                               "counting the ranks still training", "timed out"}) {
        EXPECT_NE(message.find(part), std::string::npos) << "lacks '" << part << "': " << message;
      }
    }
    // Thrown once: whatever the next forward does, it does not throw that error again.
    try {
      ddp.forward(batch.local_x(rank));
    } catch (const std::exception& e) {
      EXPECT_EQ(std::string(e.what()).find("Join: joining"), std::string::npos) << e.what();
    }
    absent.done();
  });
}

}  // namespace join_test
}  // namespace data_parallel
}  // namespace distoptim
