// The API example of torch.distributed.optim's documentation, in C++:
//
//   with dist_autograd.context() as context_id:
//     rref1 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
//     rref2 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
//     loss = rref1.to_here() + rref2.to_here()
//     dist_autograd.backward(context_id, [loss.sum()])
//     dist_optim = DistributedOptimizer(optim.SGD, [rref1, rref2], lr=0.05)
//     dist_optim.step(context_id)
//
// Run as it is, PyTorch's fails ("requires_grad not set on root"): torch.add of tensors that do
// not require grad gives a tensor that does not either, so nothing is there to optimize. Here the
// function worker1 runs makes its result a parameter (a leaf that requires grad), as a module's
// weights are; the rest reads as the documentation does. From the repository root, after a build
// in build/:
//
//   build/tools/distrun/distrun --nproc-per-node 2 build/examples/dist_optim_doc/dist_optim_doc

#include <cstdio>

#include <ATen/ATen.h>
#include <fmt/core.h>
#include <fmt/ranges.h>

#include <distoptim/comm.h>
#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/rpc.h>

#include "example_main.h"

namespace rpc = distoptim::rpc;
namespace dist_autograd = distoptim::dist_autograd;

// torch.add, whose result is a parameter of the worker that computes it.
DISTOPTIM_RPC_FUNCTION("add", [](const at::Tensor& a, double b) {
  return at::add(a, b).requires_grad_();
});

std::string values(const rpc::RRef<at::Tensor>& rref) {
  const at::Tensor t = rref.to_here().detach().contiguous();
  return fmt::format("[{}]", fmt::join(t.data_ptr<float>(), t.data_ptr<float>() + t.numel(), ", "));
}

// The documentation's example, on worker0.
void documented_example() {
  dist_autograd::ContextGuard context;
  auto rref1 = rpc::remote<at::Tensor>("worker1", "add", std::tuple{at::ones({2}), 3.0});
  auto rref2 = rpc::remote<at::Tensor>("worker1", "add", std::tuple{at::ones({2}), 1.0});
  at::Tensor loss = rref1.to_here() + rref2.to_here();
  dist_autograd::backward(context.id(), {loss.sum()});
  distoptim::dist_optim::DistributedOptimizer dist_optim(
      "sgd", {rref1, rref2}, distoptim::optim::OptionBag().set("lr", 0.05));
  fmt::print("before the step: rref1 {}  rref2 {}\n", values(rref1), values(rref2));
  dist_optim.step(context.id());
  fmt::print("after the step:  rref1 {}  rref2 {}  (each moved by -lr * dloss/dx = -0.05)\n",
             values(rref1), values(rref2));
}

// worker0 runs the example; worker1 serves it.
int run_example() {
  const auto env = distoptim::comm::LaunchEnv::from_environment();
  const int rank = env.rank.value_or(0), world_size = env.world_size.value_or(1);
  TORCH_CHECK_VALUE(world_size == 2, "needs exactly 2 workers, got a world size of ", world_size,
                    " (WORLD_SIZE, which distrun sets)");
  rpc::init_rpc("worker" + std::to_string(rank), rank, world_size);
  try {
    if (rank == 0) documented_example();
  } catch (...) {
    // Stop the agent at once (the other worker may never reach a graceful shutdown's barrier),
    // so that the error reaches main's one-line report rather than dying with the agent.
    rpc::shutdown(/*graceful=*/false);
    throw;
  }
  rpc::shutdown();
  return 0;
}

int main(int argc, char** argv) {
  CLI::App app{"The DistributedOptimizer example of torch.distributed.optim's documentation",
               "dist_optim_doc"};
  return examples::run(app, argc, argv, examples::distrun() + " --nproc-per-node 2 " + argv[0],
                       run_example);
}
