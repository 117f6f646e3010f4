// Parity of the DDP communication hooks with PyTorch 1.13's: each hook's averaged gradients on 2
// ranks (gloo, CPU, float32), iteration by iteration, against PyTorch's hook under PyTorch's DDP
// run at test time by tests/data_parallel/reference/comm_hooks_reference.py under
// DISTOPTIM_REFERENCE_PYTHON, from the same initial parameters on the same batches. Every step is
// -LR * grad by hand in both, so the gradients alone decide the trajectory. Every hook is
// deterministic here (PowerSGD's random Qs come from the same random_seed), so the gradients
// must be equal bit for bit.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <distoptim/comm.h>
#include <distoptim/data_parallel.h>

#include "harness/multiprocess.h"
#include "harness/reference_run.h"
#include "support/tensor_files.h"

namespace distoptim {
namespace data_parallel {
namespace comm_hooks_parity_test {

namespace fs = std::filesystem;
using distoptim::testing::load_tensor_list;
using namespace std::chrono_literals;

// Keep in sync with the reference script.
constexpr int kHooksWorld = 2;
constexpr int kHooksIterations = 6;
constexpr int kHooksIn = 6;
constexpr int kHooksHidden = 32;
constexpr int kHooksOut = 4;
constexpr double kHooksLr = 0.1;
constexpr int64_t kHooksPowerSGDStart = 2;
constexpr int64_t kHooksPowerSGDSeed = 31;
constexpr const char* kHooksScript =
    DISTOPTIM_SOURCE_DIR "/tests/data_parallel/reference/comm_hooks_reference.py";
constexpr const char* kHooksDirVariable = "DISTOPTIM_COMM_HOOKS_REFERENCE_DIR";

struct HookCase {
  std::string name;  // the reference script's case
  std::function<std::unique_ptr<c10d::CommHookInterface>()> make;
};

// NOLINTNEXTLINE(readability-identifier-naming): gtest looks it up by this name.
void PrintTo(const HookCase& c, std::ostream* os) { *os << c.name; }

PowerSGDOptions power_sgd_options(int64_t rank) {
  return PowerSGDOptions()
      .matrix_approximation_rank(rank)
      .start_power_sgd_iter(kHooksPowerSGDStart)
      .random_seed(kHooksPowerSGDSeed);
}

std::function<std::unique_ptr<c10d::CommHookInterface>()> power_sgd(PowerSGDOptions options,
                                                                    bool batched = false) {
  return [options, batched] {
    auto state = std::make_shared<PowerSGDState>(std::nullopt, options);
    return batched ? batched_power_sgd_hook(state) : power_sgd_hook(state);
  };
}

// [gradients (iterations x elements), final parameters] of `case_name` on `rank`.
std::vector<at::Tensor> reference_run(const fs::path& dir, const std::string& case_name, int rank) {
  return load_tensor_list(dir / (case_name + "_rank" + std::to_string(rank) + ".pt"));
}

class CommHookParityTest : public ::testing::TestWithParam<HookCase> {
 public:
  static void SetUpTestSuite() {
    if (distoptim::testing::in_rank_process()) return;
    const auto result = distoptim::testing::run_reference(DISTOPTIM_REFERENCE_PYTHON, kHooksScript,
                                                          kHooksDirVariable);
    ASSERT_TRUE(result.ok) << "the reference failed: " << result.output;
  }
  static void TearDownTestSuite() { distoptim::testing::remove_reference(kHooksDirVariable); }
  static fs::path reference_dir() { return distoptim::testing::reference_dir(kHooksDirVariable); }
};

TEST_P(CommHookParityTest, GradientsEqualPyTorchsEveryIteration) {
  const HookCase& c = GetParam();
  if (!distoptim::testing::in_rank_process()) {
    // Not vacuous: every hook's gradients differ from plain averaging's in PyTorch's run.
    const fs::path ref = reference_dir();
    for (int r = 0; r < kHooksWorld; ++r) {
      EXPECT_FALSE(
          at::equal(reference_run(ref, c.name, r).at(0), reference_run(ref, "allreduce", r).at(0)))
          << c.name << ", rank " << r << ": the same gradients as plain averaging";
    }
  }

  distoptim::testing::run_ranks(kHooksWorld, [&c](int rank, int) {
    at::set_num_threads(1);  // as the reference
    const fs::path ref = reference_dir();
    comm::init_process_group(comm::ProcessGroupOptions("env://").timeout(30s));
    const auto init = load_tensor_list(ref / "init.pt");
    const auto data = load_tensor_list(ref / "data.pt");
    const at::Tensor& x = data.at(0);
    const at::Tensor& y = data.at(1);
    const auto expected = reference_run(ref, c.name, rank);
    const at::Tensor& expected_gradients = expected.at(0);

    torch::nn::Sequential model(torch::nn::Linear(kHooksIn, kHooksHidden), torch::nn::Tanh(),
                                torch::nn::Linear(kHooksHidden, kHooksHidden), torch::nn::Tanh(),
                                torch::nn::Linear(kHooksHidden, kHooksHidden), torch::nn::Tanh(),
                                torch::nn::Linear(kHooksHidden, kHooksOut));
    const auto params = model->parameters();
    {
      torch::NoGradGuard no_grad;
      ASSERT_EQ(params.size(), init.size());
      for (size_t i = 0; i < params.size(); ++i) params[i].copy_(init[i]);
    }
    DistributedDataParallel ddp(model);
    ddp.register_comm_hook(c.make());
    for (int iteration = 0; iteration < kHooksIterations; ++iteration) {
      for (const auto& p : params) p.mutable_grad() = at::Tensor();
      torch::mse_loss(ddp.forward(x[iteration][rank]), y[iteration][rank]).backward();
      std::vector<at::Tensor> flat;
      for (const auto& p : params) flat.push_back(p.grad().reshape({-1}));
      const at::Tensor gradients = at::cat(flat);
      const at::Tensor& want = expected_gradients[iteration];
      ASSERT_TRUE(at::equal(gradients, want))
          << c.name << ", rank " << rank << ", iteration " << iteration
          << ": max |difference| from PyTorch's " << (gradients - want).abs().max().item<double>();
      torch::NoGradGuard no_grad;
      for (const auto& p : params) p.add_(p.grad(), -kHooksLr);
    }
    comm::destroy_process_group();
  });
}

INSTANTIATE_TEST_SUITE_P(
    Hooks, CommHookParityTest,
    ::testing::Values(
        HookCase{"noop", [] { return noop_hook(); }},
        HookCase{"bf16_compress", [] { return bf16_compress_hook(); }},
        HookCase{"fp16_compress_wrapper", [] { return fp16_compress_wrapper(allreduce_hook()); }},
        HookCase{"bf16_compress_wrapper", [] { return bf16_compress_wrapper(allreduce_hook()); }},
        HookCase{"powersgd_rank1", power_sgd(power_sgd_options(1))},
        HookCase{"powersgd_rank4_qr", power_sgd(power_sgd_options(4)
                                                    .orthogonalization_epsilon(1e-8)
                                                    .min_compression_rate(1.5))},
        HookCase{"powersgd_cold",
                 power_sgd(power_sgd_options(2).warm_start(false).use_error_feedback(false))},
        HookCase{"powersgd_batched_shapes",
                 power_sgd(power_sgd_options(1).batch_tensors_with_same_shape(true))},
        HookCase{"batched_powersgd", power_sgd(power_sgd_options(1), /*batched=*/true)},
        HookCase{"batched_powersgd_cold",
                 power_sgd(power_sgd_options(3).warm_start(false).use_error_feedback(false),
                           /*batched=*/true)}),
    [](const ::testing::TestParamInfo<HookCase>& info) { return info.param.name; });

}  // namespace comm_hooks_parity_test
}  // namespace data_parallel
}  // namespace distoptim
