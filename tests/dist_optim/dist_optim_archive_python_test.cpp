// torch::save(distributed_optimizer, path) read by Python: a DistributedOptimizer over Adam with
// parameters on two workers (two param groups, one overriding lr and betas, amsgrad's extra
// buffer) trains a few steps, the trainer saves it with torch::save, and PyTorch 1.13's
// torch.load reads the archive (tests/optim/reference/read_archive.py). Every owner's state
// tensors, steps, options and param groups, and the positions, must equal what was saved, bit
// for bit.

#include <filesystem>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/optim/torch_adapter.h>
#include <distoptim/rpc.h>

#include "harness/multiprocess.h"
#include "harness/rpc_workers.h"
#include "support/python_archive.h"
#include "support/state_dicts.h"

namespace distoptim {
namespace dist_optim {
namespace dist_optim_archive_python_test {

using namespace std::chrono_literals;
using optim::OptionBag;
using rpc::RRef;
using testing::worker;

// worker1's parameters: w (3 x 3) and b (3).
std::vector<at::Tensor>& server_params() {
  static std::vector<at::Tensor> params = [] {
    auto generator = at::detail::createCPUGenerator(41);
    return std::vector<at::Tensor>{at::randn({3, 3}, generator).requires_grad_(),
                                   at::randn({3}, generator).requires_grad_()};
  }();
  return params;
}

DISTOPTIM_RPC_FUNCTION("archive_layer", [](const at::Tensor& x) {
  return at::tanh(at::matmul(x, server_params()[0]) + server_params()[1]);
});
DISTOPTIM_RPC_FUNCTION("archive_param_rrefs", [] {
  std::vector<RRef<at::Tensor>> rrefs;
  for (const at::Tensor& p : server_params()) rrefs.emplace_back(p);
  return rrefs;
});

TEST(DistributedOptimizerArchiveInPython, TorchLoadReadsEveryOwnersState) {
  const std::string archive = ::testing::TempDir() + "/distoptim_dist_optim_archive_python.pt";
  testing::RunRanksOptions options;
  options.deadline = 150s;  // the trainer also runs Python, which starts PyTorch
  testing::run_ranks(
      2,
      [&](int rank, int world_size) {
        rpc::init_rpc(worker(rank), rank, world_size, testing::test_options(60s));
        if (rank == 0) {
          // The trainer's own parameter v (float64), in the first group with w.
          const at::Tensor v = at::linspace(0.5, 1.5, 3, at::kDouble).requires_grad_();
          const auto server =
              rpc::rpc_sync<std::vector<RRef<at::Tensor>>>(worker(1), "archive_param_rrefs");
          DistributedOptimizer optimizer(
              "adam",
              {RemoteParamGroup({server[0], RRef<at::Tensor>(v)}),
               RemoteParamGroup({server[1]},
                                OptionBag().set("lr", 0.02).set("betas", {0.8, 0.95}))},
              OptionBag().set("lr", 0.01).set("amsgrad", true));
          for (int step = 0; step < 3; ++step) {
            dist_autograd::ContextGuard context;
            const at::Tensor x = at::full({2, 3}, 0.3 * (step + 1));
            const at::Tensor h =
                rpc::rpc_sync<at::Tensor>(worker(1), "archive_layer", std::tuple{x});
            dist_autograd::backward(context.id(), {(h.to(at::kDouble) * v).pow(2).sum()});
            optimizer.step(context.id());
          }
          torch::save(optimizer, archive);
          const DistributedOptimizerStateDict saved = optimizer.state_dict();
          ASSERT_EQ(saved.owners.size(), 2u);
          const c10::IValue read = testing::read_archive_in_python(
              archive, optim::FunctionalOptimizerAdapter::kArchiveKey);
          if (!read.isNone()) {
            const DistributedOptimizerStateDict loaded =
                DistributedOptimizerStateDict::from_ivalue(read);
            EXPECT_EQ(loaded.optimizer, saved.optimizer);
            ASSERT_EQ(loaded.owners.size(), saved.owners.size());
            for (size_t o = 0; o < saved.owners.size(); ++o) {
              SCOPED_TRACE("owner " + saved.owners[o].worker);
              EXPECT_EQ(loaded.owners[o].worker, saved.owners[o].worker);
              EXPECT_EQ(loaded.owners[o].positions, saved.owners[o].positions);
              EXPECT_FALSE(saved.owners[o].state.state.empty());
              testing::expect_state_dicts_close(loaded.owners[o].state, saved.owners[o].state,
                                                /*exact=*/true);
            }
          }
        }
        rpc::shutdown();
      },
      options);
  if (!testing::in_rank_process()) std::filesystem::remove(archive);
}

}  // namespace dist_optim_archive_python_test
}  // namespace dist_optim
}  // namespace distoptim
