// Parity of post-local SGD with PyTorch 1.13: PyTorch's PostLocalSGDOptimizer +
// PeriodicModelAverager with the post-localSGD DDP hook, run at test time by
// tests/data_parallel/reference/post_local_sgd_reference.py under DISTOPTIM_REFERENCE_PYTHON (2
// ranks, gloo, CPU, float32), against our DistributedDataParallel + post_local_sgd_hook +
// PostLocalSGDOptimizer trained from the same initial parameters on the same batches; the
// files are exchanged through a temporary directory. After the warm-up each rank's hook subgroup
// is the rank alone, so only the averager brings the ranks together.

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <distoptim/comm.h>
#include <distoptim/data_parallel.h>
#include <distoptim/optim/torch_adapter.h>

#include "harness/command.h"
#include "harness/multiprocess.h"
#include "support/tensor_files.h"

namespace distoptim {
namespace data_parallel {
namespace post_local_sgd_parity_test {

namespace fs = std::filesystem;
using distoptim::testing::load_tensor_list;
using distoptim::testing::run_ranks;
using namespace std::chrono_literals;

constexpr int kParityWorld = 2;
constexpr int kParityIterations = 30;
constexpr int kParityWarmup = 10;
constexpr int kParityPeriod = 4;
constexpr const char* kParityScript =
    DISTOPTIM_SOURCE_DIR "/tests/data_parallel/reference/post_local_sgd_reference.py";
constexpr const char* kParityDirVariable = "DISTOPTIM_POST_LOCAL_SGD_REFERENCE_DIR";
// float32 after 30 iterations. LibTorch's SGD matches bit for bit; distoptim's fused kernels round
// differently by an ulp or two (about 1e-7 here), which the absolute part covers for elements
// near zero. Averaging at a different period differs by about 5e-3.
constexpr double kParityRtol = 1e-5;
constexpr double kParityAtol = 1e-6;

using distoptim::testing::shell_quote;

std::vector<at::Tensor> reference_params(const fs::path& dir, const std::string& optimizer,
                                         const std::string& mode, int rank) {
  return load_tensor_list(dir / (optimizer + "_" + mode + "_rank" + std::to_string(rank) + ".pt"));
}

bool all_close(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!at::allclose(a[i], b[i], kParityRtol, kParityAtol)) return false;
  }
  return true;
}

struct ParityCase {
  std::string name;
  std::string reference_optimizer;  // as the script names it
  std::function<std::shared_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)> make;
};

// NOLINTNEXTLINE(readability-identifier-naming): gtest looks it up by this name.
void PrintTo(const ParityCase& c, std::ostream* os) { *os << c.name; }

class PostLocalSGDParityTest : public ::testing::TestWithParam<ParityCase> {};

TEST_P(PostLocalSGDParityTest, MatchesPyTorchAfter30Iterations) {
  const ParityCase& c = GetParam();
  fs::path dir;
  if (!distoptim::testing::in_rank_process()) {
    char dir_template[] = "/tmp/distoptim-post-local-sgd-XXXXXX";
    ASSERT_NE(::mkdtemp(dir_template), nullptr);
    dir = dir_template;
    const std::string command = "timeout 150 " + shell_quote(DISTOPTIM_REFERENCE_PYTHON) + " " +
                                shell_quote(kParityScript) + " --out " + shell_quote(dir) +
                                " --optimizer " + c.reference_optimizer;
    const auto result = distoptim::testing::run_command(command);
    if (!result.ok) fs::remove_all(dir);
    ASSERT_TRUE(result.ok) << "the reference failed: " << result.output;
    // Not vacuous: averaging made the reference differ from plain DDP, and the local steps after
    // the last averaging (iteration 26) made the ranks differ from each other.
    for (int r = 0; r < kParityWorld; ++r) {
      EXPECT_FALSE(all_close(reference_params(dir, c.reference_optimizer, "post_local_sgd", r),
                             reference_params(dir, c.reference_optimizer, "ddp", r)))
          << "rank " << r << ": post-local SGD equals plain DDP";
    }
    EXPECT_FALSE(all_close(reference_params(dir, c.reference_optimizer, "post_local_sgd", 0),
                           reference_params(dir, c.reference_optimizer, "post_local_sgd", 1)));
    ::setenv(kParityDirVariable, dir.c_str(), 1);
  }

  run_ranks(kParityWorld, [&c](int rank, int) {
    const char* reference_dir = std::getenv(kParityDirVariable);
    ASSERT_NE(reference_dir, nullptr);
    const fs::path ref(reference_dir);
    comm::init_process_group(comm::ProcessGroupOptions("env://").timeout(30s));
    const auto init_params = load_tensor_list(ref / "init.pt");
    const auto data = load_tensor_list(ref / "data.pt");
    const at::Tensor& x = data.at(0);
    const at::Tensor& y = data.at(1);

    torch::nn::Sequential model(torch::nn::Linear(6, 16), torch::nn::Tanh(),
                                torch::nn::Linear(16, 4));
    {
      torch::NoGradGuard no_grad;
      const auto params = model->parameters();
      ASSERT_EQ(params.size(), init_params.size());
      for (size_t i = 0; i < params.size(); ++i) params[i].copy_(init_params[i]);
    }
    DistributedDataParallel ddp(model);
    // Each rank alone after the warm-up: training is local, only the averager joins the ranks.
    auto alone = comm::new_subgroups(1).first;
    ddp.register_comm_hook(post_local_sgd_hook(
        std::make_shared<PostLocalSGDState>(std::nullopt, alone, kParityWarmup)));
    PostLocalSGDOptimizer opt(c.make(model->parameters()), std::make_shared<PeriodicModelAverager>(
                                                               kParityPeriod, kParityWarmup));
    for (int iteration = 0; iteration < kParityIterations; ++iteration) {
      opt.zero_grad();
      torch::mse_loss(ddp.forward(x[iteration][rank]), y[iteration][rank]).backward();
      opt.step();
    }

    const auto expected = reference_params(ref, c.reference_optimizer, "post_local_sgd", rank);
    const auto params = model->parameters();
    ASSERT_EQ(params.size(), expected.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const double max_diff = (params[i] - expected[i]).abs().max().item<double>();
      EXPECT_TRUE(at::allclose(params[i], expected[i], kParityRtol, kParityAtol))
          << "rank " << rank << ", parameter " << i << ": max |difference| " << max_diff;
    }
    comm::destroy_process_group();
  });

  if (!distoptim::testing::in_rank_process()) {
    ::unsetenv(kParityDirVariable);
    fs::remove_all(dir);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Optimizers, PostLocalSGDParityTest,
    ::testing::Values(
        ParityCase{"LibTorchSGD", "sgd",
                   [](std::vector<at::Tensor> params) -> std::shared_ptr<torch::optim::Optimizer> {
                     return std::make_shared<torch::optim::SGD>(
                         params, torch::optim::SGDOptions(0.05).momentum(0.9));
                   }},
        ParityCase{"TorchSGD", "sgd",
                   [](std::vector<at::Tensor> params) -> std::shared_ptr<torch::optim::Optimizer> {
                     return std::make_shared<optim::TorchSGD>(
                         params, optim::SGDOptions(0.05).momentum(0.9));
                   }},
        ParityCase{"TorchAdam", "adam",
                   [](std::vector<at::Tensor> params) -> std::shared_ptr<torch::optim::Optimizer> {
                     return std::make_shared<optim::TorchAdam>(params, optim::AdamOptions(0.01));
                   }}),
    [](const ::testing::TestParamInfo<ParityCase>& info) { return info.param.name; });

}  // namespace post_local_sgd_parity_test
}  // namespace data_parallel
}  // namespace distoptim
