// zero_bench: DistributedDataParallel + ZeroRedundancyOptimizer + Adam, ours against PyTorch's.
//
// In one run, for the tutorial's model (20 x Linear(2000, 2000), batch 20 per rank, Adam lr 0.01)
// on 2 ranks, gloo on loopback, 1 intra-op thread per rank (the machine's 2 cores shared by the
// ranks), with and without parameters_as_bucket_view, it measures
//   ours:    this program's ranks, started by distrun (`zero_bench --worker ...`);
//   PyTorch: bench/zero/pytorch_zero.py under the system Python (torch.multiprocessing).
// Every iteration (zero_grad + forward + backward + step) starts after a barrier; its time is the
// slowest rank's, and the reported time is the median over the timed iterations after the
// warm-up ones (the first creates the optimizer state). Memory is each rank's peak resident set
// (VmHWM) over its whole life, the largest over the ranks, including the runtime (LibTorch, or
// Python and PyTorch); the table also shows it above the resident set before the model was built.
// It prints a table and writes the cases as JSON, with the load average (common/report.h), to
// the file named by --json.
//
// Usage: zero_bench --json PATH [--iterations N] [--warmup N] [--layers N] [--size N]
//                   [--batch N]

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/core.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <distoptim/comm.h>
#include <distoptim/data_parallel.h>

#include "../common/child_process.h"
#include "../common/report.h"

namespace distoptim {
namespace bench {
namespace {

using json = nlohmann::json;  // NOLINT: the library's own spelling
using Clock = std::chrono::steady_clock;

constexpr int kWorldSize = 2;
constexpr int kThreadsPerRank = 1;

struct Config {
  int layers = 20;
  int64_t size = 2000;
  int64_t batch = 20;
  int warmup = 2;
  int iterations = 7;
};

// --- a rank of ours ------------------------------------------------------------------------------

// Trains as pytorch_zero.py's run_rank does and prints the same RESULT line.
void run_worker(const Config& config, bool bucket_view) {
  torch::set_num_threads(kThreadsPerRank);
  comm::init_process_group();
  const long start_kb = proc_status_kb("VmRSS");
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int i = 0; i < config.layers; ++i) {
    model->push_back(torch::nn::Linear(config.size, config.size));
  }
  data_parallel::DistributedDataParallel ddp(model);
  data_parallel::ZeroRedundancyOptimizer zero(
      model->parameters(), "adam", {{"lr", 0.01}},
      data_parallel::ZeroRedundancyOptimizerOptions().parameters_as_bucket_view(bucket_view));
  const int rank = comm::get_rank();
  torch::manual_seed(1 + rank);
  const at::Tensor x = torch::randn({config.batch, config.size});
  const at::Tensor y = torch::randn({config.batch, config.size});
  std::vector<double> times;
  std::vector<double> step_times;
  auto seconds = [](Clock::time_point from, Clock::time_point to) {
    return std::chrono::duration<double>(to - from).count();
  };
  for (int iteration = 0; iteration < config.warmup + config.iterations; ++iteration) {
    comm::world().barrier();
    const auto begin = Clock::now();
    zero.zero_grad();
    torch::mse_loss(ddp.forward(x), y).backward();
    const auto step_begin = Clock::now();
    zero.step();
    const auto end = Clock::now();
    if (iteration >= config.warmup) {
      times.push_back(seconds(begin, end));
      step_times.push_back(seconds(step_begin, end));
    }
  }
  const json result{{"rank", rank},
                    {"times", times},
                    {"step_times", step_times},
                    {"start_kb", start_kb},
                    {"peak_kb", proc_status_kb("VmHWM")}};
  fmt::print("{}{}\n", kResultPrefix, result.dump());
  std::fflush(stdout);
  comm::destroy_process_group();
}

// --- the driver ----------------------------------------------------------------------------------

// One side of a case: per-iteration time (slowest rank), peak memory (largest rank).
struct Side {
  double median_s = 0;
  double min_s = 0;
  // Of step() alone (slowest rank): the part ZeroRedundancyOptimizer does.
  double step_median_s = 0;
  double peak_mb = 0;
  double peak_above_start_mb = 0;
};

struct CaseResult {
  std::string name;
  Side ours;
  Side pytorch;
};

// Reads the RESULT lines of every rank (possibly behind distrun's "[rank R] " prefix).
Side parse_results(const std::string& what, const std::string& output, const Config& config) {
  const std::vector<json> ranks = result_lines(output);
  TORCH_CHECK(ranks.size() == kWorldSize, "zero_bench: ", what, " reported ", ranks.size(), " of ",
              kWorldSize, " ranks; its output:\n", output);
  Side side;
  std::vector<double> slowest(config.iterations, 0.0);
  std::vector<double> slowest_step(config.iterations, 0.0);
  for (const auto& r : ranks) {
    const auto times = r.at("times").get<std::vector<double>>();
    const auto step_times = r.at("step_times").get<std::vector<double>>();
    TORCH_CHECK(times.size() == slowest.size() && step_times.size() == slowest.size(),
                "zero_bench: ", what, " timed ", times.size(), " iterations");
    for (size_t i = 0; i < times.size(); ++i) {
      slowest[i] = std::max(slowest[i], times[i]);
      slowest_step[i] = std::max(slowest_step[i], step_times[i]);
    }
    const double peak_mb = r.at("peak_kb").get<double>() * 1024 / 1e6;
    side.peak_mb = std::max(side.peak_mb, peak_mb);
    side.peak_above_start_mb =
        std::max(side.peak_above_start_mb, peak_mb - r.at("start_kb").get<double>() * 1024 / 1e6);
  }
  side.median_s = median(slowest);
  side.min_s = *std::min_element(slowest.begin(), slowest.end());
  side.step_median_s = median(slowest_step);
  return side;
}

std::vector<std::string> size_args(const Config& config) {
  return {
      "--layers",     std::to_string(config.layers),    "--size",   std::to_string(config.size),
      "--batch",      std::to_string(config.batch),     "--warmup", std::to_string(config.warmup),
      "--iterations", std::to_string(config.iterations)};
}

Side run_ours(const Config& config, bool bucket_view) {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::vector<std::string> argv{DISTOPTIM_DISTRUN_PATH, "--nproc-per-node",
                                std::to_string(kWorldSize), self, "--worker"};
  for (auto& arg : size_args(config)) argv.push_back(std::move(arg));
  if (bucket_view) argv.push_back("--bucket-view");
  const ChildResult child = run_child(argv, "");
  TORCH_CHECK(child.exit_code == 0, "zero_bench: our ranks exited with ", child.exit_code,
              "; their output:\n", child.stdout_text);
  return parse_results("distrun", child.stdout_text, config);
}

Side run_pytorch(const Config& config, bool bucket_view, const std::string& python,
                 const std::string& script) {
  std::vector<std::string> argv{python,         script,
                                "--threads",    std::to_string(kThreadsPerRank),
                                "--world-size", std::to_string(kWorldSize)};
  for (auto& arg : size_args(config)) argv.push_back(std::move(arg));
  if (bucket_view) argv.push_back("--bucket-view");
  const ChildResult child = run_child(argv, "");
  TORCH_CHECK(child.exit_code == 0, "zero_bench: ", script, " exited with ", child.exit_code,
              "; its output:\n", child.stdout_text);
  return parse_results(script, child.stdout_text, config);
}

void print_table(const Config& config, const std::vector<CaseResult>& cases) {
  fmt::print(
      "\nzero_bench: DDP + ZeroRedundancyOptimizer + Adam, {} x Linear({}, {}), batch {} per "
      "rank, {} ranks (gloo, loopback), {} intra-op thread per rank\n",
      config.layers, config.size, config.size, config.batch, kWorldSize, kThreadsPerRank);
  fmt::print(
      "time: zero_grad + forward + backward + step of the slowest rank, median (min) over {} "
      "iterations after {} warm-up; step: step() alone, median\n",
      config.iterations, config.warmup);
  fmt::print(
      "memory: peak resident set (VmHWM) of the largest rank, whole process (above the resident "
      "set before the model)\n\n");
  fmt::print("{:<22} {:>17} {:>17} {:>8} {:>8} {:>8} {:>18} {:>18}\n", "case", "ours s",
             "pytorch s", "speedup", "ours", "pytorch", "ours peak MB", "pytorch peak MB");
  fmt::print("{:<22} {:>17} {:>17} {:>8} {:>8} {:>8}\n", "", "", "", "", "step s", "step s");
  for (const auto& c : cases) {
    fmt::print(
        "{:<22} {:>7.3f} ({:>6.3f}) {:>7.3f} ({:>6.3f}) {:>7.2f}x {:>8.3f} {:>8.3f} {:>7.0f} "
        "({:>+7.0f}) {:>7.0f} ({:>+7.0f})\n",
        c.name, c.ours.median_s, c.ours.min_s, c.pytorch.median_s, c.pytorch.min_s,
        c.pytorch.median_s / c.ours.median_s, c.ours.step_median_s, c.pytorch.step_median_s,
        c.ours.peak_mb, c.ours.peak_above_start_mb, c.pytorch.peak_mb,
        c.pytorch.peak_above_start_mb);
  }
  fmt::print("\n");
}

json to_json(const Config& config, const std::vector<CaseResult>& cases) {
  json out = json::array();
  for (const auto& c : cases) {
    out.push_back({{"case", c.name},
                   {"ours_s", c.ours.median_s},
                   {"pytorch_s", c.pytorch.median_s},
                   {"ours_peak_mb", c.ours.peak_mb},
                   {"pytorch_peak_mb", c.pytorch.peak_mb},
                   {"speedup", c.pytorch.median_s / c.ours.median_s},
                   {"ours_min_s", c.ours.min_s},
                   {"ours_step_s", c.ours.step_median_s},
                   {"pytorch_step_s", c.pytorch.step_median_s},
                   {"pytorch_min_s", c.pytorch.min_s},
                   {"ours_peak_above_start_mb", c.ours.peak_above_start_mb},
                   {"pytorch_peak_above_start_mb", c.pytorch.peak_above_start_mb},
                   {"layers", config.layers},
                   {"size", config.size},
                   {"batch", config.batch},
                   {"ranks", kWorldSize},
                   {"iterations", config.iterations},
                   {"warmup", config.warmup}});
  }
  return out;
}

int run(int argc, char** argv) {
  Config config;
  std::string json_path;
  bool worker = false;
  bool bucket_view = false;
  std::string python = DISTOPTIM_REFERENCE_PYTHON;
  std::string script = DISTOPTIM_PYTORCH_ZERO_SCRIPT;
  CLI::App app{
      "ZeroRedundancyOptimizer benchmark: our DDP + ZeRO + Adam against PyTorch's on 2 ranks"};
  app.add_option("--json", json_path, "Write the results as JSON to this file");
  app.add_option("--iterations", config.iterations, "timed iterations (the median is reported)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", config.warmup, "untimed iterations first")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--layers", config.layers, "Linear layers")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--size", config.size, "in and out features of every layer")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--batch", config.batch, "rows per rank")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--python", python, "Python with PyTorch 1.13")->capture_default_str();
  app.add_option("--pytorch-script", script, "pytorch_zero.py")->capture_default_str();
  app.add_flag("--worker", worker, "Run as one of our ranks (started by the benchmark itself)");
  app.add_flag("--bucket-view", bucket_view, "With --worker: parameters_as_bucket_view");
  CLI11_PARSE(app, argc, argv);

  if (worker) {
    run_worker(config, bucket_view);
    return 0;
  }
  ResultsFile results_file(json_path, "zero_bench");

  std::vector<CaseResult> cases;
  for (const bool view : {false, true}) {
    CaseResult c;
    c.name = view ? "zero_adam_bucket_view" : "zero_adam";
    fmt::print(stderr, "zero_bench: {}: ours...", c.name);
    c.ours = run_ours(config, view);
    fmt::print(stderr, " {:.3f} s; pytorch...", c.ours.median_s);
    c.pytorch = run_pytorch(config, view, python, script);
    fmt::print(stderr, " {:.3f} s\n", c.pytorch.median_s);
    cases.push_back(c);
  }
  print_table(config, cases);
  results_file.write(to_json(config, cases));
  fmt::print("results written to {}\n", json_path);
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace distoptim

int main(int argc, char** argv) {
  try {
    return distoptim::bench::run(argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "zero_bench: {}\n", e.what());
    return 1;
  }
}
