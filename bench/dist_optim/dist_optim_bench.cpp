// dist_optim_bench: distoptim's DistributedOptimizer against PyTorch 1.13's
// torch.distributed.optim.DistributedOptimizer (TensorPipe RPC backend, CPU), in one run.
//
// Each side is a job of 3 worker processes on loopback: worker0 measures, worker1 and worker2
// own parameters and serve. Ours are this program again (`--worker`), started by distrun;
// PyTorch's run pytorch_dist_optim.py under the system Python, which spawns its own 3 workers.
// worker0 of each side prints one "RESULT {json}" line with the same keys. Every time is a
// median over the timed iterations, after warm-up ones:
//   doc step (us): the DistributedOptimizer's documented example. Two parameters made on worker1
//     by an add (ones(2) + 3 and ones(2) + 1), leaves that require grad there (the documented
//     example's add results do not, and PyTorch's backward then fails), each held by the RRef of
//     a remote() call; one DistributedOptimizer, SGD lr 0.05, over both. An iteration: a context,
//     loss = (to_here() + to_here()).sum(), the distributed backward, then step(context), timed
//     alone. Both sides check the parameters afterwards: every step subtracts 0.05.
//   10M adam step (ms): 10M float32 parameters, kAdamTensors tensors on each of worker1 and
//     worker2 (5M per owner), Adam at its defaults (lr 0.001). An iteration: a context, one
//     rpc_sync per owner returning the sum of its parameters, the backward of their sum (every
//     parameter gets a gradient on its owner), then step(context), timed alone.
//   rnn tokens/s: PyTorch's RNN parameter-server tutorial at ntoken 10000, ninp = nhid = 256, 2
//     LSTM layers, dropout 0.5, batch 20, bptt 35, random tokens: the embedding table and the
//     decoder live on worker1 (the "ps") as remote objects, the LSTM on worker0 (the trainer);
//     DistributedOptimizer SGD lr 0.05 over all parameters (owners: ps and trainer). Ours is
//     examples/rnn_parameter_server's model (rnn_ps_model); PyTorch's the tutorial's, written in
//     the script. An iteration: a context, forward through the RPCs, cross-entropy, the
//     distributed backward, step, the context's release. tokens/s: bptt * batch tokens per
//     timed iteration over their summed time.
//   rnn overhead (ms): the median iteration of the rnn case minus the median iteration of the
//     same modules trained in one process by the same framework: forward, loss.backward(), an
//     SGD step (ours: distoptim's functional "sgd", which the DistributedOptimizer runs on each
//     owner; PyTorch's: torch.optim.SGD), gradients then set to none (so every backward makes
//     fresh ones, as every distributed context does). That baseline runs after the job, in a
//     process of its own without RPC (`--local`; the script's --local), with the same warm-up
//     and timed iterations: run in the trainer, it would share the 2 cores with the job's other
//     workers (PyTorch's idle RPC workers take about 2/3 of a core each here, bench/rpc's idle
//     case; its local iteration took 2-3 times as long there). The table shows each side's
//     medians and the distributed iteration's phases.
//
// Settings, both sides: kIntraOpThreads intra-op thread per process (at::set_num_threads /
// torch.set_num_threads), 16 RPC worker threads (PyTorch's default, set explicitly), a 60 s RPC
// timeout; PyTorch at its defaults otherwise. Matrix products go to the system BLAS, the same
// library for both (Debian's OpenBLAS here), which keeps threads of its own whatever the
// intra-op setting: each side reports how many (openblas_get_num_threads, -1 for another BLAS).
// The table states them all.
//
// Every wait is bounded: RPCs carry timeouts, and each side runs under timeout(1) (run_side),
// which kills its whole process group past --deadline-seconds. SIGINT or SIGTERM to this
// program is forwarded to the running side's process group (run_child), so Ctrl-C stops the
// children too.
//
// Ours and PyTorch's jobs alternate in --rounds rounds (ours, PyTorch's, ours, ...), so drift in
// the shared machine's load reaches both alike; each figure is reported as min/median/max over
// the rounds.
//
// The JSON written to --json holds, under "cases", a list of {case, ours, pytorch, unit,
// better, ours_min, ours_max, pytorch_min, pytorch_max, rounds}, ours and pytorch being medians
// over the rounds and better "lower" or "higher", and the load average (common/report.h).
//
// Usage: dist_optim_bench --json PATH [--rounds 3] [--iterations N] [--quick]
//                         [--deadline-seconds N]

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/core.h>
#include <torch/nn/functional/loss.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <distoptim/comm/rendezvous.h>
#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/optim/registry.h>
#include <distoptim/rpc.h>

#include "../common/report.h"
#include "rnn_model.h"

namespace distoptim {
namespace bench {
namespace {

namespace rpc = distoptim::rpc;
using dist_autograd::ContextGuard;
using dist_optim::DistributedOptimizer;
using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr int kWorldSize = 3;
constexpr int kIntraOpThreads = 1;
constexpr int kRpcThreads = 16;
constexpr auto kRpcTimeout = 60s;

constexpr double kDocLr = 0.05;
constexpr double kAdamLr = 0.001;    // Adam's default
constexpr int64_t kAdamTensors = 4;  // per owner
constexpr int64_t kAdamFloatsPerOwner = 5'000'000;
constexpr int64_t kRnnTokens = 10000;
constexpr int64_t kRnnWidth = 256;  // ninp = nhid
constexpr int64_t kRnnLayers = 2;
constexpr double kRnnDropout = 0.5;
constexpr int64_t kRnnBatch = 20;
constexpr int64_t kRnnBptt = 35;
constexpr double kRnnLr = 0.05;

// Warm-up and timed iterations of each case.
struct Counts {
  int warmup;
  int timed;
};

struct Config {
  Counts doc{50, 500};
  Counts adam{3, 20};
  Counts rnn{5, 60};
  int deadline_seconds = 240;
};

std::string worker_name(int rank) { return "worker" + std::to_string(rank); }

double seconds_since(Clock::time_point from) {
  return std::chrono::duration<double>(Clock::now() - from).count();
}

// --- what the owners run ---------------------------------------------------------------------

// The documented example's add, its result made a parameter of its owner.
DISTOPTIM_RPC_FUNCTION("bench.add_parameter", [](const at::Tensor& tensor, double scalar) {
  return at::add(tensor, scalar).requires_grad_();
});

at::Tensor initial_parameter(int64_t numel, int64_t seed) {
  auto generator = at::detail::createCPUGenerator(static_cast<uint64_t>(seed));
  return at::randn({numel}, generator);
}
DISTOPTIM_RPC_FUNCTION("bench.make_parameter", [](int64_t numel, int64_t seed) {
  return initial_parameter(numel, seed).requires_grad_();
});

// The sum of the caller's parameters on this owner: backward through it gives each a gradient.
DISTOPTIM_RPC_FUNCTION("bench.sum_parameters",
                       [](const std::vector<rpc::RRef<at::Tensor>>& params) {
                         at::Tensor sum = at::zeros({});
                         for (const auto& param : params) sum = sum + param.local_value().sum();
                         return sum;
                       });

// --- worker0's measurements ------------------------------------------------------------------

void measure_doc_step(const Config& config, Json& result) {
  auto rref1 =
      rpc::remote<at::Tensor>("worker1", "bench.add_parameter", std::tuple{at::ones({2}), 3.0});
  auto rref2 =
      rpc::remote<at::Tensor>("worker1", "bench.add_parameter", std::tuple{at::ones({2}), 1.0});
  DistributedOptimizer optimizer("sgd", {rref1, rref2}, optim::OptionBag().set("lr", kDocLr));
  std::vector<double> step_us;
  for (int i = 0; i < config.doc.warmup + config.doc.timed; ++i) {
    ContextGuard context;
    const at::Tensor loss = rref1.to_here() + rref2.to_here();
    dist_autograd::backward(context.id(), {loss.sum()});
    const auto begin = Clock::now();
    optimizer.step(context.id());
    if (i >= config.doc.warmup) step_us.push_back(seconds_since(begin) * 1e6);
  }
  result["doc_step_us"] = median(step_us);
  // Every step subtracts lr * 1 from each element of 4 and of 2.
  const double taken = kDocLr * (config.doc.warmup + config.doc.timed);
  const bool ok = at::allclose(rref1.to_here().detach(), at::full({2}, 4.0 - taken), 1e-4, 1e-3) &&
                  at::allclose(rref2.to_here().detach(), at::full({2}, 2.0 - taken), 1e-4, 1e-3);
  result["doc_parameters_ok"] = ok;
}

void measure_adam_step(const Config& config, Json& result) {
  const int64_t numel = kAdamFloatsPerOwner / kAdamTensors;
  std::vector<std::vector<rpc::RRef<at::Tensor>>> by_owner(2);
  std::vector<rpc::RRef<at::Tensor>> all;
  for (int owner = 1; owner <= 2; ++owner) {
    for (int64_t t = 0; t < kAdamTensors; ++t) {
      by_owner[owner - 1].push_back(rpc::remote<at::Tensor>(
          worker_name(owner), "bench.make_parameter", std::tuple{numel, owner * 100 + t}));
      all.push_back(by_owner[owner - 1].back());
    }
  }
  DistributedOptimizer optimizer("adam", all, optim::OptionBag().set("lr", kAdamLr));
  std::vector<double> step_ms;
  for (int i = 0; i < config.adam.warmup + config.adam.timed; ++i) {
    ContextGuard context;
    at::Tensor loss = at::zeros({});
    for (int owner = 1; owner <= 2; ++owner) {
      loss = loss + rpc::rpc_sync<at::Tensor>(worker_name(owner), "bench.sum_parameters",
                                              std::tuple{by_owner[owner - 1]});
    }
    dist_autograd::backward(context.id(), {loss});
    const auto begin = Clock::now();
    optimizer.step(context.id());
    if (i >= config.adam.warmup) step_ms.push_back(seconds_since(begin) * 1e3);
  }
  result["adam_step_ms"] = median(step_ms);
  // A gradient of ones every step moves every element by lr (Adam's bias-corrected moments are
  // 1 then): check the last tensor of worker2.
  const double moved = kAdamLr * (config.adam.warmup + config.adam.timed);
  result["adam_parameters_ok"] =
      at::allclose(all.back().to_here().detach(),
                   initial_parameter(numel, 2 * 100 + kAdamTensors - 1) - moved, 0, 1e-4);
  result["adam_parameters"] = kAdamFloatsPerOwner * 2;
}

rnn_ps::ModelOptions rnn_options() {
  rnn_ps::ModelOptions options;
  options.ntoken = kRnnTokens;
  options.ninp = kRnnWidth;
  options.nhid = kRnnWidth;
  options.nlayers = kRnnLayers;
  options.dropout = kRnnDropout;
  return options;
}

// Random tokens: the input (bptt x batch) and the flattened targets.
std::pair<at::Tensor, at::Tensor> rnn_batch() {
  return {at::randint(kRnnTokens, {kRnnBptt, kRnnBatch}, at::kLong),
          at::randint(kRnnTokens, {kRnnBptt * kRnnBatch}, at::kLong)};
}

at::Tensor rnn_loss(const at::Tensor& output, const at::Tensor& target) {
  return torch::nn::functional::cross_entropy(output.view({-1, kRnnTokens}), target);
}

using Hidden = rnn_ps::RNNModel::Hidden;

Hidden detached(const Hidden& hidden) {
  return {std::get<0>(hidden).detach(), std::get<1>(hidden).detach()};
}

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// The parameter-server model and its DistributedOptimizer, trained one iteration at a time.
class DistributedRnn {
 public:
  DistributedRnn()
      : model_("worker1", rnn_options()),
        optimizer_("sgd", model_.parameter_rrefs(), optim::OptionBag().set("lr", kRnnLr)),
        hidden_(model_.init_hidden(kRnnBatch)) {}

  // Seconds of the forward (to the loss), the backward and the step, and of all of the
  // iteration (the context's release included).
  struct Times {
    double forward, backward, step, total;
  };
  Times iteration(const at::Tensor& input, const at::Tensor& target) {
    // The hidden state carries over, its history does not (the tutorial's detach).
    hidden_ = detached(hidden_);
    const auto begin = Clock::now();
    Clock::time_point forward_end, backward_end, step_end;
    {
      ContextGuard context;
      auto [output, next] = model_.forward(input, hidden_);
      hidden_ = next;
      const at::Tensor loss = rnn_loss(output, target);
      forward_end = Clock::now();
      dist_autograd::backward(context.id(), {loss});
      backward_end = Clock::now();
      optimizer_.step(context.id());
      step_end = Clock::now();
      last_loss = loss.item<double>();
    }
    return {seconds_between(begin, forward_end), seconds_between(forward_end, backward_end),
            seconds_between(backward_end, step_end), seconds_since(begin)};
  }
  double last_loss = 0;

 private:
  rnn_ps::RNNModel model_;
  DistributedOptimizer optimizer_;
  Hidden hidden_;
};

// The same modules, sizes and step in this process alone.
class LocalRnn {
 public:
  LocalRnn()
      : embedding_(kRnnTokens, kRnnWidth, kRnnDropout, 1),
        lstm_(torch::nn::LSTMOptions(kRnnWidth, kRnnWidth)
                  .num_layers(kRnnLayers)
                  .dropout(kRnnDropout)),
        decoder_(kRnnTokens, kRnnWidth, kRnnDropout, 2),
        hidden_(at::zeros({kRnnLayers, kRnnBatch, kRnnWidth}),
                at::zeros({kRnnLayers, kRnnBatch, kRnnWidth})) {
    params_ = embedding_.parameters();
    for (const auto& p : lstm_->parameters()) params_.push_back(p);
    for (const auto& p : decoder_.parameters()) params_.push_back(p);
    sgd_ = optim::create_optimizer("sgd", {optim::ParamGroup(params_)},
                                   optim::OptionBag().set("lr", kRnnLr));
  }

  // Seconds of the forward (to the loss), the backward, the step and the whole iteration.
  DistributedRnn::Times iteration(const at::Tensor& input, const at::Tensor& target) {
    hidden_ = detached(hidden_);
    const auto begin = Clock::now();
    auto [output, next] = lstm_->forward(embedding_.forward(input), hidden_);
    hidden_ = next;
    const at::Tensor loss = rnn_loss(decoder_.forward(output), target);
    const auto forward_end = Clock::now();
    loss.backward();
    const auto backward_end = Clock::now();
    std::vector<at::Tensor> grads;
    for (auto& p : params_) grads.push_back(p.grad());
    sgd_->step(grads);
    for (auto& p : params_) p.mutable_grad().reset();
    const auto step_end = Clock::now();
    return {seconds_between(begin, forward_end), seconds_between(forward_end, backward_end),
            seconds_between(backward_end, step_end), seconds_since(begin)};
  }

 private:
  rnn_ps::EmbeddingTable embedding_;
  torch::nn::LSTM lstm_;
  rnn_ps::Decoder decoder_;
  Hidden hidden_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<optim::FunctionalOptimizer> sgd_;
};

// The seconds of each timed iteration of `model` (DistributedRnn or LocalRnn), phase by phase:
// total, forward, backward, step.
template <class Model>
std::array<std::vector<double>, 4> timed_iterations(Model& model, const Config& config) {
  std::array<std::vector<double>, 4> seconds;
  for (int i = 0; i < config.rnn.warmup + config.rnn.timed; ++i) {
    const auto [input, target] = rnn_batch();
    const DistributedRnn::Times times = model.iteration(input, target);
    if (i < config.rnn.warmup) continue;
    seconds[0].push_back(times.total);
    seconds[1].push_back(times.forward);
    seconds[2].push_back(times.backward);
    seconds[3].push_back(times.step);
  }
  return seconds;
}

void measure_rnn(const Config& config, Json& result) {
  DistributedRnn distributed;
  const auto [total_s, forward_s, backward_s, step_s] = timed_iterations(distributed, config);
  double sum_s = 0;
  for (double s : total_s) sum_s += s;
  result["rnn_tokens_per_s"] = kRnnBptt * kRnnBatch * total_s.size() / sum_s;
  result["rnn_iteration_ms"] = median(total_s) * 1e3;
  result["rnn_forward_ms"] = median(forward_s) * 1e3;
  result["rnn_backward_ms"] = median(backward_s) * 1e3;
  result["rnn_step_ms"] = median(step_s) * 1e3;
  result["rnn_last_loss"] = distributed.last_loss;
}

// Run in a process of its own, without RPC (--local).
void run_local(const Config& config) {
  at::set_num_threads(kIntraOpThreads);
  LocalRnn local;
  const auto [total_s, forward_s, backward_s, step_s] = timed_iterations(local, config);
  print_result({{"local_rnn_iteration_ms", median(total_s) * 1e3},
                {"local_rnn_forward_ms", median(forward_s) * 1e3},
                {"local_rnn_backward_ms", median(backward_s) * 1e3},
                {"local_rnn_step_ms", median(step_s) * 1e3},
                {"local_intra_op_threads", at::get_num_threads()}});
}

void run_worker(const Config& config) {
  const comm::LaunchEnv env = comm::LaunchEnv::from_environment();
  TORCH_CHECK(env.rank && env.world_size == kWorldSize,
              "--worker: start it with distrun --nproc-per-node ", kWorldSize);
  at::set_num_threads(kIntraOpThreads);
  rpc::init_rpc(worker_name(*env.rank), *env.rank, *env.world_size,
                rpc::RpcBackendOptions("env://")
                    .num_worker_threads(kRpcThreads)
                    .rpc_timeout(kRpcTimeout)
                    .init_timeout(60s)
                    .shutdown_timeout(std::chrono::seconds(config.deadline_seconds))
                    .launch_env(env));
  if (*env.rank == 0) {
    Json result{{"intra_op_threads", at::get_num_threads()},
                {"interop_threads", at::get_num_interop_threads()},
                {"blas_threads", blas_threads()}};
    measure_doc_step(config, result);
    measure_adam_step(config, result);
    measure_rnn(config, result);
    print_result(result);
  }
  rpc::shutdown();
}

// --- the driver ------------------------------------------------------------------------------

struct Row {
  const char* name;  // the case, as the JSON names it
  const char* unit;
  bool lower_is_better;
  double (*value)(const Json& side);
};

const std::vector<Row>& rows() {
  static const std::vector<Row> kRows{
      {"doc step", "us", true, [](const Json& s) { return s.at("doc_step_us").get<double>(); }},
      {"10M adam step", "ms", true,
       [](const Json& s) { return s.at("adam_step_ms").get<double>(); }},
      {"rnn tokens/s", "tokens/s", false,
       [](const Json& s) { return s.at("rnn_tokens_per_s").get<double>(); }},
      {"rnn overhead", "ms", true,
       [](const Json& s) {
         return s.at("rnn_iteration_ms").get<double>() -
                s.at("local_rnn_iteration_ms").get<double>();
       }},
  };
  return kRows;
}

std::vector<std::string> worker_args(const Config& config) {
  auto counts = [](const Counts& c) {
    return std::to_string(c.warmup) + "," + std::to_string(c.timed);
  };
  return {"--doc",
          counts(config.doc),
          "--adam",
          counts(config.adam),
          "--rnn",
          counts(config.rnn),
          "--deadline-seconds",
          std::to_string(config.deadline_seconds)};
}

// What each side must have got right; empty if all is well.
std::vector<std::string> check_side(const std::string& side, const Json& result) {
  std::vector<std::string> problems;
  if (!result.at("doc_parameters_ok").get<bool>()) {
    problems.push_back(side + ": the doc example's parameters are not what its steps give");
  }
  if (!result.at("adam_parameters_ok").get<bool>()) {
    problems.push_back(side + ": the Adam case's parameters are not what its steps give");
  }
  for (const char* key : {"intra_op_threads", "local_intra_op_threads"}) {
    if (result.at(key).get<int>() != kIntraOpThreads) {
      problems.push_back(fmt::format("{}: {} = {}, expected {}", side, key,
                                     result.at(key).get<int>(), kIntraOpThreads));
    }
  }
  if (!std::isfinite(result.at("rnn_last_loss").get<double>())) {
    problems.push_back(side + ": the rnn's loss is not finite");
  }
  return problems;
}

std::string format_value(double value) {
  return std::abs(value) >= 100 ? fmt::format("{:.0f}", value) : fmt::format("{:.2f}", value);
}

// A row's figure in each round of one side.
Spread row_spread(const Row& row, const std::vector<Json>& rounds) {
  std::vector<double> values;
  for (const Json& round : rounds) values.push_back(row.value(round));
  return spread_of(values);
}

// The median over rounds of one figure a side's workers reported.
double median_of(const std::vector<Json>& rounds, const char* key) {
  std::vector<double> values;
  for (const Json& round : rounds) values.push_back(round.at(key).get<double>());
  return median(values);
}

void print_table(const Config& config, int rounds, const std::vector<Json>& ours_rounds,
                 const std::vector<Json>& pytorch_rounds, const std::pair<double, double>& load) {
  const Json& ours = ours_rounds.front();
  const Json& pytorch = pytorch_rounds.front();
  fmt::print(
      "\ndist_optim_bench: distoptim's DistributedOptimizer vs PyTorch {} "
      "torch.distributed.optim.DistributedOptimizer (TensorPipe RPC, CPU), {} workers on "
      "loopback\n",
      pytorch.value("torch_version", "?"), kWorldSize);
  fmt::print(
      "settings, both sides: intra-op threads per process {} (ours: at::set_num_threads, "
      "pytorch: torch.set_num_threads), inter-op threads ours {} / pytorch {} (defaults), "
      "{} RPC worker threads (pytorch: TensorPipeRpcBackendOptions(num_worker_threads={}, "
      "rpc_timeout=60)), RPC timeout 60 s; PyTorch's other settings are its defaults; BLAS "
      "threads (the system OpenBLAS's own pool, which the intra-op setting does not reach; -1: "
      "not OpenBLAS) ours {} / pytorch {}, OMP_NUM_THREADS={} and OPENBLAS_THREAD_TIMEOUT={} in "
      "every process of both sides (distrun's values for ranks sharing a machine; OpenBLAS's "
      "default timeout is 28)\n",
      kIntraOpThreads, ours.at("interop_threads").get<int>(),
      pytorch.at("interop_threads").get<int>(), kRpcThreads, kRpcThreads,
      ours.at("blas_threads").get<int>(), pytorch.at("blas_threads").get<int>(),
      std::getenv("OMP_NUM_THREADS"), std::getenv("OPENBLAS_THREAD_TIMEOUT"));
  fmt::print(
      "doc step: SGD lr {} over 2 RRefs on worker1, step alone, {} timed after {} warm-up; "
      "10M adam: Adam lr 0.001, {} x {} floats on each of worker1 and worker2, step alone, {} "
      "timed after {} warm-up\n",
      kDocLr, config.doc.timed, config.doc.warmup, kAdamTensors, kAdamFloatsPerOwner / kAdamTensors,
      config.adam.timed, config.adam.warmup);
  fmt::print(
      "rnn: ntoken {}, ninp = nhid = {}, {} LSTM layers, dropout {}, batch {}, bptt {}, random "
      "tokens, SGD lr {}; embedding + decoder on worker1 (ps), LSTM on worker0 (trainer); {} "
      "timed iterations after {} warm-up; overhead: median iteration minus the same model's in "
      "a process of its own without RPC (ours: LibTorch + distoptim's functional sgd, pytorch: "
      "torch.optim.SGD; grads "
      "set to none each iteration)\n",
      kRnnTokens, kRnnWidth, kRnnLayers, kRnnDropout, kRnnBatch, kRnnBptt, kRnnLr, config.rnn.timed,
      config.rnn.warmup);
  for (const auto& [side, result] :
       {std::pair{"ours", &ours_rounds}, std::pair{"pytorch", &pytorch_rounds}}) {
    fmt::print(
        "rnn iteration, {}: median {:.1f} ms = forward {:.1f} + backward {:.1f} + step {:.1f} "
        "(each a median, then the median over rounds); in one process {:.1f} ms = {:.1f} + "
        "{:.1f} + {:.1f}\n",
        side, median_of(*result, "rnn_iteration_ms"), median_of(*result, "rnn_forward_ms"),
        median_of(*result, "rnn_backward_ms"), median_of(*result, "rnn_step_ms"),
        median_of(*result, "local_rnn_iteration_ms"), median_of(*result, "local_rnn_forward_ms"),
        median_of(*result, "local_rnn_backward_ms"), median_of(*result, "local_rnn_step_ms"));
  }
  fmt::print("{}\n", machine_load_line(load.first, load.second));
  fmt::print(
      "{} rounds, each running ours then PyTorch's (every case); figures min/median/max over "
      "the rounds; ours/pytorch: the ratio of the medians; 'better' says which way is better\n\n",
      rounds);
  fmt::print("{:<16} {:>24} {:>24} {:>10} {:>14} {:>8}\n", "case", "ours", "pytorch", "unit",
             "ours/pytorch", "better");
  for (const Row& row : rows()) {
    const Spread o = row_spread(row, ours_rounds), p = row_spread(row, pytorch_rounds);
    // A ratio of a negative overhead (noise) to a positive one says nothing.
    const std::string ratio =
        o.median > 0 && p.median > 0 ? fmt::format("{:.2f}x", o.median / p.median) : "-";
    auto spread = [](const Spread& s) {
      return format_value(s.min) + "/" + format_value(s.median) + "/" + format_value(s.max);
    };
    fmt::print("{:<16} {:>24} {:>24} {:>10} {:>14} {:>8}\n", row.name, spread(o), spread(p),
               row.unit, ratio, row.lower_is_better ? "lower" : "higher");
  }
  fmt::print("\n");
}

Json to_json(const std::vector<Json>& ours, const std::vector<Json>& pytorch) {
  Json out = Json::array();
  for (const Row& row : rows()) {
    out.push_back(comparison_row(row.name, row_spread(row, ours), row_spread(row, pytorch),
                                 ours.size(), row.unit, row.lower_is_better));
  }
  return out;
}

// "W,T": warm-up and timed iterations.
bool parse_counts(const std::string& text, Counts& counts) {
  const auto comma = text.find(',');
  if (comma == std::string::npos) return false;
  counts.warmup = std::stoi(text.substr(0, comma));
  counts.timed = std::stoi(text.substr(comma + 1));
  return counts.warmup >= 0 && counts.timed > 0;
}

int run(int argc, char** argv) {
  Config config;
  std::string json_path;
  int iterations = 0;
  bool quick = false;
  int rounds = 3;
  bool worker = false;
  bool local = false;
  std::string doc_counts, adam_counts, rnn_counts;
  std::string python = DISTOPTIM_REFERENCE_PYTHON;
  std::string script = DISTOPTIM_PYTORCH_DIST_OPTIM_SCRIPT;
  CLI::App app{"DistributedOptimizer benchmark: distoptim against PyTorch's"};
  app.add_option("--json", json_path, "Write the results as JSON to this file");
  app.add_option("--iterations", iterations,
                 "Timed iterations of every case (default: doc step 500, 10M adam 20, rnn 60)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--quick", quick, "Few iterations and one round, for a smoke run");
  app.add_option("--rounds", rounds, "Rounds of ours then PyTorch's (every case in each)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--deadline-seconds", config.deadline_seconds,
                 "each side is killed after this long")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--python", python, "Python with PyTorch 1.13")->capture_default_str();
  app.add_option("--pytorch-script", script, "pytorch_dist_optim.py")->capture_default_str();
  app.add_flag("--worker", worker, "Run as one of our workers (started by the benchmark itself)");
  app.add_flag("--local", local, "Run the rnn's one-process baseline (ditto)");
  // How the driver hands its counts to the workers: "warm-up,timed".
  app.add_option("--doc", doc_counts)->group("");
  app.add_option("--adam", adam_counts)->group("");
  app.add_option("--rnn", rnn_counts)->group("");
  CLI11_PARSE(app, argc, argv);

  for (auto [text, counts] :
       {std::pair{&doc_counts, &config.doc}, std::pair{&adam_counts, &config.adam},
        std::pair{&rnn_counts, &config.rnn}}) {
    TORCH_CHECK_VALUE(text->empty() || parse_counts(*text, *counts), "bad counts '", *text, "'");
  }
  if (worker) {
    run_worker(config);
    return 0;
  }
  if (local) {
    run_local(config);
    return 0;
  }
  if (quick) {
    config = Config{{5, 20}, {1, 3}, {1, 3}, config.deadline_seconds};
    rounds = 1;
  }
  if (iterations > 0) {
    config.doc.timed = config.adam.timed = config.rnn.timed = iterations;
  }
  ResultsFile results_file(json_path, "dist_optim_bench");
  // OpenBLAS's idle-thread spin: distrun gives ranks that share a machine 2^4 cycles (see
  // tools/distrun); every run of both sides gets the same value here, as with thread counts
  // (one BLAS library, one setting). A value in the environment is kept, for both alike.
  if (std::getenv("OPENBLAS_THREAD_TIMEOUT") == nullptr) {
    ::setenv("OPENBLAS_THREAD_TIMEOUT", "4", 1);
  }
  // distrun (as torchrun) gives ranks sharing a machine OMP_NUM_THREADS=1, which OpenBLAS's pool
  // follows: PyTorch's workers get the same here.
  if (std::getenv("OMP_NUM_THREADS") == nullptr) ::setenv("OMP_NUM_THREADS", "1", 1);

  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  // Our job is distrun running this program with --worker; each side's one-process baseline is
  // its program again with --local.
  auto with_counts = [&](std::vector<std::string> argv) {
    for (auto& arg : worker_args(config)) argv.push_back(std::move(arg));
    return argv;
  };
  const auto ours_argv = with_counts(
      {DISTOPTIM_DISTRUN_PATH, "--nproc-per-node", std::to_string(kWorldSize), self, "--worker"});
  const auto ours_local_argv = with_counts({self, "--local"});
  const auto pytorch_argv = with_counts({python, script});
  const auto pytorch_local_argv = with_counts({python, script, "--local"});
  auto timed = [&](const std::string& label, const std::string& what,
                   const std::vector<std::string>& argv) {
    fmt::print(stderr, "dist_optim_bench: {}...", label);
    const auto begin = Clock::now();
    Json result = run_side(what, argv, config.deadline_seconds).front();
    fmt::print(stderr, " {:.0f} s\n", seconds_since(begin));
    return result;
  };
  // Each side's baseline right after its job, so that the two parts of its overhead see the
  // machine's load of the same minute; the sides alternate, round after round.
  const double load_at_start = load_average();
  auto [ours, pytorch] = alternate_rounds(
      "dist_optim_bench", "every case", rounds,
      [&] {
        Json result = timed("ours", "our workers (distrun)", ours_argv);
        result.update(timed("ours, one process", "our --local", ours_local_argv));
        return result;
      },
      [&] {
        Json result = timed("pytorch", script, pytorch_argv);
        result.update(timed("pytorch, one process", script + " --local", pytorch_local_argv));
        return result;
      });

  print_table(config, rounds, ours, pytorch, {load_at_start, load_average()});
  std::vector<std::string> problems;
  for (const Json& round : ours) {
    for (auto& p : check_side("ours", round)) problems.push_back(std::move(p));
  }
  for (const Json& round : pytorch) {
    for (auto& p : check_side("pytorch", round)) problems.push_back(std::move(p));
  }
  return results_file.write_unless(to_json(ours, pytorch), problems);
}

}  // namespace
}  // namespace bench
}  // namespace distoptim

int main(int argc, char** argv) {
  return distoptim::bench::run_main("dist_optim_bench", distoptim::bench::run, argc, argv);
}
