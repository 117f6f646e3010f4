// torch::save(zero, path) read by Python: a ZeroRedundancyOptimizer over Adam on 2 ranks (two
// param groups, float64 and float32 parameters, amsgrad's extra buffer, a tuple option) trains
// a few steps, rank 0 consolidates the state and saves it with torch::save, and PyTorch 1.13's
// torch.load reads the archive (tests/optim/reference/read_archive.py). Every state tensor,
// step, option and param group Python read must equal what rank 0 saved, bit for bit.

#include <filesystem>
#include <string>

#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/serialize.h>

#include <distoptim/comm.h>
#include <distoptim/data_parallel.h>
#include <distoptim/optim.h>

#include "harness/multiprocess.h"
#include "support/python_archive.h"
#include "support/state_dicts.h"

namespace distoptim {
namespace data_parallel {
namespace zero_archive_python_test {

using namespace std::chrono_literals;

TEST(ZeroArchiveInPython, TorchLoadReadsEveryStateTensorAndOption) {
  const std::string archive = ::testing::TempDir() + "/distoptim_zero_archive_python.pt";
  testing::RunRanksOptions options;
  options.deadline = 150s;  // rank 0 also runs Python, which starts PyTorch
  testing::run_ranks(
      2,
      [&](int rank, int world_size) {
        comm::init_process_group(comm::ProcessGroupOptions("env://").timeout(30s));
        torch::manual_seed(5);
        torch::nn::Linear first(6, 5), second(5, 3);
        first->to(torch::kFloat64);
        ZeroRedundancyOptimizer zero(
            {optim::ParamGroup(first->parameters()),
             optim::ParamGroup(second->parameters(),
                               optim::OptionBag().set("lr", 0.02).set("betas", {0.8, 0.95}))},
            "adam", optim::OptionBag().set("lr", 0.01).set("amsgrad", true));
        for (int step = 0; step < 3; ++step) {
          torch::manual_seed(100 * step + rank);
          zero.zero_grad();
          const at::Tensor hidden = torch::tanh(first->forward(torch::randn({4, 6}, at::kDouble)));
          torch::nn::functional::mse_loss(second->forward(hidden.to(at::kFloat)),
                                          torch::randn({4, 3}))
              .backward();
          zero.step();
        }
        zero.consolidate_state_dict(/*to=*/0);
        if (rank != 0) return;
        torch::save(zero, archive);
        const optim::OptimizerStateDict saved = zero.state_dict();
        ASSERT_EQ(saved.state.size(), 4u) << "every parameter has state";
        ASSERT_EQ(world_size, 2);
        const c10::IValue read = testing::read_archive_in_python(
            archive, optim::FunctionalOptimizerAdapter::kArchiveKey);
        ASSERT_FALSE(read.isNone());
        testing::expect_state_dicts_close(optim::OptimizerStateDict::from_ivalue(read), saved,
                                          /*exact=*/true);
      },
      options);
  if (!testing::in_rank_process()) std::filesystem::remove(archive);
}

}  // namespace zero_archive_python_test
}  // namespace data_parallel
}  // namespace distoptim
