// The tutorial "Shard optimizer states with ZeroRedundancyOptimizer" on CPU: every rank trains
// the same model (20 x Linear(2000, 2000)) with DistributedDataParallel for one step, once with
// ZeroRedundancyOptimizer over Adam and once with plain Adam, and prints its peak resident memory
// around the optimizer's step() and the sum of its parameters. Adam keeps two values per
// parameter; ZeroRedundancyOptimizer keeps them for this rank's share of the parameters only, so
// with two ranks the memory step() adds is about half of plain Adam's, while the parameters end
// up the same.
//
// From the repository root, after a build in build/ (--help lists every option):
//
//   build/tools/distrun/distrun --nproc-per-node 2 build/examples/zero_memory/zero_memory \
//       --layers 20 --size 2000 --batch 20
//
// Memory is the resident set of each rank's process, read from /proc/self/status (VmHWM, its
// high-water mark, and VmRSS). Before each phase the high-water mark is reset to the current
// resident set by writing "5" to /proc/self/clear_refs (Linux 4.0+), so each phase reports its
// own peak; where that file cannot be written, a thread samples VmRSS every millisecond instead.
// Freed memory is returned to the system at once (see main), so the second variant starts from
// what is alive, not from the first one's peak.

#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

#include <fmt/core.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>
#include <CLI/CLI.hpp>

#include <distoptim/comm.h>
#include <distoptim/data_parallel.h>
#include <distoptim/optim/torch_adapter.h>

#include "example_main.h"

namespace {

namespace dp = distoptim::data_parallel;

// One field of /proc/self/status in kB ("VmHWM", "VmRSS"), or -1 if it is missing.
long status_kb(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.compare(0, field.size() + 1, field + ":") == 0) {
      return std::stol(line.substr(field.size() + 1));
    }
  }
  return -1;
}

double to_mb(long kb) { return kb * 1024.0 / 1e6; }

// The peak resident set of a phase of the program. begin() starts a phase at the current resident
// set; peak_kb() is the highest resident set since. The kernel keeps the high-water mark (VmHWM)
// and lets a process reset it through /proc/self/clear_refs; where it cannot, a sampling thread
// keeps the maximum of VmRSS (which may miss a peak shorter than a millisecond).
class PhasePeak {
 public:
  PhasePeak() : can_reset_(reset_high_water_mark()) {}
  ~PhasePeak() { stop_sampling(); }

  bool exact() const { return can_reset_; }

  void begin() {
    // Memory freed by the previous phase goes back to the system, so the phase starts from
    // what is actually live.
    malloc_trim(0);
    if (can_reset_) {
      reset_high_water_mark();
      return;
    }
    stop_sampling();
    sampled_peak_kb_ = status_kb("VmRSS");
    sampling_ = true;
    sampler_ = std::thread([this] {
      while (sampling_) {
        sampled_peak_kb_ = std::max(sampled_peak_kb_.load(), status_kb("VmRSS"));
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    });
  }

  long peak_kb() {
    if (can_reset_) return status_kb("VmHWM");
    sampled_peak_kb_ = std::max(sampled_peak_kb_.load(), status_kb("VmRSS"));
    return sampled_peak_kb_;
  }

 private:
  static bool reset_high_water_mark() {
    std::ofstream clear_refs("/proc/self/clear_refs");
    clear_refs << "5";
    clear_refs.flush();
    return clear_refs.good();
  }

  void stop_sampling() {
    sampling_ = false;
    if (sampler_.joinable()) sampler_.join();
  }

  bool can_reset_;
  std::atomic<bool> sampling_{false};
  std::atomic<long> sampled_peak_kb_{0};
  std::thread sampler_;
};

struct Sizes {
  int layers = 20;
  int64_t size = 2000;
  int64_t batch = 20;
};

// The tutorial's example(rank, world_size, use_zero). Every peak printed is the highest resident
// set since this variant began (the tutorial's max_memory_allocated counts since its process
// began; here both variants run in one process, one after the other). step()'s extra memory is
// the peak during step() minus the resident set before it.
void example(const Sizes& sizes, bool use_zero) {
  fmt::print("=== {} ===\n",
             use_zero ? "Using ZeroRedundancyOptimizer" : "Not Using ZeroRedundancyOptimizer");
  torch::manual_seed(0);
  PhasePeak phase;
  long peak_kb = 0;
  auto print_peak = [&](const char* what) {
    peak_kb = std::max(peak_kb, phase.peak_kb());
    fmt::print("peak memory {}: {:.1f}MB\n", what, to_mb(peak_kb));
    std::fflush(stdout);
  };

  phase.begin();
  torch::nn::Sequential model;
  for (int i = 0; i < sizes.layers; ++i)
    model->push_back(torch::nn::Linear(sizes.size, sizes.size));
  print_peak("after creating local model");

  dp::DistributedDataParallel ddp(model);
  print_peak("after creating DDP");

  std::unique_ptr<dp::ZeroRedundancyOptimizer> zero;
  std::unique_ptr<distoptim::optim::TorchAdam> adam;
  if (use_zero) {
    zero = std::make_unique<dp::ZeroRedundancyOptimizer>(model->parameters(), "adam",
                                                         distoptim::optim::OptionBag{{"lr", 0.01}});
  } else {
    adam = std::make_unique<distoptim::optim::TorchAdam>(model->parameters(),
                                                         distoptim::optim::AdamOptions(0.01));
  }

  const at::Tensor outputs = ddp.forward(torch::randn({sizes.batch, sizes.size}));
  const at::Tensor labels = torch::randn({sizes.batch, sizes.size});
  torch::nn::functional::mse_loss(outputs, labels).backward();
  print_peak("before optimizer step()");

  phase.begin();
  const long before_step_kb = status_kb("VmRSS");
  if (use_zero) {
    zero->step();
  } else {
    adam->step();
  }
  const long step_peak_kb = phase.peak_kb();
  print_peak("after optimizer step()");
  fmt::print("optimizer step() extra memory: {:.1f}MB\n", to_mb(step_peak_kb - before_step_kb));

  // sum(model.parameters()).sum() as in the tutorial (a bias broadcasts over its weight's rows),
  // accumulated in float64 so every digit printed is the parameters', not the summation's.
  torch::NoGradGuard no_grad;
  at::Tensor sum = torch::zeros({}, torch::kFloat64);
  for (const auto& p : model->parameters()) sum = sum + p.to(torch::kFloat64);
  fmt::print("params sum is: {:.17g}\n", sum.sum().item<double>());
  std::fflush(stdout);
}

// Both variants on this rank, one after the other.
int run_example(Sizes sizes, int threads) {
  // Every tensor of 1 MiB or more gets its own mapping, returned to the system when the tensor
  // is freed (glibc would otherwise raise this threshold after the first large free and keep
  // freed tensors resident for reuse), so the resident set follows the tensors alive.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);

  distoptim::comm::init_process_group();
  if (threads == 0) {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    threads = std::max(1, cores / distoptim::comm::get_local_world_size());
  }
  torch::set_num_threads(threads);
  if (!PhasePeak().exact()) {
    fmt::print(stderr, "zero_memory: /proc/self/clear_refs is not writable; sampling VmRSS\n");
  }

  example(sizes, /*use_zero=*/true);
  example(sizes, /*use_zero=*/false);
  distoptim::comm::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ZeroRedundancyOptimizer's memory saving, with and without ZeRO, on every rank",
               "zero_memory"};
  Sizes sizes;
  int threads = 0;
  app.add_option("--layers", sizes.layers, "Linear layers in the model")->check(examples::above(0));
  app.add_option("--size", sizes.size, "in and out features of every layer")
      ->check(examples::above(0));
  app.add_option("--batch", sizes.batch, "rows of each rank's batch")->check(examples::above(0));
  app.add_option("--threads", threads,
                 "intra-op threads per rank (default: the cores shared among the local ranks)")
      ->check(examples::at_least(0));
  return examples::run(app, argc, argv,
                       examples::distrun() + " --nproc-per-node 2 " + argv[0] +
                           " --layers 20 --size 2000 --batch 20",
                       [&] { return run_example(sizes, threads); });
}
