// Distributed autograd and the DistributedOptimizer with workers of a dynamic rpc group (PyTorch
// 1.13 allows neither): a parameter server starts alone, a trainer joins, calls it and leaves,
// and a trainer joining after that trains against the server (forward, distributed backward,
// DistributedOptimizer steps); its parameters equal the same training in one process with
// LibTorch. Every wait is bounded.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/optim/registry.h>
#include <distoptim/rpc.h>

#include "harness/multiprocess.h"
#include "harness/rpc_workers.h"

namespace distoptim {
namespace dist_optim {
namespace dynamic_trainer_test {

using namespace std::chrono_literals;
using dist_autograd::ContextGuard;
using optim::OptionBag;
using rpc::rpc_sync;
using rpc::RRef;

// The server's parameters: w (4 x 4) and b (4), the same every run.
std::vector<at::Tensor> make_server_params() {
  auto generator = at::detail::createCPUGenerator(700);
  auto options = at::TensorOptions().dtype(at::kDouble);
  return {at::randn({4, 4}, generator, options).requires_grad_(),
          at::randn({4}, generator, options).requires_grad_()};
}

std::vector<at::Tensor>& server_params() {
  static std::vector<at::Tensor> params = make_server_params();
  return params;
}

at::Tensor layer(const std::vector<at::Tensor>& p, const at::Tensor& x) {
  return at::tanh(at::matmul(x, p[0]) + p[1]);
}

at::Tensor input(int64_t step) {
  auto generator = at::detail::createCPUGenerator(800 + step);
  return at::randn({3, 4}, generator, at::TensorOptions().dtype(at::kDouble));
}

DISTOPTIM_RPC_FUNCTION("dynamic_layer",
                       [](const at::Tensor& x) { return layer(server_params(), x); });
DISTOPTIM_RPC_FUNCTION("dynamic_param_rrefs", [] {
  std::vector<RRef<at::Tensor>> rrefs;
  for (const at::Tensor& p : server_params()) rrefs.emplace_back(p);
  return rrefs;
});
DISTOPTIM_RPC_FUNCTION("dynamic_params", [] {
  std::vector<at::Tensor> copies;
  for (const at::Tensor& p : server_params()) copies.push_back(p.detach().clone());
  return copies;
});

struct Turns : testing::StoreTurns {
  explicit Turns(int rank) : StoreTurns(rank, "test/dynamic_trainer") {}
};

const OptionBag& adam_options() {
  static const OptionBag kOptions = OptionBag().set("lr", 0.05);
  return kOptions;
}

TEST(DynamicTrainer, ALateTrainerStepsTheServerAsOneProcessWould) {
  testing::run_ranks(3, [](int rank, int) {
    const rpc::RpcBackendOptions options = testing::test_options(30s);
    if (rank == 0) {
      rpc::init_rpc("ps", 0, options);
      Turns turns(0);
      turns.say("ps_up");
      turns.await("late_joined");
      rpc::shutdown();  // waits for the late trainer to leave
      return;
    }
    Turns turns(rank);
    turns.await("ps_up");
    if (rank == 1) {
      rpc::init_rpc("early", 1, options);
      at::Tensor h = rpc_sync<at::Tensor>("ps", "dynamic_layer", std::tuple{input(0)});
      EXPECT_TRUE(at::equal(h, layer(make_server_params(), input(0))));
      rpc::shutdown();
      turns.say("early_left");
      return;
    }
    turns.await("early_left");
    rpc::init_rpc("late", 2, options);
    turns.say("late_joined");
    const int64_t steps = 3;
    at::Tensor v = at::linspace(0.5, 1.5, 4, at::kDouble).requires_grad_();
    const at::Tensor v0 = v.detach().clone();
    std::vector<RRef<at::Tensor>> params =
        rpc_sync<std::vector<RRef<at::Tensor>>>("ps", "dynamic_param_rrefs");
    params.emplace_back(v);
    DistributedOptimizer optimizer("adam", params, adam_options());
    for (int64_t step = 0; step < steps; ++step) {
      ContextGuard context;
      at::Tensor h = rpc_sync<at::Tensor>("ps", "dynamic_layer", std::tuple{input(step) * v});
      dist_autograd::backward(context.id(), {h.pow(2).sum()});
      optimizer.step(context.id());
    }
    std::vector<at::Tensor> trained = rpc_sync<std::vector<at::Tensor>>("ps", "dynamic_params");
    trained.push_back(v.detach().clone());

    // The same in one process, with the same functional optimizer.
    std::vector<at::Tensor> local = make_server_params();
    local.push_back(v0.clone().requires_grad_());
    auto reference = optim::create_optimizer("adam", {optim::ParamGroup(local)}, adam_options());
    for (int64_t step = 0; step < steps; ++step) {
      at::Tensor loss = layer(local, input(step) * local[2]).pow(2).sum();
      reference->step(torch::autograd::grad({loss}, local));
    }
    ASSERT_EQ(trained.size(), local.size());
    for (size_t i = 0; i < local.size(); ++i) {
      EXPECT_TRUE(at::allclose(trained[i], local[i].detach(), 1e-9, 1e-12))
          << "parameter " << i << ":\n"
          << trained[i] << "\nexpected\n"
          << local[i];
    }
    rpc::shutdown();
  });
}

}  // namespace dynamic_trainer_test
}  // namespace dist_optim
}  // namespace distoptim
