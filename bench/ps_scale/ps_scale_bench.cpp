// ps_scale_bench: one parameter server (an embedding table and an MLP) and 1, 2, 4 and 6 trainers
// whose own compute is small, so that the server decides how fast they go; then the table split
// over two servers. distoptim against PyTorch 1.13's DistributedOptimizer on the same model. What
// it shows: the samples/s and the server's optimizer steps/s as trainers are added, and where ours
// stops scaling.
//
// Each side is a job of S servers and N trainers on loopback: workers 0 .. S-1 the servers,
// workers S .. S+N-1 the trainers. Ours are this program again (`--worker`), started by distrun;
// PyTorch's run pytorch_ps_scale.py under the system Python, which spawns its own S+N workers.
// The model, on both sides:
// - the table: an EmbeddingBag of R rows x 32 floats (sum pooling, sparse gradients; LibTorch's
//   torch::nn::EmbeddingBag / PyTorch's nn.EmbeddingBag) in a RemoteModule / rpc.remote on the
//   server, as bench/sparse_ps holds its table (not the library's ShardedEmbeddingBag, which pools
//   on the trainer and would send every looked-up row over the wire). With two servers, each holds
//   one half of the rows, [0, R/2) and [R/2, R), as an EmbeddingBag of its own: a trainer sends
//   each half the ids in its range with each bag's offsets among them, both calls at once, and
//   adds the two pooled results (sum pooling: the same as one table's);
// - the MLP: 8*32 -> 64 -> ReLU -> 1 (LibTorch's / PyTorch's Linear, their default
//   initialization), a RemoteModule / rpc.remote on the first server;
// - a batch: 256 bags of 8 uniformly random ids, 8 consecutive bags one sample's 8 fields, so 32
//   samples of 8*32 pooled floats; labels uniform in {0, 1}; loss: binary cross-entropy with
//   logits, computed on the trainer;
// - an iteration: a distributed autograd context, the table's forward (an RPC per server), the
//   MLP's (an RPC to the first server), the loss, the distributed backward, the step of the
//   trainer's own DistributedOptimizer (Adagrad, lr 0.01, over the table's and the MLP's
//   parameters: ours "adagrad", PyTorch's torch.optim.Adagrad), the context's release.
// The first trainer creates the modules and sends their references to the others, so all train
// one model; each trainer's optimizer keeps Adagrad state of its own on every server, as in
// PyTorch. PyTorch's MLP saves clones of its weights for the backward (with several trainers
// another's step lands between a forward and its backward, and PyTorch refuses a saved weight
// changed in place; ours writes without bumping the version counter: docs/optim.md), and its
// trainers call the two halves with rpc.rpc_async (1.13's rref.rpc_async() proxy leaves the call
// unrecorded by distributed autograd). After the warm-up each side checks, in one iteration
// without a step, that every server holds a gradient for each of its parameters.
//
// Timing: each trainer runs --warmup iterations, then waits at a barrier on the first server,
// which releases all trainers at once with a start time on the machine's monotonic clock; from
// there each trainer iterates for --window-seconds and counts the iterations that ended within
// the window (the one that crosses its end is dropped, so every trainer loads the server for the
// whole window). A run reports the samples/s of all trainers together, the server steps/s (the
// optimizer steps the servers applied per second, summed over trainers: one per trainer
// iteration), the median of the trainers' median iterations and their phases (forward, backward,
// step), and CPU time over the window: each server's process and the trainers' (getrusage /
// time.process_time, all threads), per step.
//
// Rounds: for each case (servers, trainers) the two sides alternate (ours, PyTorch's, ours, ...)
// --rounds times; the table gives each side's min, median and max over the rounds and the ratio
// of the medians.
//
// Settings, both sides: 1 intra-op thread per process, 16 RPC worker threads, a 60 s RPC timeout,
// OMP_NUM_THREADS=1 and OPENBLAS_THREAD_TIMEOUT=4 in every process (kept when set); PyTorch at its
// defaults otherwise (TensorPipe backend). The output states them. The machines have 2 cores: a
// job of 7 processes oversubscribes them, which the output states too.
//
// The JSON written to --json holds, under "cases", comparison rows (common/report.h) per case and
// a "settings" row, and the load average.
//
// Usage: ps_scale_bench --json PATH [--rounds 3] [--rows R] [--trainers 1 2 4 6]
//        [--two-server-trainers 2 4] [--window-seconds 5] [--warmup 10] [--quick]

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/core.h>
#include <torch/nn/modules/linear.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/rpc.h>

#include "../common/ps_job.h"
#include "../common/report.h"

namespace {

constexpr int64_t kFields = 8;  // bags per sample
constexpr int64_t kBags = 256;  // per batch
constexpr int64_t kIdsPerBag = 8;
constexpr int64_t kSamples = kBags / kFields;  // per batch: 32
constexpr int64_t kHidden = 64;

// The first server's MLP: a sample's 8 pooled fields -> 64 -> ReLU -> 1 logit.
struct ScaleMlp : torch::nn::Module {
  ScaleMlp() {
    fc1 = register_module("fc1", torch::nn::Linear(kFields * distoptim::bench::kPsDim, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, 1));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fc2->forward(at::relu(fc1->forward(x))).squeeze(1);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

}  // namespace

// A server's table (or its half of the rows).
DISTOPTIM_REMOTE_MODULE(distoptim::bench::PsEmbeddingBag, int64_t);
DISTOPTIM_REMOTE_MODULE(ScaleMlp);

namespace distoptim {
namespace bench {
namespace {

namespace rpc = distoptim::rpc;
using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr double kLr = 0.01;
constexpr auto kRpcTimeout = 60s;
constexpr auto kJoinTimeout = 300s;  // trainers waiting for the model, or at the barrier

int64_t monotonic_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// --- on the first server: the barrier that starts every trainer's window at once --------------

struct Barrier {
  std::mutex mutex;
  std::condition_variable released;
  int64_t arrived = 0;   // guarded by mutex
  int64_t start_ns = 0;  // guarded by mutex; set by the last to arrive
};
Barrier& barrier() {
  static auto* state = new Barrier;  // never destroyed: a request may still wait at exit
  return *state;
}

// Blocks the calling trainer's request until `parties` trainers have arrived; returns the
// monotonic time of the last arrival, every trainer's window start. Used once per job.
int64_t wait_at_barrier(int64_t parties) {
  Barrier& b = barrier();
  std::unique_lock<std::mutex> lock(b.mutex);
  if (++b.arrived == parties) {
    const int64_t start_ns = b.start_ns = monotonic_ns();
    lock.unlock();
    b.released.notify_all();
    return start_ns;
  }
  TORCH_CHECK(b.released.wait_for(lock, kJoinTimeout, [&] { return b.arrived >= parties; }),
              "ps_scale: only ", b.arrived, " of ", parties, " trainers reached the barrier");
  return b.start_ns;
}

DISTOPTIM_RPC_FUNCTION("ps_scale.barrier", wait_at_barrier);
DISTOPTIM_RPC_FUNCTION("ps_scale.cpu_seconds", [] { return process_cpu_seconds(); });
// How many of this server's parameters have a gradient in distributed autograd context `id`.
DISTOPTIM_RPC_FUNCTION("ps_scale.gradients", [](int64_t id) {
  return static_cast<int64_t>(dist_autograd::get_gradients(id).size());
});

// --- on the trainers: the model's references, sent by the first trainer ------------------------

using ModelRefs = std::tuple<std::vector<rpc::RRef<PsEmbeddingBag>>, rpc::RRef<ScaleMlp>>;

struct Inbox {
  std::mutex mutex;
  std::condition_variable ready;
  std::optional<ModelRefs> model;  // guarded by mutex
};
Inbox& inbox() {
  static auto* state = new Inbox;  // never destroyed: it may hold references at exit
  return *state;
}

bool take_model(std::vector<rpc::RRef<PsEmbeddingBag>> bags, rpc::RRef<ScaleMlp> mlp) {
  {
    std::lock_guard<std::mutex> lock(inbox().mutex);
    inbox().model.emplace(std::move(bags), std::move(mlp));
  }
  inbox().ready.notify_all();
  return true;
}

DISTOPTIM_RPC_FUNCTION("ps_scale.take_model", take_model);

struct WorkerConfig {
  int servers = 1;
  int trainers = 1;
  int64_t rows = 1'000'000;
  int warmup = 10;
  double window_seconds = 5;
  int deadline_seconds = 300;
};

std::string worker_name(int rank) { return "worker" + std::to_string(rank); }

// A trainer's handles on the model: one table per server (its rows [first_row, end)), the MLP.
struct Model {
  std::vector<std::shared_ptr<rpc::RemoteModule<PsEmbeddingBag>>> bags;
  std::vector<int64_t> first_rows;  // per server, then R
  std::shared_ptr<rpc::RemoteModule<ScaleMlp>> mlp;
};

std::vector<int64_t> split_rows(int64_t rows, int servers) {
  std::vector<int64_t> first;
  for (int s = 0; s <= servers; ++s) first.push_back(rows * s / servers);
  return first;
}

// The first trainer creates the model and sends it to the others; the others wait for it.
Model make_or_receive_model(const WorkerConfig& config, int trainer) {
  Model model;
  model.first_rows = split_rows(config.rows, config.servers);
  if (trainer == 0) {
    for (int s = 0; s < config.servers; ++s) {
      const int64_t rows = model.first_rows[s + 1] - model.first_rows[s];
      model.bags.push_back(
          std::make_shared<rpc::RemoteModule<PsEmbeddingBag>>(worker_name(s), std::tuple{rows}));
    }
    model.mlp = std::make_shared<rpc::RemoteModule<ScaleMlp>>(worker_name(0));
    std::vector<rpc::RRef<PsEmbeddingBag>> bag_refs;
    for (const auto& bag : model.bags) {
      bag->module_rref().confirm();
      bag_refs.push_back(bag->module_rref());
    }
    model.mlp->module_rref().confirm();
    for (int t = 1; t < config.trainers; ++t) {
      rpc::rpc_sync<bool>(worker_name(config.servers + t), "ps_scale.take_model",
                          std::tuple{bag_refs, model.mlp->module_rref()});
    }
    return model;
  }
  std::unique_lock<std::mutex> lock(inbox().mutex);
  TORCH_CHECK(inbox().ready.wait_for(lock, kJoinTimeout, [] { return inbox().model.has_value(); }),
              "ps_scale: no model arrived from the first trainer");
  auto [bag_refs, mlp_ref] = std::move(*inbox().model);
  inbox().model.reset();
  lock.unlock();
  for (int s = 0; s < config.servers; ++s) {
    model.bags.push_back(rpc::RemoteModule<PsEmbeddingBag>::init_from_module_rref(
        worker_name(s), std::move(bag_refs[s])));
  }
  model.mlp =
      rpc::RemoteModule<ScaleMlp>::init_from_module_rref(worker_name(0), std::move(mlp_ref));
  return model;
}

// The batch's pooled fields [kBags, kPsDim]: one call per server, all at once; with several
// servers each gets the ids in its range (shifted to its rows) and each bag's offset among them.
at::Tensor pooled_fields(const Model& model, const at::Tensor& ids, const at::Tensor& offsets,
                         const at::Tensor& bag_of_id) {
  if (model.bags.size() == 1) return model.bags[0]->forward(ids, offsets);
  std::vector<rpc::RpcFuture<at::Tensor>> calls;
  for (size_t s = 0; s < model.bags.size(); ++s) {
    const at::Tensor mine =
        ids.ge(model.first_rows[s]).logical_and_(ids.lt(model.first_rows[s + 1]));
    const at::Tensor counts = at::bincount(bag_of_id.masked_select(mine), {}, kBags);
    calls.push_back(model.bags[s]->forward_async(ids.masked_select(mine) - model.first_rows[s],
                                                 counts.cumsum(0) - counts));
  }
  at::Tensor pooled;
  for (const at::Tensor& part : rpc::wait_all(calls)) {
    pooled = pooled.defined() ? pooled + part : part;
  }
  return pooled;
}

// One untimed iteration without a step: every server must hold a gradient for each of its
// parameters (its table's weight; the first also the MLP's 4), else a call went unrecorded.
void check_gradients(const WorkerConfig& config, const Model& model, at::Generator& generator,
                     const at::Tensor& offsets, const at::Tensor& bag_of_id) {
  const at::Tensor ids = at::randint(config.rows, {kBags * kIdsPerBag}, generator, at::kLong);
  dist_autograd::ContextGuard context;
  const at::Tensor fields = pooled_fields(model, ids, offsets, bag_of_id);
  const at::Tensor logits = model.mlp->forward(fields.reshape({kSamples, -1}));
  dist_autograd::backward(context.id(), {logits.sum()});
  for (int s = 0; s < config.servers; ++s) {
    const auto held =
        rpc::rpc_sync<int64_t>(worker_name(s), "ps_scale.gradients", std::tuple{context.id()});
    const int64_t expected = s == 0 ? 5 : 1;
    TORCH_CHECK(held == expected, "ps_scale: ", worker_name(s), " holds ", held,
                " gradients after a backward, not ", expected);
  }
}

Json train(const WorkerConfig& config, int rank) {
  const int trainer = rank - config.servers;
  const Model model = make_or_receive_model(config, trainer);
  std::vector<rpc::RRef<at::Tensor>> params;
  for (const auto& bag : model.bags) {
    for (auto& p : bag->remote_parameters()) params.push_back(std::move(p));
  }
  for (auto& p : model.mlp->remote_parameters()) params.push_back(std::move(p));
  dist_optim::DistributedOptimizer optimizer("adagrad", params, optim::OptionBag().set("lr", kLr));

  auto generator = at::detail::createCPUGenerator(static_cast<uint64_t>(rank));
  const at::Tensor offsets = at::arange(0, kBags * kIdsPerBag, kIdsPerBag, at::kLong);
  const at::Tensor bag_of_id = at::arange(kBags * kIdsPerBag, at::kLong).div_(kIdsPerBag, "floor");
  struct Times {
    Clock::time_point begin, forward_end, backward_end, step_end, end;
  };
  double last_loss = 0;
  auto iterate = [&] {
    const at::Tensor ids = at::randint(config.rows, {kBags * kIdsPerBag}, generator, at::kLong);
    const at::Tensor labels = at::randint(2, {kSamples}, generator, at::kFloat);
    Times t;
    t.begin = Clock::now();
    {
      dist_autograd::ContextGuard context;
      const at::Tensor fields = pooled_fields(model, ids, offsets, bag_of_id);
      const at::Tensor logits = model.mlp->forward(fields.reshape({kSamples, -1}));
      const at::Tensor loss = at::binary_cross_entropy_with_logits(logits, labels);
      t.forward_end = Clock::now();
      dist_autograd::backward(context.id(), {loss});
      t.backward_end = Clock::now();
      optimizer.step(context.id());
      t.step_end = Clock::now();
      last_loss = loss.item<double>();
    }
    t.end = Clock::now();
    return t;
  };
  for (int i = 0; i < config.warmup; ++i) iterate();
  check_gradients(config, model, generator, offsets, bag_of_id);

  const int64_t start_ns = rpc::rpc_sync<int64_t>(worker_name(0), "ps_scale.barrier",
                                                  std::tuple{int64_t{config.trainers}});
  const Clock::time_point window_end = Clock::time_point(std::chrono::nanoseconds(start_ns)) +
                                       std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(config.window_seconds));
  // The first trainer reads every server's CPU time at the start and the end of the window.
  auto servers_cpu = [&] {
    std::vector<double> seconds;
    if (trainer != 0) return seconds;
    for (int s = 0; s < config.servers; ++s) {
      seconds.push_back(rpc::rpc_sync<double>(worker_name(s), "ps_scale.cpu_seconds"));
    }
    return seconds;
  };
  const std::vector<double> servers_cpu_start = servers_cpu();
  const double cpu_start = process_cpu_seconds();
  std::vector<double> iteration, forward, backward, step;
  for (;;) {
    const Times t = iterate();
    if (t.end > window_end) break;
    iteration.push_back(ms_between(t.begin, t.end));
    forward.push_back(ms_between(t.begin, t.forward_end));
    backward.push_back(ms_between(t.forward_end, t.backward_end));
    step.push_back(ms_between(t.backward_end, t.step_end));
  }
  const double cpu_seconds = process_cpu_seconds() - cpu_start;
  std::vector<double> servers_cpu_seconds = servers_cpu();
  for (size_t s = 0; s < servers_cpu_seconds.size(); ++s) {
    servers_cpu_seconds[s] -= servers_cpu_start[s];
  }
  TORCH_CHECK(!iteration.empty(), "ps_scale: trainer ", trainer,
              " finished no iteration within the window of ", config.window_seconds, " s");
  return {{"trainer", trainer},
          {"iterations", iteration.size()},
          {"window_s", config.window_seconds},
          {"iteration_ms", median(iteration)},
          {"forward_ms", median(forward)},
          {"backward_ms", median(backward)},
          {"step_ms", median(step)},
          {"cpu_s", cpu_seconds},
          {"servers_cpu_s", servers_cpu_seconds},
          {"last_loss", last_loss},
          {"intra_op_threads", at::get_num_threads()},
          {"blas_threads", blas_threads()}};
}

void run_worker(const WorkerConfig& config) {
  const int rank = init_ps_worker(config.servers + config.trainers, kRpcTimeout,
                                  std::chrono::seconds(config.deadline_seconds));
  if (rank >= config.servers) print_result(train(config, rank));
  rpc::shutdown();
}

// --- the driver ------------------------------------------------------------------------------

struct Case {
  int servers;
  int trainers;
  std::string label() const {
    return fmt::format("{} server{}, {} trainer{}", servers, servers == 1 ? "" : "s", trainers,
                       trainers == 1 ? "" : "s");
  }
};

// One run of one side: its trainers' RESULTs summed up.
struct Run {
  double samples_per_s = 0;
  double steps_per_s = 0;
  double iteration_ms = 0;  // the median of the trainers' medians, as the phases
  double forward_ms = 0;
  double backward_ms = 0;
  double step_ms = 0;
  double server_cpu_ms_per_step = 0;   // all servers' CPU time over the window, per step
  double busiest_server_cores = 0;     // the busiest server's CPU time over the window, in cores
  double trainer_cpu_ms_per_step = 0;  // all trainers' CPU time, per step
  double total_cores = 0;              // servers' and trainers' CPU time over the window, in cores
  bool finite_loss = true;
};

Run summarize(const Case& c, const std::vector<Json>& results) {
  TORCH_CHECK(static_cast<int>(results.size()) == c.trainers, c.label(), ": ", results.size(),
              " RESULT lines for ", c.trainers, " trainers");
  Run run;
  double steps = 0, trainer_cpu = 0, window = 0;
  std::vector<double> iteration, forward, backward, step;
  std::vector<double> servers_cpu;
  for (const Json& r : results) {
    steps += r.at("iterations").get<double>();
    window = r.at("window_s").get<double>();
    trainer_cpu += r.at("cpu_s").get<double>();
    iteration.push_back(r.at("iteration_ms").get<double>());
    forward.push_back(r.at("forward_ms").get<double>());
    backward.push_back(r.at("backward_ms").get<double>());
    step.push_back(r.at("step_ms").get<double>());
    if (r.at("trainer").get<int>() == 0)
      servers_cpu = r.at("servers_cpu_s").get<std::vector<double>>();
    if (!std::isfinite(r.at("last_loss").get<double>())) run.finite_loss = false;
  }
  run.steps_per_s = steps / window;
  run.samples_per_s = run.steps_per_s * kSamples;
  run.iteration_ms = median(iteration);
  run.forward_ms = median(forward);
  run.backward_ms = median(backward);
  run.step_ms = median(step);
  double server_cpu = 0;
  for (double s : servers_cpu) {
    server_cpu += s;
    run.busiest_server_cores = std::max(run.busiest_server_cores, s / window);
  }
  run.server_cpu_ms_per_step = server_cpu * 1e3 / steps;
  run.trainer_cpu_ms_per_step = trainer_cpu * 1e3 / steps;
  run.total_cores = (server_cpu + trainer_cpu) / window;
  return run;
}

Spread spread_by(const std::vector<Run>& runs, double Run::*field) {
  std::vector<double> values;
  for (const Run& run : runs) values.push_back(run.*field);
  return spread_of(values);
}

std::string spread_text(const Spread& s) {
  return fmt::format("{:.0f}/{:.0f}/{:.0f}", s.min, s.median, s.max);
}

int run(int argc, char** argv) {
  WorkerConfig worker_config;
  int rounds = 3;
  int64_t rows = 1'000'000;
  std::vector<int> trainer_counts{1, 2, 4, 6};
  std::vector<int> two_server_counts{2, 4};
  double window_seconds = 5;
  int warmup = 10;
  int deadline_seconds = 300;
  std::string json_path;
  bool quick = false;
  bool worker = false;
  std::string python = DISTOPTIM_REFERENCE_PYTHON;
  std::string script = DISTOPTIM_PYTORCH_PS_SCALE_SCRIPT;
  CLI::App app{"Parameter-server scaling benchmark: distoptim against PyTorch"};
  app.add_option("--json", json_path, "Write the results as JSON to this file");
  app.add_option("--rounds", rounds, "Rounds of ours then PyTorch's per case")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--rows", rows, "Rows of the table")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 40));
  app.add_option("--trainers", trainer_counts, "Trainer counts with one server")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--two-server-trainers", two_server_counts,
                 "Trainer counts with the table over two servers (0: none)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--window-seconds", window_seconds, "Each run's timed window")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "Iterations per trainer before the window")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--quick", quick, "One round, 1 and 2 trainers, a small table, a 1 s window");
  app.add_option("--deadline-seconds", deadline_seconds, "each run is killed past this")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--python", python, "Python with PyTorch 1.13")->capture_default_str();
  app.add_flag("--worker", worker, "Run as one of our workers (started by the benchmark)");
  app.add_option("--worker-servers", worker_config.servers)->group("");
  app.add_option("--worker-trainers", worker_config.trainers)->group("");
  CLI11_PARSE(app, argc, argv);
  if (worker) {
    worker_config.rows = rows;
    worker_config.warmup = warmup;
    worker_config.window_seconds = window_seconds;
    worker_config.deadline_seconds = deadline_seconds;
    run_worker(worker_config);
    return 0;
  }
  if (quick) {
    rounds = 1;
    rows = 100'000;
    trainer_counts = {1, 2};
    two_server_counts = {2};
    window_seconds = 1;
    warmup = 3;
  }
  std::vector<Case> cases;
  for (int n : trainer_counts) cases.push_back({1, n});
  for (int n : two_server_counts) {
    if (n > 0) cases.push_back({2, n});
  }

  ResultsFile results_file(json_path, "ps_scale_bench");
  // The same BLAS settings for both sides' processes (as bench/dist_optim): distrun's for ranks
  // that share a machine; a value in the environment is kept, for both alike.
  if (std::getenv("OPENBLAS_THREAD_TIMEOUT") == nullptr) {
    ::setenv("OPENBLAS_THREAD_TIMEOUT", "4", 1);
  }
  if (std::getenv("OMP_NUM_THREADS") == nullptr) ::setenv("OMP_NUM_THREADS", "1", 1);
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const double load_at_start = load_average();

  const std::vector<std::string> common_args = {
      "--rows",   std::to_string(rows),   "--window-seconds",   fmt::format("{}", window_seconds),
      "--warmup", std::to_string(warmup), "--deadline-seconds", std::to_string(deadline_seconds)};
  std::vector<std::pair<std::vector<Run>, std::vector<Run>>> runs;
  std::string torch_version = "?";
  int ours_blas = -1, pytorch_blas = -1;
  for (const Case& c : cases) {
    std::vector<Run> ours, pytorch;
    alternate_rounds(
        "ps_scale_bench", c.label(), rounds,
        [&] {
          std::vector<std::string> argv = {DISTOPTIM_DISTRUN_PATH,
                                           "--nproc-per-node",
                                           std::to_string(c.servers + c.trainers),
                                           self,
                                           "--worker",
                                           "--worker-servers",
                                           std::to_string(c.servers),
                                           "--worker-trainers",
                                           std::to_string(c.trainers)};
          argv.insert(argv.end(), common_args.begin(), common_args.end());
          const std::vector<Json> results =
              run_side("our workers (distrun)", argv, deadline_seconds);
          ours_blas = results.front().value("blas_threads", -1);
          ours.push_back(summarize(c, results));
          return Json();
        },
        [&] {
          std::vector<std::string> argv = {python,       script,
                                           "--servers",  std::to_string(c.servers),
                                           "--trainers", std::to_string(c.trainers)};
          argv.insert(argv.end(), common_args.begin(), common_args.end());
          const std::vector<Json> results = run_side(script, argv, deadline_seconds);
          torch_version = results.front().value("torch_version", "?");
          pytorch_blas = results.front().value("blas_threads", -1);
          pytorch.push_back(summarize(c, results));
          return Json();
        });
    runs.emplace_back(std::move(ours), std::move(pytorch));
  }
  const double load_at_end = load_average();

  const std::string settings = fmt::format(
      "S servers + N trainers on one machine (loopback; ours under distrun, PyTorch {} spawned by "
      "pytorch_ps_scale.py, TensorPipe); table: EmbeddingBag {} x {} (sum, sparse gradients; "
      "with 2 servers, half the rows on each), MLP {}*{} -> {} -> 1 on the first server; batch "
      "{} bags of {} uniform ids = {} samples of {} fields; BCE-with-logits loss; each trainer's "
      "own DistributedOptimizer(Adagrad, lr {}) over the table and the MLP; {} warm-up "
      "iterations per trainer, then a {} s window started at once for all trainers (a barrier "
      "on the first server); {} round(s) per case alternating ours and PyTorch's; both sides: 1 "
      "intra-op thread per process, {} RPC worker threads, {} s RPC timeout, OMP_NUM_THREADS={}, "
      "OPENBLAS_THREAD_TIMEOUT={} (BLAS threads: ours {}, PyTorch {}); the machine's {} cores "
      "are oversubscribed from 2 trainers on (N+S processes)",
      torch_version, rows_label(rows), kPsDim, kFields, kPsDim, kHidden, kBags, kIdsPerBag,
      kSamples, kFields, kLr, warmup, window_seconds, rounds, kPsRpcThreads, kRpcTimeout.count(),
      std::getenv("OMP_NUM_THREADS"), std::getenv("OPENBLAS_THREAD_TIMEOUT"), ours_blas,
      pytorch_blas, std::thread::hardware_concurrency());
  fmt::print(
      "\nps_scale_bench: one parameter server (an EmbeddingBag table and an MLP) and N trainers, "
      "then the table over two servers; distoptim vs PyTorch {}\n{}\n",
      torch_version, settings);
  fmt::print("{}\n\n", machine_load_line(load_at_start, load_at_end));
  fmt::print("{:<22} {:>24} {:>24} {:>8} {:>17} {:>17}\n", "case", "ours samples/s",
             "pytorch samples/s", "ours/pt", "server steps/s", "iteration ms");
  fmt::print("{:<22} {:>24} {:>24} {:>8} {:>17} {:>17}\n", "", "(min/med/max)", "(min/med/max)", "",
             "(ours / pytorch)", "(ours / pytorch)");
  Json results = Json::array();
  std::vector<std::string> problems;
  bool target_met = true;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const auto& [ours, pytorch] = runs[i];
    const Spread os = spread_by(ours, &Run::samples_per_s);
    const Spread ps = spread_by(pytorch, &Run::samples_per_s);
    const Spread osteps = spread_by(ours, &Run::steps_per_s);
    const Spread psteps = spread_by(pytorch, &Run::steps_per_s);
    const Spread oit = spread_by(ours, &Run::iteration_ms);
    const Spread pit = spread_by(pytorch, &Run::iteration_ms);
    const double ratio = os.median / ps.median;
    if (ratio < 2) target_met = false;
    fmt::print("{:<22} {:>24} {:>24} {:>7.2f}x {:>17} {:>17}\n", c.label(), spread_text(os),
               spread_text(ps), ratio, fmt::format("{:.0f} / {:.0f}", osteps.median, psteps.median),
               fmt::format("{:.2f} / {:.2f}", oit.median, pit.median));
    const auto r = static_cast<size_t>(rounds);
    const std::string label = c.label();
    results.push_back(comparison_row("samples/s, " + label, os, ps, r, "samples/s", false));
    results.push_back(
        comparison_row("server steps/s, " + label, osteps, psteps, r, "steps/s", false));
    results.push_back(
        comparison_row("iteration (median trainer), " + label, oit, pit, r, "ms", true));
    results.push_back(comparison_row(
        "server CPU per step, " + label, spread_by(ours, &Run::server_cpu_ms_per_step),
        spread_by(pytorch, &Run::server_cpu_ms_per_step), r, "ms", true));
    results.push_back(comparison_row(
        "trainer CPU per step, " + label, spread_by(ours, &Run::trainer_cpu_ms_per_step),
        spread_by(pytorch, &Run::trainer_cpu_ms_per_step), r, "ms", true));
    for (const auto& [side, side_runs] :
         {std::pair{"ours", &ours}, std::pair{"pytorch", &pytorch}}) {
      for (const Run& run : *side_runs) {
        if (!run.finite_loss)
          problems.push_back(std::string(side) + ": a loss is not finite, " + label);
      }
    }
  }
  fmt::print(
      "\nper case, median over the rounds (ours | pytorch): phases forward/backward/step ms "
      "of the median trainer; CPU ms per step on the servers and on the trainers; the "
      "busiest server's CPU and all processes' CPU over the window, in cores\n");
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& [ours, pytorch] = runs[i];
    auto line = [](const std::vector<Run>& side) {
      return fmt::format("{:.2f}/{:.2f}/{:.2f}, cpu {:.2f} + {:.2f}, {:.2f} / {:.2f} cores",
                         spread_by(side, &Run::forward_ms).median,
                         spread_by(side, &Run::backward_ms).median,
                         spread_by(side, &Run::step_ms).median,
                         spread_by(side, &Run::server_cpu_ms_per_step).median,
                         spread_by(side, &Run::trainer_cpu_ms_per_step).median,
                         spread_by(side, &Run::busiest_server_cores).median,
                         spread_by(side, &Run::total_cores).median);
    };
    fmt::print("{:<22} {} | {}\n", cases[i].label(), line(ours), line(pytorch));
  }
  // Scaling of ours with one server: each count's samples/s against the previous count's.
  fmt::print("\nours with one server, samples/s against the previous trainer count:");
  double previous = 0;
  int previous_n = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    if (cases[i].servers != 1) continue;
    const double now = spread_by(runs[i].first, &Run::samples_per_s).median;
    if (previous_n > 0)
      fmt::print(" {}->{}: {:.2f}x;", previous_n, cases[i].trainers, now / previous);
    previous = now;
    previous_n = cases[i].trainers;
  }
  fmt::print("\nthe target, ours at least 2x PyTorch's samples/s in every case: {}\n\n",
             target_met ? "met" : "NOT met");
  results.push_back({{"case", "settings"}, {"settings", settings}});
  return results_file.write_unless(results, problems);
}

}  // namespace
}  // namespace bench
}  // namespace distoptim

int main(int argc, char** argv) {
  return distoptim::bench::run_main("ps_scale_bench", distoptim::bench::run, argc, argv);
}
