// zero_bench: DistributedDataParallel + ZeroRedundancyOptimizer + Adam, ours against PyTorch's.
//
// The model: the tutorial's (20 x Linear(2000, 2000), batch 20 per rank, Adam lr 0.01), on 2
// ranks, gloo on loopback, 1 intra-op thread per rank (the machine's 2 cores shared by the
// ranks). Its gradients are a large part of its memory (80M parameters: 320 MB of gradients and
// 320 MB more in DDP's buckets, against 320 MB of parameters and 320 MB of Adam state per rank).
// Cases, ours against PyTorch 1.13 (bench/zero/pytorch_zero.py, torch.multiprocessing):
//   plain        ZeroRedundancyOptimizer behind a DistributedDataParallel, both at defaults;
//   bucket_view  the same with parameters_as_bucket_view;
//   overlap      ours with overlap_with_ddp (the update inside backward, hook_with_zero_step);
//                PyTorch's cannot overlap on Gloo (it needs NCCL and skips its first steps),
//                so this row compares with PyTorch's best variant of the round;
//   stage2       ours with stage 2 (gradients averaged onto their owners and freed elsewhere,
//                on the plain module: no DDP), against PyTorch's best variant and our stage 1;
//                at its defaults, so with the large block cache it installs as LibTorch's CPU
//                allocator (--large-block-cache installs it in our other cases too).
// Every iteration (zero_grad + forward + backward + step) starts after a barrier; a run's time is
// the median over its timed iterations (after warm-up ones; the first creates the optimizer
// state) of the slowest rank's. Memory is each rank's peak resident set (VmHWM) over its whole
// life, the largest over the ranks, including the runtime (LibTorch, or Python and PyTorch).
//
// Rounds: each round runs ours plain, PyTorch plain, ours bucket_view, PyTorch bucket_view, ours
// overlap, ours stage2, so the machine's drift falls on both sides alike; the table gives each
// side's min/median/max over the rounds and the ratio of the medians, with the load average
// before and after (flagged when above the core count). Settings, PyTorch: DDP and
// ZeroRedundancyOptimizer(optimizer_class=torch.optim.Adam, lr=0.01) at their defaults otherwise
// (bucket_cap_mb 25, parameters_as_bucket_view as the case says, overlap_with_ddp False),
// torch.set_num_threads(1), and the environment torchrun gives ranks sharing a machine
// (OMP_NUM_THREADS=1: one OpenBLAS thread) with distrun's OPENBLAS_THREAD_TIMEOUT=4; ours run
// under distrun at its defaults (which set both). Each side's BLAS threads are printed.
// CPU time: each rank's process CPU time per iteration (all its threads: Gloo's, OpenBLAS's),
// summed over the ranks, median over the iterations: on a loaded machine a steadier measure
// than wall time.
//
// The JSON written to --json holds, under "cases", rows {case, ours, pytorch, unit, better}
// (medians over the rounds), and the load average (common/report.h); the two rows "stage 2 over
// stage 1 (ours)" hold our stage 1's iteration and peak over stage 2's, with pytorch null.
//
// Memory depends on the allocator as much as on the optimizer: glibc at its defaults keeps the
// 16 MB gradients autograd frees in its heap, and a run's peak moves by up to 235 MB between
// identical runs (ours at stage 2 and under --large-block-cache bypass it for tensors of 1 MiB
// and more). --glibc-tunables sets GLIBC_TUNABLES for both sides' ranks alike (make
// bench's zero_mmap_thp runs glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=1048576: every
// block of 1 MiB or more mapped on its own, in transparent huge pages, and returned when freed).
//
// Usage: zero_bench --json PATH [--rounds 3] [--iterations N] [--warmup N] [--layers N]
//                   [--size N] [--batch N] [--glibc-tunables T] [--large-block-cache]

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <dlfcn.h>
#include <time.h>

#include <fmt/core.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <distoptim/comm.h>
#include <distoptim/data_parallel.h>

#include "../common/report.h"

namespace distoptim {
namespace bench {
namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr int kWorldSize = 2;
constexpr int kThreadsPerRank = 1;

struct Config {
  int layers = 20;
  int64_t size = 2000;
  int64_t batch = 20;
  int warmup = 2;
  int iterations = 7;
  int rounds = 3;
  int deadline_seconds = 600;
  // DistributedDataParallel's gradient_as_bucket_view, on both sides (their default: false).
  bool gradient_as_bucket_view = false;
  // Ours only (PyTorch has no such option): off measures what the shared memory gives.
  bool share_host_memory = true;
  // Ours: data_parallel::install_large_block_cache() in every rank before training.
  bool large_block_cache = false;
  // glibc's malloc settings for both sides' ranks (GLIBC_TUNABLES); empty: glibc's defaults.
  std::string glibc_tunables;
};

// How our ranks run ZeRO in a case.
enum class Mode { kPlain, kBucketView, kOverlap, kStage2 };

const std::map<std::string, Mode> kModes{{"plain", Mode::kPlain},
                                         {"bucket_view", Mode::kBucketView},
                                         {"overlap", Mode::kOverlap},
                                         {"stage2", Mode::kStage2}};

// CPU seconds of this process so far, every thread's.
double process_cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// --- a rank of ours ------------------------------------------------------------------------------

// Trains as pytorch_zero.py's run_rank does and prints the same RESULT line.
void run_worker(const Config& config, Mode mode) {
  torch::set_num_threads(kThreadsPerRank);
  if (config.large_block_cache) data_parallel::install_large_block_cache();
  comm::init_process_group();
  const long start_kb = proc_status_kb("VmRSS");
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int i = 0; i < config.layers; ++i) {
    model->push_back(torch::nn::Linear(config.size, config.size));
  }
  // Stage 2 averages the gradients itself: the plain module, no DDP.
  std::optional<data_parallel::DistributedDataParallel<torch::nn::Sequential>> ddp;
  if (mode != Mode::kStage2) {
    ddp.emplace(model, data_parallel::DistributedDataParallelOptions()
                           .gradient_as_bucket_view(config.gradient_as_bucket_view)
                           .share_host_memory(config.share_host_memory));
  }
  data_parallel::ZeroRedundancyOptimizer zero(
      model->parameters(), "adam", {{"lr", 0.01}},
      data_parallel::ZeroRedundancyOptimizerOptions()
          .parameters_as_bucket_view(mode == Mode::kBucketView)
          .overlap_with_ddp(mode == Mode::kOverlap)
          .stage(mode == Mode::kStage2 ? 2 : 1)
          .share_host_memory(config.share_host_memory));
  if (mode == Mode::kOverlap) ddp->register_comm_hook(data_parallel::hook_with_zero_step(zero));
  const int rank = comm::get_rank();
  torch::manual_seed(1 + rank);
  const at::Tensor x = torch::randn({config.batch, config.size});
  const at::Tensor y = torch::randn({config.batch, config.size});
  std::vector<double> times;
  std::vector<double> step_times;
  std::vector<double> cpu_times;
  double loss_value = 0;
  auto seconds = [](Clock::time_point from, Clock::time_point to) {
    return std::chrono::duration<double>(to - from).count();
  };
  for (int iteration = 0; iteration < config.warmup + config.iterations; ++iteration) {
    comm::world().barrier();
    const double cpu_begin = process_cpu_seconds();
    const auto begin = Clock::now();
    zero.zero_grad();
    const at::Tensor loss = torch::mse_loss(ddp ? ddp->forward(x) : model->forward(x), y);
    loss.backward();
    const auto step_begin = Clock::now();
    zero.step();
    const auto end = Clock::now();
    const double cpu_end = process_cpu_seconds();
    loss_value = loss.item<double>();
    if (iteration >= config.warmup) {
      times.push_back(seconds(begin, end));
      step_times.push_back(seconds(step_begin, end));
      cpu_times.push_back(cpu_end - cpu_begin);
    }
  }
  print_result({{"rank", rank},
                {"times", times},
                {"step_times", step_times},
                {"cpu_times", cpu_times},
                {"blas_threads", blas_threads()},
                {"intra_op_threads", at::get_num_threads()},
                {"loss", loss_value},
                {"start_kb", start_kb},
                {"peak_kb", proc_status_kb("VmHWM")}});
  comm::destroy_process_group();
}

// --- the driver ----------------------------------------------------------------------------------

// One run of one side: per-iteration time (slowest rank, median over the iterations), peak
// memory (largest rank).
struct Run {
  double iteration_s = 0;
  double step_s = 0;
  double cpu_s = 0;  // summed over the ranks
  int blas_threads = 0;
  int intra_op_threads = 0;
  double peak_mb = 0;
  double peak_above_start_mb = 0;
  double loss = 0;
  std::string torch_version;  // PyTorch's side only
};

Run parse_run(const std::string& what, const std::vector<Json>& ranks, const Config& config) {
  TORCH_CHECK(ranks.size() == kWorldSize, "zero_bench: ", what, " reported ", ranks.size(), " of ",
              kWorldSize, " ranks");
  Run run;
  std::vector<double> slowest(config.iterations, 0.0);
  std::vector<double> slowest_step(config.iterations, 0.0);
  std::vector<double> cpu(config.iterations, 0.0);
  for (const auto& r : ranks) {
    const auto times = r.at("times").get<std::vector<double>>();
    const auto step_times = r.at("step_times").get<std::vector<double>>();
    const auto cpu_times = r.at("cpu_times").get<std::vector<double>>();
    TORCH_CHECK(times.size() == slowest.size() && step_times.size() == slowest.size() &&
                    cpu_times.size() == slowest.size(),
                "zero_bench: ", what, " timed ", times.size(), " iterations");
    for (size_t i = 0; i < times.size(); ++i) {
      slowest[i] = std::max(slowest[i], times[i]);
      slowest_step[i] = std::max(slowest_step[i], step_times[i]);
      cpu[i] += cpu_times[i];
    }
    run.blas_threads = r.at("blas_threads").get<int>();
    run.intra_op_threads = r.at("intra_op_threads").get<int>();
    const double peak_mb = r.at("peak_kb").get<double>() * 1024 / 1e6;
    run.peak_mb = std::max(run.peak_mb, peak_mb);
    run.peak_above_start_mb =
        std::max(run.peak_above_start_mb, peak_mb - r.at("start_kb").get<double>() * 1024 / 1e6);
    run.loss = r.at("loss").get<double>();
    run.torch_version = r.value("torch_version", "");
  }
  run.iteration_s = median(slowest);
  run.step_s = median(slowest_step);
  run.cpu_s = median(cpu);
  return run;
}

// The environment of PyTorch's ranks: the bench's own where set (for both sides alike, as
// distrun keeps it), else torchrun's OMP_NUM_THREADS and distrun's OPENBLAS_THREAD_TIMEOUT.
const char* pytorch_omp_threads() {
  const char* value = std::getenv("OMP_NUM_THREADS");
  return value != nullptr ? value : "1";
}

const char* pytorch_blas_timeout() {
  const char* value = std::getenv("OPENBLAS_THREAD_TIMEOUT");
  return value != nullptr ? value : "4";
}

std::vector<std::string> size_args(const Config& config) {
  return {
      "--layers",     std::to_string(config.layers),    "--size",   std::to_string(config.size),
      "--batch",      std::to_string(config.batch),     "--warmup", std::to_string(config.warmup),
      "--iterations", std::to_string(config.iterations)};
}

// The size arguments and the options both sides take.
std::vector<std::string> shared_args(const Config& config) {
  std::vector<std::string> args = size_args(config);
  if (config.gradient_as_bucket_view) args.push_back("--gradient-as-bucket-view");
  return args;
}

// The environment both sides' ranks get beyond their own: the glibc settings asked for.
std::vector<std::string> env_args(const Config& config) {
  std::vector<std::string> args{"/usr/bin/env"};
  if (!config.glibc_tunables.empty()) args.push_back("GLIBC_TUNABLES=" + config.glibc_tunables);
  return args;
}

// What the output says of glibc's malloc settings: those asked for, else the inherited ones.
std::string glibc_setting(const Config& config) {
  const char* inherited = std::getenv("GLIBC_TUNABLES");
  if (!config.glibc_tunables.empty()) return "GLIBC_TUNABLES=" + config.glibc_tunables;
  return inherited != nullptr ? "GLIBC_TUNABLES=" + std::string(inherited) : "its defaults";
}

Run run_ours(const Config& config, const std::string& mode) {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::vector<std::string> argv = env_args(config);
  argv.insert(argv.end(), {DISTOPTIM_DISTRUN_PATH, "--nproc-per-node", std::to_string(kWorldSize),
                           self, "--worker", "--mode", mode});
  for (auto& arg : shared_args(config)) argv.push_back(std::move(arg));
  if (!config.share_host_memory) argv.push_back("--no-share-host-memory");
  if (config.large_block_cache) argv.push_back("--large-block-cache");
  const std::string what = "our ranks (" + mode + ")";
  return parse_run(what, run_side(what, argv, config.deadline_seconds), config);
}

Run run_pytorch(const Config& config, bool bucket_view, const std::string& python,
                const std::string& script) {
  // What torchrun gives ranks sharing a machine (OMP_NUM_THREADS=1) and distrun's OpenBLAS
  // setting: ours get both from distrun.
  std::vector<std::string> argv = env_args(config);
  argv.insert(argv.end(), {"OMP_NUM_THREADS=" + std::string(pytorch_omp_threads()),
                           "OPENBLAS_THREAD_TIMEOUT=" + std::string(pytorch_blas_timeout()), python,
                           script, "--threads", std::to_string(kThreadsPerRank), "--world-size",
                           std::to_string(kWorldSize)});
  for (auto& arg : shared_args(config)) argv.push_back(std::move(arg));
  if (bucket_view) argv.push_back("--bucket-view");
  return parse_run(script, run_side(script, argv, config.deadline_seconds), config);
}

struct Spread {
  double min = 0, median = 0, max = 0;
};

Spread spread_of(const std::vector<Run>& runs, double Run::*field) {
  std::vector<double> values;
  for (const Run& run : runs) values.push_back(run.*field);
  return {*std::min_element(values.begin(), values.end()), bench::median(values),
          *std::max_element(values.begin(), values.end())};
}

std::string spread_text(const Spread& s, const char* format) {
  return fmt::format(fmt::runtime(fmt::format("{}/{}/{}", format, format, format)), s.min, s.median,
                     s.max);
}

int run(int argc, char** argv) {
  Config config;
  std::string json_path;
  bool worker = false;
  std::string mode = "plain";
  std::string python = DISTOPTIM_REFERENCE_PYTHON;
  std::string script = DISTOPTIM_PYTORCH_ZERO_SCRIPT;
  CLI::App app{
      "ZeroRedundancyOptimizer benchmark: our DDP + ZeRO + Adam against PyTorch's on 2 ranks"};
  app.add_option("--json", json_path, "Write the results as JSON to this file");
  app.add_option("--rounds", config.rounds, "rounds of every case, ours and PyTorch's alternating")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--iterations", config.iterations, "timed iterations per run (median kept)")
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
  app.add_option("--deadline-seconds", config.deadline_seconds, "each run is killed past this")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_flag("--gradient-as-bucket-view", config.gradient_as_bucket_view,
               "DistributedDataParallel with gradient_as_bucket_view, both sides");
  app.add_flag("--no-share-host-memory{false}", config.share_host_memory,
               "ours: allreduce, reduce and broadcast over Gloo's loopback TCP, not shared memory");
  app.add_flag("--large-block-cache", config.large_block_cache,
               "ours: install_large_block_cache() in every rank (LibTorch's CPU allocator)");
  app.add_option("--glibc-tunables", config.glibc_tunables,
                 "GLIBC_TUNABLES for both sides' ranks (default: glibc's defaults)");
  app.add_option("--python", python, "Python with PyTorch 1.13")->capture_default_str();
  app.add_option("--pytorch-script", script, "pytorch_zero.py")->capture_default_str();
  app.add_flag("--worker", worker, "Run as one of our ranks (started by the benchmark itself)");
  app.add_option("--mode", mode, "With --worker: plain, bucket_view, overlap or stage2")
      ->check(CLI::IsMember({"plain", "bucket_view", "overlap", "stage2"}));
  CLI11_PARSE(app, argc, argv);

  if (worker) {
    run_worker(config, kModes.at(mode));
    return 0;
  }
  ResultsFile results_file(json_path, "zero_bench");
  const double load_at_start = load_average();
  std::map<std::string, std::vector<Run>> ours, pytorch;
  for (int round = 0; round < config.rounds; ++round) {
    for (const char* name : {"plain", "bucket_view", "overlap", "stage2"}) {
      fmt::print(stderr, "zero_bench: round {}, {}: ours...", round + 1, name);
      ours[name].push_back(run_ours(config, name));
      fmt::print(stderr, " {:.3f} s", ours[name].back().iteration_s);
      const bool bucket_view = std::string(name) == "bucket_view";
      if (std::string(name) == "plain" || bucket_view) {
        fmt::print(stderr, "; pytorch...");
        pytorch[name].push_back(run_pytorch(config, bucket_view, python, script));
        fmt::print(stderr, " {:.3f} s", pytorch[name].back().iteration_s);
      }
      fmt::print(stderr, "\n");
    }
  }
  const double load_at_end = load_average();
  // PyTorch's best variant in each round: the faster of its two; its memory, that run's.
  for (int round = 0; round < config.rounds; ++round) {
    const Run& plain = pytorch["plain"][round];
    const Run& view = pytorch["bucket_view"][round];
    pytorch["best"].push_back(plain.iteration_s <= view.iteration_s ? plain : view);
  }

  fmt::print(
      "\nzero_bench: DDP + ZeroRedundancyOptimizer + Adam(lr 0.01), {} x Linear({}, {}), batch {} "
      "per rank, {} ranks (gloo, loopback), {} intra-op thread per rank; DDP "
      "gradient_as_bucket_view {} on both sides; ours share_host_memory {}; PyTorch {} at its "
      "defaults otherwise (DDP bucket_cap_mb 25, overlap_with_ddp False); glibc's malloc on both "
      "sides: {}; ours with the large block cache (install_large_block_cache) in {}\n",
      config.layers, config.size, config.size, config.batch, kWorldSize, kThreadsPerRank,
      config.gradient_as_bucket_view, config.share_host_memory,
      pytorch["plain"].front().torch_version, glibc_setting(config),
      config.large_block_cache ? "every case" : "stage 2 only (its default)");
  fmt::print(
      "threads per rank: intra-op ours {} / pytorch {}; OpenBLAS's own (-1: not OpenBLAS) ours {} "
      "/ pytorch {}; PyTorch's ranks run with OMP_NUM_THREADS={} (torchrun's value for ranks "
      "sharing a machine) and OPENBLAS_THREAD_TIMEOUT={}, ours with distrun's defaults\n",
      ours["plain"].front().intra_op_threads, pytorch["plain"].front().intra_op_threads,
      ours["plain"].front().blas_threads, pytorch["plain"].front().blas_threads,
      pytorch_omp_threads(), pytorch_blas_timeout());
  fmt::print(
      "time: zero_grad + forward + backward + step of the slowest rank, median over {} "
      "iterations after {} warm-up, per run; min/median/max over {} rounds alternating ours and "
      "PyTorch's. memory: peak resident set (VmHWM) of the largest rank, whole process, median "
      "over the rounds\n",
      config.iterations, config.warmup, config.rounds);
  const unsigned cores = std::thread::hardware_concurrency();
  fmt::print(
      "machine: {} cores, 1-minute load average {:.2f} at the start and {:.2f} at the end{}\n",
      cores, load_at_start, load_at_end,
      std::max(load_at_start, load_at_end) > cores
          ? " (ABOVE the core count: others' work competed with these measurements)"
          : "");
  fmt::print(
      "overlap and stage2 against PyTorch's best variant of each round (plain or bucket view): "
      "PyTorch's overlap_with_ddp cannot run on Gloo\n\n");
  struct Row {
    const char* ours;
    const char* pytorch;
    std::string label;
  };
  const std::vector<Row> rows{
      {"plain", "plain", "plain"},
      {"bucket_view", "bucket_view", "parameters_as_bucket_view"},
      {"overlap", "best", "overlap_with_ddp (PyTorch: its best)"},
      {"stage2", "best", "stage 2 (PyTorch: its best)"},
  };
  fmt::print("{:<38} {:>22} {:>22} {:>8} {:>10} {:>10} {:>9} {:>9} {:>8} {:>8}\n", "case",
             "ours s (min/med/max)", "pytorch s (min/med/max)", "speedup", "ours step", "pt step",
             "ours cpu", "pt cpu", "ours MB", "pt MB");
  Json cases = Json::array();
  std::vector<std::string> problems;
  for (const Row& row : rows) {
    const auto& o = ours[row.ours];
    const auto& p = pytorch[row.pytorch];
    const Spread ot = spread_of(o, &Run::iteration_s), pt = spread_of(p, &Run::iteration_s);
    const double om = spread_of(o, &Run::peak_mb).median, pm = spread_of(p, &Run::peak_mb).median;
    fmt::print(
        "{:<38} {:>22} {:>22} {:>7.2f}x {:>10.3f} {:>10.3f} {:>9.3f} {:>9.3f} {:>8.0f} {:>8.0f}\n",
        row.label, spread_text(ot, "{:.3f}"), spread_text(pt, "{:.3f}"), pt.median / ot.median,
        spread_of(o, &Run::step_s).median, spread_of(p, &Run::step_s).median,
        spread_of(o, &Run::cpu_s).median, spread_of(p, &Run::cpu_s).median, om, pm);
    cases.push_back({{"case", "iteration, " + row.label},
                     {"ours", ot.median},
                     {"pytorch", pt.median},
                     {"unit", "s"},
                     {"better", "lower"}});
    cases.push_back({{"case", "peak memory, " + row.label},
                     {"ours", om},
                     {"pytorch", pm},
                     {"unit", "MB"},
                     {"better", "lower"}});
    for (const Run& run : o) {
      if (!std::isfinite(run.loss))
        problems.push_back("ours: the loss is not finite in " + row.label);
    }
  }
  // Our two stage-1 cases against the faster of PyTorch's two in each round.
  const double best = spread_of(pytorch["best"], &Run::iteration_s).median;
  fmt::print(
      "\nours against PyTorch's best variant of each round (median {:.3f} s): plain {:.2f}x, "
      "parameters_as_bucket_view {:.2f}x\n",
      best, best / spread_of(ours["plain"], &Run::iteration_s).median,
      best / spread_of(ours["bucket_view"], &Run::iteration_s).median);
  const Spread s1 = spread_of(ours["plain"], &Run::iteration_s);
  const Spread s2 = spread_of(ours["stage2"], &Run::iteration_s);
  fmt::print(
      "ours, stage 2 against stage 1 (plain): iteration {:.3f} s vs {:.3f} s ({:.2f}x), peak "
      "memory {:.0f} MB vs {:.0f} MB (above start {:.0f} vs {:.0f})\n\n",
      s2.median, s1.median, s1.median / s2.median, spread_of(ours["stage2"], &Run::peak_mb).median,
      spread_of(ours["plain"], &Run::peak_mb).median,
      spread_of(ours["stage2"], &Run::peak_above_start_mb).median,
      spread_of(ours["plain"], &Run::peak_above_start_mb).median);
  // Stage 2 against our own stage 1: no PyTorch figure (it has no stage 2).
  const double peak1 = spread_of(ours["plain"], &Run::peak_mb).median;
  const double peak2 = spread_of(ours["stage2"], &Run::peak_mb).median;
  cases.push_back({{"case", "stage 2 over stage 1 (ours), iteration"},
                   {"ours", s1.median / s2.median},
                   {"pytorch", nullptr},
                   {"unit", "x (stage 1 s / stage 2 s)"},
                   {"better", "higher"}});
  cases.push_back({{"case", "stage 2 over stage 1 (ours), peak memory"},
                   {"ours", peak1 / peak2},
                   {"pytorch", nullptr},
                   {"unit", "x (stage 1 MB / stage 2 MB)"},
                   {"better", "higher"}});
  return results_file.write_unless(cases, problems);
}

}  // namespace
}  // namespace bench
}  // namespace distoptim

int main(int argc, char** argv) {
  return distoptim::bench::run_main("zero_bench", distoptim::bench::run, argc, argv);
}
