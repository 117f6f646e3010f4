// PyTorch's tutorial "Combining Distributed DataParallel with Distributed RPC Framework" in C++:
// a parameter server (rank 0) holds an EmbeddingBag; every trainer (ranks 1..) looks its bags up
// through RPC and feeds them to a Linear it trains with DistributedDataParallel over the trainers'
// group. Each step is one distributed autograd context: the backward pass reaches the embedding
// on the server and averages the Linear's gradients over the trainers inside the context, and
// one DistributedOptimizer (SGD) updates both.
//
//   distrun --nproc-per-node 3 ddp_rpc [--epochs 10] [--batches 10] [--lr 0.05] [--seed 0]
//
// Each trainer prints its mean loss per epoch.

#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/core.h>
#include <torch/nn/functional/loss.h>
#include <CLI/CLI.hpp>

#include <distoptim/comm.h>
#include <distoptim/data_parallel.h>
#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/rpc.h>

#include "ddp_rpc_model.h"

namespace {

namespace comm = distoptim::comm;
namespace dist_autograd = distoptim::dist_autograd;

struct Settings {
  int64_t epochs = 10;
  int64_t batches = 10;
  double lr = 0.05;
  int64_t seed = 0;
};

void train(const Settings& settings, int rank, const comm::Group& trainers) {
  torch::nn::Linear fc(ddp_rpc::kEmbeddingDim, ddp_rpc::kOutFeatures);  // DDP gives all trainer 1's
  ddp_rpc::HybridModel model(
      "ps", fc, distoptim::data_parallel::DistributedDataParallelOptions().process_group(trainers));
  distoptim::dist_optim::DistributedOptimizer optimizer(
      "sgd", model.parameter_rrefs(), distoptim::optim::OptionBag().set("lr", settings.lr));
  auto generator =
      at::detail::createCPUGenerator(static_cast<uint64_t>(settings.seed * 1000 + rank));
  for (int64_t epoch = 0; epoch < settings.epochs; ++epoch) {
    double total = 0;
    for (int64_t b = 0; b < settings.batches; ++b) {
      const ddp_rpc::Batch batch = ddp_rpc::random_batch(generator);
      dist_autograd::ContextGuard context;
      const at::Tensor output = model.forward(batch.indices, batch.offsets);
      const at::Tensor loss = torch::nn::functional::cross_entropy(output, batch.target);
      dist_autograd::backward(context.id(), {loss});
      optimizer.step(context.id());
      total += loss.item<double>();
    }
    fmt::print("trainer {} epoch {}: loss {:.6f} (mean of {} batches)\n", rank, epoch,
               total / static_cast<double>(settings.batches), settings.batches);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "PyTorch's DDP + RPC tutorial on distoptim: an EmbeddingBag on a parameter server (rank 0), "
      "a Linear under DistributedDataParallel on each trainer (ranks 1..), one distributed "
      "autograd context and one DistributedOptimizer per step. Run it under distrun: distrun "
      "--nproc-per-node 3 ddp_rpc"};
  Settings s;
  app.add_option("--epochs", s.epochs, "epochs per trainer")->check(CLI::PositiveNumber);
  app.add_option("--batches", s.batches, "batches per epoch")->check(CLI::PositiveNumber);
  app.add_option("--lr", s.lr, "SGD's learning rate")->check(CLI::PositiveNumber);
  app.add_option("--seed", s.seed, "seed of the parameters and batches");
  CLI11_PARSE(app, argc, argv);

  try {
    const auto env = comm::LaunchEnv::from_environment();
    const int world_size = env.world_size.value_or(1);
    if (world_size < 2) {
      fmt::print(stderr,
                 "ddp_rpc: needs a parameter server and at least one trainer: run it as "
                 "distrun --nproc-per-node 3 {}\n",
                 argv[0]);
      return 2;
    }
    comm::init_process_group(comm::ProcessGroupOptions("env://"));
    const int rank = comm::get_rank();
    std::vector<int> trainer_ranks;
    for (int r = 1; r < world_size; ++r) trainer_ranks.push_back(r);
    const comm::Group trainers = comm::new_group(trainer_ranks);  // collective: the server too
    at::manual_seed(static_cast<uint64_t>(s.seed * 1000 + rank));
    if (rank == 0) {
      ddp_rpc::serve_embedding(
          at::randn({ddp_rpc::kNumEmbeddings, ddp_rpc::kEmbeddingDim}));  // nn.EmbeddingBag's init
    }
    const std::string name = rank == 0 ? "ps" : "trainer" + std::to_string(rank);
    distoptim::rpc::init_rpc(name, rank, world_size, distoptim::rpc::RpcBackendOptions("env://"));
    if (rank > 0) train(s, rank, trainers);
    distoptim::rpc::shutdown();  // the server waits here until every trainer is done
    comm::destroy_process_group();
  } catch (const c10::Error& error) {
    fmt::print(stderr, "ddp_rpc: {} (run it as distrun --nproc-per-node 3 {})\n",
               error.what_without_backtrace(), argv[0]);
    return 1;
  } catch (const std::exception& error) {
    fmt::print(stderr, "ddp_rpc: {} (run it as distrun --nproc-per-node 3 {})\n", error.what(),
               argv[0]);
    return 1;
  }
  return 0;
}
