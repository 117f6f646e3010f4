// RemoteModule as PyTorch users train with it: a local layer and a RemoteModule on a parameter
// server, distributed autograd, one DistributedOptimizer over both (remote_parameters() and RRefs
// to the local parameters), against the same model trained in one process with LibTorch's SGD
// from the same initial values (float64). Across real processes on loopback.

#include <tuple>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/optim/sparse_adam.h>
#include <distoptim/rpc.h>

#include "harness/rpc_workers.h"

namespace {

// nn::Linear in float64.
struct DoubleLinear : torch::nn::LinearImpl {
  DoubleLinear(int64_t in, int64_t out) : torch::nn::LinearImpl(in, out) { to(at::kDouble); }
};

// An embedding table with sparse gradients (sum of each bag's rows), float64.
struct SparseBag : torch::nn::EmbeddingBagImpl {
  SparseBag(int64_t rows, int64_t dim)
      : torch::nn::EmbeddingBagImpl(
            torch::nn::EmbeddingBagOptions(rows, dim).sparse(true).mode(torch::kSum)) {
    to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& offsets) {
    return torch::nn::EmbeddingBagImpl::forward(ids, offsets);
  }
};

}  // namespace

DISTOPTIM_REMOTE_MODULE(DoubleLinear, int64_t, int64_t);
DISTOPTIM_REMOTE_MODULE(SparseBag, int64_t, int64_t);
// On the table's owner: whether its gradient in a context is sparse, and how many entries it has.
DISTOPTIM_RPC_FUNCTION(
    "bag_gradient_nnz", [](int64_t context_id, distoptim::rpc::RRef<SparseBag> bag) -> int64_t {
      const at::Tensor grad =
          distoptim::dist_autograd::get_gradients(context_id).at(bag.local_value()->weight);
      return grad.is_sparse() ? grad._nnz() : -1;
    });

namespace distoptim {
namespace remote_module_training_test {

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

// The parameter-server pattern with a sparse embedding: the table's gradient stays sparse from
// the owner's backward through the context to SparseAdam on the owner (only the rows a batch
// touched move), the trainer's dense layer steps with SGD; against the same model trained in one
// process (LibTorch's SGD, distoptim's SparseAdam, which the optim parity tests hold to PyTorch).
TEST(RemoteModuleTraining, ASparseEmbeddingTrainsThroughContextsAndSparseAdam) {
  testing::with_workers(2, [] {
    constexpr int64_t kRows = 1000, kDim = 8, kBags = 16, kIdsPerBag = 4;
    auto bag =
        std::make_shared<RemoteModule<SparseBag>>(testing::worker(1), std::tuple{kRows, kDim});
    auto head = DoubleLinear(kDim, 1);
    std::vector<RRef<at::Tensor>> table = bag->remote_parameters();
    const at::Tensor initial = table[0].to_here();

    auto ref_bag = SparseBag(kRows, kDim);
    auto ref_head = DoubleLinear(kDim, 1);
    {
      at::NoGradGuard no_grad;
      ref_bag.weight.copy_(table[0].to_here());
      ref_head.weight.copy_(head.weight);
      ref_head.bias.copy_(head.bias);
    }
    torch::optim::SGD ref_sgd(ref_head.parameters(), torch::optim::SGDOptions(kLr));
    optim::SparseAdam ref_adam({ref_bag.weight}, optim::SparseAdamOptions(0.01));

    dist_optim::DistributedOptimizer sparse_adam("sparse_adam", table,
                                                 optim::OptionBag().set("lr", 0.01));
    dist_optim::DistributedOptimizer sgd(
        "sgd", {RRef<at::Tensor>(head.weight), RRef<at::Tensor>(head.bias)},
        optim::OptionBag().set("lr", kLr));
    auto generator = at::detail::createCPUGenerator(11);
    const at::Tensor offsets = at::arange(0, kBags * kIdsPerBag, kIdsPerBag, at::kLong);
    for (int step = 0; step < kSteps; ++step) {
      // Ids from the first 100 rows, so bags share rows and most rows are never touched.
      const at::Tensor ids = at::randint(100, {kBags * kIdsPerBag}, generator, at::kLong);
      const at::Tensor target = at::randn({kBags, 1}, generator, at::kDouble);
      {
        dist_autograd::ContextGuard context;
        const at::Tensor loss = at::mse_loss(head.forward(bag->forward(ids, offsets)), target);
        dist_autograd::backward(context.id(), {loss});
        const int64_t nnz = rpc::rpc_sync<int64_t>(testing::worker(1), "bag_gradient_nnz",
                                                   std::tuple{context.id(), bag->module_rref()});
        EXPECT_EQ(nnz, ids.numel()) << "the table's gradient is not sparse, or not one row per id";
        sparse_adam.step(context.id());
        sgd.step(context.id());
      }
      ref_sgd.zero_grad();
      ref_bag.weight.mutable_grad() = at::Tensor();
      at::mse_loss(ref_head.forward(ref_bag.forward(ids, offsets)), target).backward();
      ASSERT_TRUE(ref_bag.weight.grad().is_sparse());
      ref_adam.step({ref_bag.weight.grad()});
      ref_sgd.step();
    }
    const at::Tensor trained = table[0].to_here();
    EXPECT_TRUE(at::allclose(trained, ref_bag.weight, 1e-12, 1e-12));
    // Rows no batch touched never moved (SparseAdam is lazy).
    EXPECT_TRUE(at::equal(trained.slice(0, 100), initial.slice(0, 100)));
    EXPECT_FALSE(at::equal(trained.slice(0, 0, 100), initial.slice(0, 0, 100)));
    EXPECT_TRUE(at::allclose(head.weight, ref_head.weight, 1e-12, 1e-12));
  });
}

}  // namespace remote_module_training_test
}  // namespace distoptim
