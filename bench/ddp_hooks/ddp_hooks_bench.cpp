// ddp_hooks_bench: DistributedDataParallel with each communication hook, ours against PyTorch's:
// the iteration time and the bytes each hook hands to the collectives per iteration.
//
// The model: an MLP, Linear(16384, 256), ReLU, 2 x (Linear(256, 256), ReLU), Linear(256, 16)
// (4.33M float32 parameters, 17.3 MB of gradients), batch 32 per rank, on 2 ranks, gloo on
// loopback, 1 intra-op thread per rank, SGD (lr 0.01). Its shape keeps every iteration after the
// first in one DDP bucket on both sides (the Reducer rebuilds its buckets after the first
// iteration, last parameter first, closing the 1 MiB first bucket only at the 4 MB first weight):
// PyTorch 1.13's PowerSGD hooks issue their next collective from inside a callback, and with two
// buckets in flight the two ranks issue them in different orders (gloo then aborts on a size
// mismatch). Each side reports the buckets its hook was called on, so a change of shape that
// splits the bucket shows.
//
// Hooks, ours (comm_hooks.h, power_sgd_hook.h) against PyTorch 1.13's
// (torch.distributed.algorithms.ddp_comm_hooks, bench/ddp_hooks/pytorch_ddp_hooks.py):
//   allreduce               allreduce_hook
//   fp16_compress           fp16_compress_wrapper(allreduce_hook) / fp16_compress_hook
//   bf16_compress           bf16_compress_hook
//   powersgd_rank1          power_sgd_hook, matrix_approximation_rank 1
//   powersgd_rank4          power_sgd_hook, matrix_approximation_rank 4
//   batched_powersgd_rank4  batched_power_sgd_hook, matrix_approximation_rank 4
//   noop                    noop_hook (no communication: the headroom)
// PowerSGD at PyTorch's defaults (error feedback, warm start, min_compression_rate 2,
// random_seed 0) but start_powerSGD_iter 2, so every timed iteration compresses (warm-up 5).
// PyTorch's side needs the stand-ins of tests/data_parallel/reference/comm_hooks_reference.py:
// bf16_compress_hook registered under another name (DDP refuses it without CUDA), its bfloat16
// all_reduce summed in float32 (gloo cannot sum bfloat16: on the wire 4 bytes an element where
// ours all-gathers 2), and batched_powerSGD_hook's 2-D factors orthogonalized as a batch of one.
//
// Time: zero_grad + forward + backward (with the hook) + SGD step, each iteration after a barrier;
// a run's figure is the slower rank's mean over the timed iterations (after warm-up ones).
// Bytes: the bytes of the tensors the hook hands to allreduce and allgather during the timed
// iterations, per iteration, per rank (both ranks must agree). Ours: the hooks get a comm::Group
// over a c10d::ProcessGroup that counts them and forwards to the world's Gloo group; PyTorch's:
// dist.all_reduce and dist.all_gather wrapped (the hooks call nothing else). What Gloo itself puts
// on the wire for them is not counted.
//
// Rounds: each round runs, per hook, ours then PyTorch's (each a fresh pair of processes), so the
// machine's drift falls on both sides alike; the table gives each side's min/median/max over the
// rounds and the ratio of the medians, with the load average before and after. Settings as
// bench/zero: PyTorch's ranks with OMP_NUM_THREADS=1 and OPENBLAS_THREAD_TIMEOUT=4, ours under
// distrun at its defaults (which set both).
//
// The JSON written to --json holds, under "cases", rows {case, ours, pytorch, ours_min, ours_max,
// pytorch_min, pytorch_max, rounds, unit, better} (common/report.h) for every hook's iteration
// time and bytes, and one row {case: "settings", settings}.
//
// Usage: ddp_hooks_bench --json PATH [--rounds 3] [--iterations 20] [--warmup 5] [--batch 32]
//                        [--input 16384] [--hidden 256] [--hidden-layers 2] [--output 16]
//                        [--start-powersgd-iter 2] [--hooks a,b,...]

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

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
constexpr double kLearningRate = 0.01;

const std::vector<std::string> kHooks{
    "allreduce",      "fp16_compress",          "bf16_compress", "powersgd_rank1",
    "powersgd_rank4", "batched_powersgd_rank4", "noop"};

struct Config {
  int64_t input = 16384;
  int64_t hidden = 256;
  int hidden_layers = 2;
  int64_t output = 16;
  int64_t batch = 32;
  int warmup = 5;
  int iterations = 20;
  int start_power_sgd_iter = 2;
  int rounds = 3;
  int deadline_seconds = 300;
  std::vector<std::string> hooks = kHooks;
};

// --- a rank of ours ------------------------------------------------------------------------------

// What the hooks hand to the collectives while `on` is set. Atomic: PowerSGD chains its
// collectives from callbacks on the group's threads.
struct Counter {
  std::atomic<bool> on{false};
  std::atomic<int64_t> allreduce_bytes{0};
  std::atomic<int64_t> allgather_bytes{0};
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> buckets{0};
};

int64_t bytes_of(const std::vector<at::Tensor>& tensors) {
  int64_t bytes = 0;
  for (const at::Tensor& t : tensors) bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

// A c10d::ProcessGroup that counts the bytes of the tensors handed to its allreduce and
// allgather (the input) and forwards everything the hooks use to `inner`.
class CountingProcessGroup : public c10d::ProcessGroup {
 public:
  CountingProcessGroup(c10::intrusive_ptr<c10d::ProcessGroup> inner, Counter& counter)
      : c10d::ProcessGroup(inner->getRank(), inner->getSize()),
        inner_(std::move(inner)),
        counter_(counter) {}

  const std::string getBackendName() const override { return inner_->getBackendName(); }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    if (counter_.on) {
      counter_.allreduce_bytes += bytes_of(tensors);
      ++counter_.calls;
    }
    return inner_->allreduce(tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    if (counter_.on) {
      counter_.allgather_bytes += bytes_of(inputs);
      ++counter_.calls;
    }
    return inner_->allgather(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    return inner_->broadcast(tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return inner_->barrier(opts);
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> inner_;
  Counter& counter_;
};

// Counts the buckets `hook` is called on and runs it.
class CountingHook : public c10d::CommHookInterface {
 public:
  CountingHook(std::unique_ptr<c10d::CommHookInterface> hook, Counter& counter)
      : hook_(std::move(hook)), counter_(counter) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    if (counter_.on) ++counter_.buckets;
    return hook_->runHook(bucket);
  }
  at::Tensor parseHookResult(const c10::IValue& result) override {
    return hook_->parseHookResult(result);
  }

 private:
  std::unique_ptr<c10d::CommHookInterface> hook_;
  Counter& counter_;
};

std::unique_ptr<c10d::CommHookInterface> make_hook(const std::string& name,
                                                   const comm::Group& group, const Config& config) {
  namespace dp = data_parallel;
  auto power = [&](int64_t rank) {
    return std::make_shared<dp::PowerSGDState>(
        group, dp::PowerSGDOptions()
                   .matrix_approximation_rank(rank)
                   .start_power_sgd_iter(config.start_power_sgd_iter)
                   .random_seed(0));
  };
  if (name == "allreduce") return dp::allreduce_hook(group);
  if (name == "fp16_compress") return dp::fp16_compress_wrapper(dp::allreduce_hook(group));
  if (name == "bf16_compress") return dp::bf16_compress_hook(group);
  if (name == "powersgd_rank1") return dp::power_sgd_hook(power(1));
  if (name == "powersgd_rank4") return dp::power_sgd_hook(power(4));
  if (name == "batched_powersgd_rank4") return dp::batched_power_sgd_hook(power(4));
  if (name == "noop") return dp::noop_hook();
  TORCH_CHECK_VALUE(false, "ddp_hooks_bench: unknown hook '", name, "'");
}

torch::nn::Sequential make_model(const Config& config) {
  torch::nn::Sequential model;
  model->push_back(torch::nn::Linear(config.input, config.hidden));
  model->push_back(torch::nn::ReLU());
  for (int i = 0; i < config.hidden_layers; ++i) {
    model->push_back(torch::nn::Linear(config.hidden, config.hidden));
    model->push_back(torch::nn::ReLU());
  }
  model->push_back(torch::nn::Linear(config.hidden, config.output));
  return model;
}

// Trains as pytorch_ddp_hooks.py's run_rank does and prints the same RESULT line.
void run_worker(const Config& config, const std::string& hook) {
  torch::set_num_threads(kThreadsPerRank);
  comm::init_process_group();
  const comm::Group& world = comm::world();
  Counter counter;
  const comm::Group counted(
      c10::make_intrusive<CountingProcessGroup>(world.process_group(), counter), world.ranks(),
      comm::get_rank(), world.timeout());
  torch::manual_seed(0);
  torch::nn::Sequential model = make_model(config);
  data_parallel::DistributedDataParallel<torch::nn::Sequential> ddp(model);
  ddp.register_comm_hook(std::make_unique<CountingHook>(make_hook(hook, counted, config), counter));
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(kLearningRate));
  const int rank = comm::get_rank();
  torch::manual_seed(1 + rank);
  const at::Tensor x = torch::randn({config.batch, config.input});
  const at::Tensor y = torch::randn({config.batch, config.output});
  std::vector<double> times;
  double loss_value = 0;
  for (int iteration = 0; iteration < config.warmup + config.iterations; ++iteration) {
    world.barrier();
    counter.on = iteration >= config.warmup;
    const auto begin = Clock::now();
    optimizer.zero_grad();
    const at::Tensor loss = torch::mse_loss(ddp.forward(x), y);
    loss.backward();
    optimizer.step();
    const auto end = Clock::now();
    counter.on = false;
    loss_value = loss.item<double>();
    if (iteration >= config.warmup) {
      times.push_back(std::chrono::duration<double>(end - begin).count());
    }
  }
  int64_t parameters = 0;
  for (const at::Tensor& p : model->parameters()) parameters += p.numel();
  print_result({{"rank", rank},
                {"times", times},
                {"allreduce_bytes", counter.allreduce_bytes.load()},
                {"allgather_bytes", counter.allgather_bytes.load()},
                {"calls", counter.calls.load()},
                {"buckets", counter.buckets.load()},
                {"blas_threads", blas_threads()},
                {"intra_op_threads", at::get_num_threads()},
                {"loss", loss_value},
                {"parameters", parameters}});
  world.barrier();
  comm::destroy_process_group();
}

// --- the driver ----------------------------------------------------------------------------------

// One run of one side with one hook.
struct Run {
  double iteration_ms = 0;  // the slower rank's mean
  double bytes = 0;         // per timed iteration, per rank
  double calls = 0;         // collectives per iteration
  double buckets = 0;       // hook calls per iteration
  int64_t parameters = 0;
  int blas_threads = 0;
  int intra_op_threads = 0;
  double loss = 0;
  std::string torch_version;  // PyTorch's side only
};

Run parse_run(const std::string& what, const std::vector<Json>& ranks, const Config& config,
              std::vector<std::string>& problems) {
  TORCH_CHECK(ranks.size() == kWorldSize, "ddp_hooks_bench: ", what, " reported ", ranks.size(),
              " of ", kWorldSize, " ranks");
  Run run;
  std::vector<double> bytes;
  for (const auto& r : ranks) {
    const auto times = r.at("times").get<std::vector<double>>();
    TORCH_CHECK(times.size() == static_cast<size_t>(config.iterations), "ddp_hooks_bench: ", what,
                " timed ", times.size(), " iterations");
    double sum = 0;
    for (double t : times) sum += t;
    run.iteration_ms = std::max(run.iteration_ms, sum / times.size() * 1e3);
    bytes.push_back(static_cast<double>(r.at("allreduce_bytes").get<int64_t>() +
                                        r.at("allgather_bytes").get<int64_t>()) /
                    config.iterations);
    run.calls = static_cast<double>(r.at("calls").get<int64_t>()) / config.iterations;
    run.buckets = static_cast<double>(r.at("buckets").get<int64_t>()) / config.iterations;
    run.parameters = r.at("parameters").get<int64_t>();
    run.blas_threads = r.at("blas_threads").get<int>();
    run.intra_op_threads = r.at("intra_op_threads").get<int>();
    run.loss = r.at("loss").get<double>();
    run.torch_version = r.value("torch_version", "");
  }
  run.bytes = bytes.front();
  if (bytes.front() != bytes.back()) {
    problems.push_back(fmt::format("{}: the ranks handed different bytes: {} and {}", what,
                                   bytes.front(), bytes.back()));
  }
  if (!std::isfinite(run.loss)) problems.push_back(what + ": the loss is not finite");
  return run;
}

const char* env_or(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : fallback;
}

std::vector<std::string> shared_args(const Config& config) {
  return {"--input",
          std::to_string(config.input),
          "--hidden",
          std::to_string(config.hidden),
          "--hidden-layers",
          std::to_string(config.hidden_layers),
          "--output",
          std::to_string(config.output),
          "--batch",
          std::to_string(config.batch),
          "--warmup",
          std::to_string(config.warmup),
          "--iterations",
          std::to_string(config.iterations),
          "--start-powersgd-iter",
          std::to_string(config.start_power_sgd_iter)};
}

Run run_ours(const Config& config, const std::string& hook, std::vector<std::string>& problems) {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::vector<std::string> argv{DISTOPTIM_DISTRUN_PATH,
                                "--nproc-per-node",
                                std::to_string(kWorldSize),
                                self,
                                "--worker",
                                "--hook",
                                hook};
  for (auto& arg : shared_args(config)) argv.push_back(std::move(arg));
  const std::string what = "our ranks (" + hook + ")";
  return parse_run(what, run_side(what, argv, config.deadline_seconds), config, problems);
}

Run run_pytorch(const Config& config, const std::string& hook, const std::string& python,
                const std::string& script, std::vector<std::string>& problems) {
  // What torchrun gives ranks sharing a machine (OMP_NUM_THREADS=1) and distrun's OpenBLAS
  // setting: ours get both from distrun.
  std::vector<std::string> argv{
      "/usr/bin/env",
      "OMP_NUM_THREADS=" + std::string(env_or("OMP_NUM_THREADS", "1")),
      "OPENBLAS_THREAD_TIMEOUT=" + std::string(env_or("OPENBLAS_THREAD_TIMEOUT", "4")),
      python,
      script,
      "--hook",
      hook,
      "--threads",
      std::to_string(kThreadsPerRank),
      "--world-size",
      std::to_string(kWorldSize)};
  for (auto& arg : shared_args(config)) argv.push_back(std::move(arg));
  const std::string what = "PyTorch's ranks (" + hook + ")";
  return parse_run(what, run_side(what, argv, config.deadline_seconds), config, problems);
}

Spread spread_over(const std::vector<Run>& runs, double Run::*field) {
  std::vector<double> values;
  for (const Run& run : runs) values.push_back(run.*field);
  return spread_of(values);
}

std::string spread_text(const Spread& s, int decimals) {
  return fmt::format("{:.{}f}/{:.{}f}/{:.{}f}", s.min, decimals, s.median, decimals, s.max,
                     decimals);
}

std::string ratio_text(double numerator, double denominator) {
  return denominator > 0 && numerator > 0 ? fmt::format("{:.2f}x", numerator / denominator) : "-";
}

int run(int argc, char** argv) {
  Config config;
  std::string json_path;
  bool worker = false;
  std::string hook = "allreduce";
  std::string python = DISTOPTIM_REFERENCE_PYTHON;
  std::string script = DISTOPTIM_PYTORCH_DDP_HOOKS_SCRIPT;
  CLI::App app{"DDP communication hooks benchmark: ours against PyTorch's on 2 ranks"};
  app.add_option("--json", json_path, "Write the results as JSON to this file");
  app.add_option("--rounds", config.rounds, "rounds of every hook, ours and PyTorch's alternating")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--iterations", config.iterations, "timed iterations per run (mean kept)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", config.warmup, "untimed iterations first")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--input", config.input, "in features of the first Linear")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--hidden", config.hidden, "hidden width")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--hidden-layers", config.hidden_layers, "Linear(hidden, hidden) layers")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--output", config.output, "out features of the last Linear")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--batch", config.batch, "rows per rank")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--start-powersgd-iter", config.start_power_sgd_iter,
                 "PowerSGD's start_powerSGD_iter (at least 2)")
      ->capture_default_str()
      ->check(CLI::Range(2, 1 << 30));
  app.add_option("--hooks", config.hooks, "hooks to run, comma-separated")
      ->delimiter(',')
      ->check(CLI::IsMember(kHooks));
  app.add_option("--deadline-seconds", config.deadline_seconds, "each run is killed past this")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--python", python, "Python with PyTorch 1.13")->capture_default_str();
  app.add_option("--pytorch-script", script, "pytorch_ddp_hooks.py")->capture_default_str();
  app.add_flag("--worker", worker, "Run as one of our ranks (started by the benchmark itself)");
  app.add_option("--hook", hook, "With --worker: the hook")->check(CLI::IsMember(kHooks));
  CLI11_PARSE(app, argc, argv);

  if (worker) {
    run_worker(config, hook);
    return 0;
  }
  ResultsFile results_file(json_path, "ddp_hooks_bench");
  const double load_at_start = load_average();
  std::vector<std::string> problems;
  std::map<std::string, std::vector<Run>> ours, pytorch;
  for (int round = 0; round < config.rounds; ++round) {
    for (const std::string& name : config.hooks) {
      fmt::print(stderr, "ddp_hooks_bench: round {}, {}: ours...", round + 1, name);
      ours[name].push_back(run_ours(config, name, problems));
      fmt::print(stderr, " {:.1f} ms; pytorch...", ours[name].back().iteration_ms);
      pytorch[name].push_back(run_pytorch(config, name, python, script, problems));
      fmt::print(stderr, " {:.1f} ms\n", pytorch[name].back().iteration_ms);
    }
  }
  const double load_at_end = load_average();

  const Run& first_ours = ours[config.hooks.front()].front();
  const Run& first_pytorch = pytorch[config.hooks.front()].front();
  const std::string settings = fmt::format(
      "MLP Linear({}, {}), ReLU, {} x (Linear({}, {}), ReLU), Linear({}, {}): {} float32 "
      "parameters, batch {} per rank; {} ranks (gloo, loopback), {} intra-op thread per rank; DDP "
      "at its defaults (bucket_cap_mb 25) with the hook; SGD lr {}; PowerSGD "
      "start_powerSGD_iter {}, random_seed 0, the rest at PyTorch's defaults; {} warm-up and {} "
      "timed iterations per run, the slower rank's mean; {} rounds, ours and PyTorch {} "
      "alternating per hook",
      config.input, config.hidden, config.hidden_layers, config.hidden, config.hidden,
      config.hidden, config.output, first_ours.parameters, config.batch, kWorldSize,
      kThreadsPerRank, kLearningRate, config.start_power_sgd_iter, config.warmup, config.iterations,
      config.rounds, first_pytorch.torch_version);
  fmt::print("\nddp_hooks_bench: {}\n", settings);
  fmt::print(
      "threads per rank: intra-op ours {} / pytorch {}; OpenBLAS's own (-1: not OpenBLAS) ours {} "
      "/ pytorch {}; PyTorch's ranks run with OMP_NUM_THREADS={} and OPENBLAS_THREAD_TIMEOUT={}, "
      "ours with distrun's defaults\n",
      first_ours.intra_op_threads, first_pytorch.intra_op_threads, first_ours.blas_threads,
      first_pytorch.blas_threads, env_or("OMP_NUM_THREADS", "1"),
      env_or("OPENBLAS_THREAD_TIMEOUT", "4"));
  fmt::print(
      "bytes: of the tensors each hook hands to allreduce and allgather (allgather: its input) "
      "per timed iteration per rank, counted on both sides (ours: a counting c10d::ProcessGroup "
      "under the hook's group; PyTorch's: dist.all_reduce and dist.all_gather wrapped); PyTorch's "
      "bf16 stand-in then sums in float32 (4 bytes an element on the wire)\n");
  fmt::print("{}\n", machine_load_line(load_at_start, load_at_end));
  if (first_ours.parameters != first_pytorch.parameters) {
    problems.push_back(fmt::format("the models differ: {} parameters ours, {} PyTorch's",
                                   first_ours.parameters, first_pytorch.parameters));
  }

  fmt::print("\n{:<24} {:>22} {:>22} {:>8} {:>12} {:>12} {:>7} {:>13} {:>13}\n", "hook",
             "ours ms (min/med/max)", "pytorch ms (min/med/max)", "speedup", "ours bytes",
             "pytorch bytes", "ratio", "buckets o/pt", "calls o/pt");
  Json cases = Json::array();
  for (const std::string& name : config.hooks) {
    const auto& o = ours[name];
    const auto& p = pytorch[name];
    const Spread ot = spread_over(o, &Run::iteration_ms), pt = spread_over(p, &Run::iteration_ms);
    const Spread ob = spread_over(o, &Run::bytes), pb = spread_over(p, &Run::bytes);
    fmt::print(
        "{:<24} {:>22} {:>22} {:>8} {:>12.0f} {:>12.0f} {:>7} {:>6.1f}/{:<6.1f} "
        "{:>6.1f}/{:<6.1f}\n",
        name, spread_text(ot, 1), spread_text(pt, 1), ratio_text(pt.median, ot.median), ob.median,
        pb.median, ratio_text(ob.median, pb.median), spread_over(o, &Run::buckets).median,
        spread_over(p, &Run::buckets).median, spread_over(o, &Run::calls).median,
        spread_over(p, &Run::calls).median);
    cases.push_back(comparison_row("iteration, " + name, ot, pt, config.rounds, "ms", true));
    const Spread ob_mb{ob.min / 1e6, ob.median / 1e6, ob.max / 1e6};
    const Spread pb_mb{pb.min / 1e6, pb.median / 1e6, pb.max / 1e6};
    cases.push_back(comparison_row("bytes sent per iteration, " + name, ob_mb, pb_mb, config.rounds,
                                   "MB", true));
  }
  cases.push_back({{"case", "settings"}, {"settings", settings}});
  fmt::print(
      "\nspeedup: PyTorch's median time over ours; ratio: our bytes over PyTorch's; buckets and "
      "calls: the hook's calls and its collectives per iteration, ours / PyTorch's\n\n");
  return results_file.write_unless(cases, problems);
}

}  // namespace
}  // namespace bench
}  // namespace distoptim

int main(int argc, char** argv) {
  return distoptim::bench::run_main("ddp_hooks_bench", distoptim::bench::run, argc, argv);
}
