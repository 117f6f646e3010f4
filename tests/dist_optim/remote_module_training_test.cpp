// RemoteModule as PyTorch users train with it: a local layer and a RemoteModule on a parameter
// server, distributed autograd, one DistributedOptimizer over both (remote_parameters() and RRefs
// to the local parameters), against the same model trained in one process with LibTorch's SGD
// from the same initial values (float64). Across real processes on loopback.

#include <tuple>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/rpc.h>

#include "harness/rpc_workers.h"

namespace {

// nn::Linear in float64.
struct DoubleLinear : torch::nn::LinearImpl {
  DoubleLinear(int64_t in, int64_t out) : torch::nn::LinearImpl(in, out) { to(at::kDouble); }
};

}  // namespace

DISTOPTIM_REMOTE_MODULE(DoubleLinear, int64_t, int64_t);

namespace distoptim {
namespace {

using rpc::RemoteModule;
using rpc::RRef;

constexpr double kLr = 0.05;
constexpr int kSteps = 5;

TEST(RemoteModuleTraining, DistributedOptimizerOverARemoteModuleMatchesLocalTraining) {
  testing::with_workers(2, [] {
    auto local = DoubleLinear(4, 8);
    auto remote = std::make_shared<RemoteModule<DoubleLinear>>(testing::worker(1) + "/cpu",
                                                               std::tuple{int64_t{8}, int64_t{3}});

    // The reference: the same two layers in one process, from the same initial values.
    auto ref_local = DoubleLinear(4, 8);
    auto ref_remote = DoubleLinear(8, 3);
    std::vector<RRef<at::Tensor>> remote_params = remote->remote_parameters();
    {
      at::NoGradGuard no_grad;
      ref_local.weight.copy_(local.weight);
      ref_local.bias.copy_(local.bias);
      ref_remote.weight.copy_(remote_params[0].to_here());
      ref_remote.bias.copy_(remote_params[1].to_here());
    }
    std::vector<at::Tensor> ref_params = ref_local.parameters();
    for (const at::Tensor& p : ref_remote.parameters()) ref_params.push_back(p);
    torch::optim::SGD ref_optimizer(ref_params, torch::optim::SGDOptions(kLr));

    std::vector<RRef<at::Tensor>> params{RRef<at::Tensor>(local.weight),
                                         RRef<at::Tensor>(local.bias)};
    params.insert(params.end(), remote_params.begin(), remote_params.end());
    dist_optim::DistributedOptimizer optimizer("sgd", params, optim::OptionBag().set("lr", kLr));

    auto generator = at::detail::createCPUGenerator(7);
    for (int step = 0; step < kSteps; ++step) {
      const at::Tensor input = at::randn({6, 4}, generator, at::kDouble);
      const at::Tensor target = at::randn({6, 3}, generator, at::kDouble);
      double loss_value;
      {
        dist_autograd::ContextGuard context;
        const at::Tensor hidden = at::relu(local.forward(input));
        // Alternate the two forms of the remote forward.
        const at::Tensor out =
            step % 2 == 0 ? remote->forward(hidden) : remote->forward_async(hidden).wait();
        const at::Tensor loss = at::mse_loss(out, target);
        loss_value = loss.item<double>();
        dist_autograd::backward(context.id(), {loss});
        optimizer.step(context.id());
      }
      ref_optimizer.zero_grad();
      const at::Tensor ref_loss =
          at::mse_loss(ref_remote.forward(at::relu(ref_local.forward(input))), target);
      ref_loss.backward();
      ref_optimizer.step();
      EXPECT_NEAR(loss_value, ref_loss.item<double>(), 1e-12) << "step " << step;
    }
    EXPECT_FALSE(local.weight.grad().defined());  // gradients stayed in the contexts
    std::vector<at::Tensor> trained{local.weight, local.bias, remote_params[0].to_here(),
                                    remote_params[1].to_here()};
    for (size_t i = 0; i < trained.size(); ++i) {
      EXPECT_TRUE(at::allclose(trained[i], ref_params[i], 1e-12, 1e-12)) << "parameter " << i;
    }
  });
}

}  // namespace
}  // namespace distoptim
