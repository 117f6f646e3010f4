// The training program of checkpoint_test, started by the real distrun: a small model (with a
// batch norm, for buffers) under DistributedDataParallel and a ZeroRedundancyOptimizer over
// Adam, trained for a fixed number of steps on batches that depend only on the step and the rank,
// with a checkpoint every few steps. On start it resumes from the latest complete checkpoint.
//
//   checkpoint_trainer DIR STEPS EVERY KILL_RANK KILL_STEP
//
// In the first attempt (DISTRUN_RESTART_COUNT 0), rank KILL_RANK sends itself SIGKILL before
// step KILL_STEP (-1: never). At the end rank 0 writes the parameters and buffers to
// DIR/final.pt (a pickled list of tensors).

#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/serialize.h>
#include <torch/utils.h>

#include <distoptim/comm.h>
#include <distoptim/data_parallel.h>

namespace {

namespace comm = distoptim::comm;
namespace dp = distoptim::data_parallel;

int env_int(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::atoi(value) : 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: checkpoint_trainer DIR STEPS EVERY KILL_RANK KILL_STEP\n");
    return 2;
  }
  const std::string dir = argv[1];
  const int steps = std::atoi(argv[2]);
  const int every = std::atoi(argv[3]);
  const int kill_rank = std::atoi(argv[4]);
  const int kill_step = std::atoi(argv[5]);

  comm::init_process_group(comm::ProcessGroupOptions("env://").timeout(std::chrono::seconds(20)));
  const int rank = comm::get_rank();
  torch::manual_seed(7);
  torch::nn::Sequential model(torch::nn::Linear(6, 12), torch::nn::BatchNorm1d(12),
                              torch::nn::Tanh(), torch::nn::Linear(12, 3));
  dp::DistributedDataParallel<torch::nn::Sequential> ddp(model);
  dp::ZeroRedundancyOptimizer zero(model->parameters(), "adam", {{"lr", 0.01}});
  const dp::CheckpointItems items{model.ptr().get(), &zero, nullptr};

  int64_t start = 0;
  if (const auto latest = dp::latest_checkpoint(dir)) {
    const dp::TrainingPosition position = dp::load_checkpoint(*latest, items, comm::world());
    start = position.step;
    std::printf("resumed from %s at step %lld\n", latest->c_str(), static_cast<long long>(start));
  } else {
    std::printf("no checkpoint; starting afresh\n");
  }
  std::fflush(stdout);

  for (int64_t step = start; step < steps; ++step) {
    if (env_int("DISTRUN_RESTART_COUNT") == 0 && rank == kill_rank && step == kill_step) {
      ::raise(SIGKILL);
    }
    // The batch depends on the step and the rank only, so a resumed run sees the same data.
    torch::manual_seed(1000 + step * comm::get_world_size() + rank);
    const at::Tensor x = torch::randn({8, 6});
    const at::Tensor y = torch::randn({8, 3});
    zero.zero_grad();
    (ddp.forward(x) - y).pow(2).mean().backward();
    zero.step();
    if ((step + 1) % every == 0) {
      dp::TrainingPosition position;
      position.step = step + 1;
      dp::save_checkpoint(dir, position, items, comm::world());
    }
  }

  if (rank == 0) {
    c10::List<at::Tensor> tensors;
    for (const auto& p : model->parameters()) tensors.push_back(p.detach());
    for (const auto& b : model->buffers()) tensors.push_back(b);
    const std::vector<char> bytes = torch::pickle_save(tensors);
    std::ofstream(dir + "/final.pt", std::ios::binary).write(bytes.data(), bytes.size());
  }
  comm::world().barrier();
  comm::destroy_process_group();
  return 0;
}
