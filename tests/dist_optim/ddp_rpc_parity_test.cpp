// PyTorch's tutorial "Combining Distributed DataParallel with Distributed RPC Framework"
// (examples/ddp_rpc's model) against PyTorch 1.13 itself: tests/dist_optim/reference/
// ddp_rpc_reference.py runs the tutorial's model and loop with PyTorch's DDP (Gloo), RPC
// (TensorPipe), distributed autograd and DistributedOptimizer in 3 processes on loopback, from
// seeded parameters and batches it writes to files; the same run here (a parameter server and 2
// trainers, float64) must give the same loss at every step on each trainer and the same
// parameters at the end, to rounding.

#include <filesystem>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>

#include <distoptim/comm.h>
#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/rpc.h>

#include "ddp_rpc_model.h"
#include "harness/multiprocess.h"
#include "harness/reference_run.h"
#include "harness/rpc_workers.h"
#include "support/tensor_files.h"

namespace distoptim {
namespace ddp_rpc_parity_test {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using distoptim::testing::load_tensor_list;

// Keep in sync with the reference script's constants.
constexpr int kTrainers = 2;
constexpr int kSteps = 5;
constexpr double kLr = 0.05;
constexpr const char* kScript =
    DISTOPTIM_SOURCE_DIR "/tests/dist_optim/reference/ddp_rpc_reference.py";
constexpr const char* kDirVariable = "DISTOPTIM_DDP_RPC_REFERENCE_DIR";
// float64: the runs differ only in rounding (the order in which the two trainers' SGD steps
// reach the shared embedding, and the order of a few sums).
constexpr double kRtol = 1e-12;
constexpr double kAtol = 1e-12;

void expect_close(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(at::allclose(actual, expected, kRtol, kAtol))
      << what << ": max |difference| " << (actual - expected).abs().max().item<double>()
      << "\nours:\n"
      << actual << "\nPyTorch's:\n"
      << expected;
}

// Runs the reference once per run of the test program, in the test process.
class DdpRpcParityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (testing::in_rank_process()) return;
    const auto result = testing::run_reference(DISTOPTIM_REFERENCE_PYTHON, kScript, kDirVariable);
    ASSERT_TRUE(result.ok) << "the reference failed: " << result.output;
  }
  static void TearDownTestSuite() { testing::remove_reference(kDirVariable); }
};

TEST_F(DdpRpcParityTest, LossesAndParametersMatchPyTorchs) {
  testing::RunRanksOptions options;
  options.deadline = 120s;
  testing::run_ranks(
      kTrainers + 1,
      [](int rank, int world_size) {
        const fs::path ref = testing::reference_dir(kDirVariable);
        const std::vector<at::Tensor> init = load_tensor_list(ref / "init.pt");
        comm::init_process_group(comm::ProcessGroupOptions("env://").timeout(60s));
        const comm::Group trainers = comm::new_group({1, 2});
        if (rank == 0) ddp_rpc::serve_embedding(init.at(0));
        rpc::init_rpc(rank == 0 ? "ps" : "trainer" + std::to_string(rank), rank, world_size,
                      testing::test_options(60s));
        if (rank > 0) {
          torch::nn::Linear fc(ddp_rpc::kEmbeddingDim, ddp_rpc::kOutFeatures);
          fc->to(at::kDouble);
          {
            at::NoGradGuard no_grad;
            fc->weight.copy_(init.at(1));
            fc->bias.copy_(init.at(2));
          }
          ddp_rpc::HybridModel model(
              "ps", fc, data_parallel::DistributedDataParallelOptions().process_group(trainers));
          dist_optim::DistributedOptimizer optimizer("sgd", model.parameter_rrefs(),
                                                     optim::OptionBag().set("lr", kLr));
          const std::string me = "trainer" + std::to_string(rank);
          const auto data = load_tensor_list(ref / ("data_" + me + ".pt"));
          ASSERT_EQ(data.size(), 3u * kSteps);
          std::vector<double> losses;
          for (int step = 0; step < kSteps; ++step) {
            {
              dist_autograd::ContextGuard context;
              const at::Tensor output = model.forward(data[3 * step], data[3 * step + 1]);
              const at::Tensor loss =
                  torch::nn::functional::cross_entropy(output, data[3 * step + 2]);
              dist_autograd::backward(context.id(), {loss});
              optimizer.step(context.id());
              losses.push_back(loss.item<double>());
            }
            trainers.barrier();  // as the reference: each forward sees both trainers' steps
          }
          const auto result = load_tensor_list(ref / ("result_" + me + ".pt"));
          expect_close(at::tensor(losses, at::kDouble), result.at(0), me + "'s losses");
          expect_close(fc->weight, result.at(1), me + "'s Linear weight");
          expect_close(fc->bias, result.at(2), me + "'s Linear bias");
        }
        rpc::shutdown();  // the server waits here until both trainers are done
        if (rank == 0) {
          const auto result = load_tensor_list(ref / "result_ps.pt");
          // Not vacuous: the steps moved it.
          EXPECT_FALSE(at::allclose(result.at(0), result.at(1), kRtol, kAtol));
          expect_close(ddp_rpc::served_embedding_weight(), result.at(0), "the server's embedding");
        }
        comm::destroy_process_group();
      },
      options);
}

}  // namespace ddp_rpc_parity_test
}  // namespace distoptim
