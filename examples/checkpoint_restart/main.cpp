// Training that survives a crash: each rank fits a small regression model under
// DistributedDataParallel with a ZeroRedundancyOptimizer (Adam), saves a checkpoint every
// --every steps and, when it starts, resumes from the latest complete one. Run it under distrun
// with restarts, and make a rank fail once to see a restart resume (from the repository root,
// after a build in build/; --help lists every option):
//
//   build/tools/distrun/distrun --nproc-per-node 2 --max-restarts 3 \
//       build/examples/checkpoint_restart/checkpoint_restart --dir ckpt --fail-at 30
//
// distrun stops the other ranks and starts them all again with DISTRUN_RESTART_COUNT=1; they
// carry on from the latest checkpoint, ckpt/epoch-1-step-10 (20 steps an epoch, a checkpoint
// every 5), with the count of samples each had read; the loss goes on as if nothing had
// happened, and a run without --fail-at ends with the same parameters.

#include <cstdlib>
#include <string>

#include <fmt/core.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>
#include <CLI/CLI.hpp>

#include <distoptim/comm.h>
#include <distoptim/data_parallel.h>

#include "example_main.h"

namespace comm = distoptim::comm;
namespace dp = distoptim::data_parallel;

namespace {

struct Settings {
  std::string dir = "checkpoints";
  int epochs = 3;
  int steps_per_epoch = 20;
  int every = 5;
  int fail_at = -1;
};

int train(const Settings& s) {
  comm::init_process_group();
  const int rank = comm::get_rank();
  const int world_size = comm::get_world_size();
  const char* restarts = std::getenv("DISTRUN_RESTART_COUNT");
  const bool first_attempt = restarts == nullptr || std::string(restarts) == "0";

  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(8, 32), torch::nn::ReLU(),
                              torch::nn::Linear(32, 1));
  dp::DistributedDataParallel<torch::nn::Sequential> ddp(model);
  dp::ZeroRedundancyOptimizer zero(model->parameters(), "adam", {{"lr", 0.01}});
  const dp::CheckpointItems items{model.ptr().get(), &zero, nullptr};
  const at::Tensor true_weights = torch::linspace(-1, 1, 8).reshape({8, 1});

  // Where the data stands: the epoch, the step in it, and (as a value of ours) the samples this
  // rank has read, which a real data loader would seek to.
  dp::TrainingPosition position;
  position.values["samples_read"] = 0;
  if (const auto latest = dp::latest_checkpoint(s.dir)) {
    position = dp::load_checkpoint(*latest, items, comm::world());
    fmt::print("resumed from {}: epoch {} step {}, {} samples read\n", *latest, position.epoch,
               position.step, position.values["samples_read"]);
  }
  for (; position.epoch < s.epochs; ++position.epoch, position.step = 0) {
    for (; position.step < s.steps_per_epoch; ++position.step) {
      const int global_step = position.epoch * s.steps_per_epoch + position.step;
      if (first_attempt && rank == world_size - 1 && global_step == s.fail_at) {
        fmt::print(stderr, "failing on purpose before step {}\n", global_step);
        return 1;
      }
      // Each rank's batch depends only on the step and the rank, as a seeded sampler's would.
      torch::manual_seed(global_step * world_size + rank + 1);
      const at::Tensor x = torch::randn({16, 8});
      const at::Tensor y = x.matmul(true_weights);
      zero.zero_grad();
      const at::Tensor loss = (ddp.forward(x) - y).pow(2).mean();
      loss.backward();
      zero.step();
      position.values["samples_read"] += x.size(0);
      if ((global_step + 1) % s.every == 0) {
        dp::TrainingPosition next = position;
        ++next.step;  // the checkpoint holds the state after this step
        dp::save_checkpoint(s.dir, next, items, comm::world());
        if (rank == 0) dp::prune_checkpoints(s.dir, 2);  // older ones are not needed any more
      }
      if (rank == 0 && global_step % 10 == 0) {
        fmt::print("epoch {} step {}: loss {:.6f}\n", position.epoch, position.step,
                   loss.item<double>());
      }
    }
  }
  if (rank == 0) {
    double sum = 0;
    for (const auto& p : model->parameters()) sum += p.sum().item<double>();
    fmt::print("done: sum of the parameters {:.9f}\n", sum);
  }
  comm::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Checkpointed data-parallel training: run with distrun --max-restarts",
               "checkpoint_restart"};
  Settings s;
  app.add_option("--dir", s.dir, "directory of the checkpoints (the same for every rank)");
  app.add_option("--epochs", s.epochs, "epochs to train")->check(examples::above(0));
  app.add_option("--steps-per-epoch", s.steps_per_epoch, "steps in an epoch")
      ->check(examples::above(0));
  app.add_option("--every", s.every, "steps between checkpoints")->check(examples::above(0));
  app.add_option("--fail-at", s.fail_at,
                 "global step before which the last rank exits with status 1,"
                 " in the first attempt only (to try a restart)");
  return examples::run(
      app, argc, argv,
      examples::distrun() + " --nproc-per-node 2 --max-restarts 3 " + argv[0] + " --dir ckpt",
      [&] { return train(s); });
}
