// sparse_ps_bench: a parameter server holding an embedding table with sparse gradients, trained
// through RPC, distributed autograd and a DistributedOptimizer: distoptim against PyTorch 1.13,
// at table sizes 1e5, 1e6 and 1e7 rows, in one run. What it shows: whether a step costs what the
// batch touches or what the table holds.
//
// Each side is a job of 2 processes on loopback: worker0 the trainer, worker1 the parameter
// server. Ours are this program again (`--worker`), started by distrun; PyTorch's run
// pytorch_sparse_ps.py under the system Python, which spawns its own 2 workers. The model, on
// both sides: an EmbeddingBag of R rows x 32 floats (sum pooling, sparse gradients; LibTorch's
// torch::nn::EmbeddingBag / PyTorch's nn.EmbeddingBag) created on the parameter server from the
// trainer (ours: a RemoteModule; PyTorch's: rpc.remote), a batch of 512 bags of 8 uniformly
// random ids, loss = mean of the pooled rows squared, SGD lr 0.01 through the DistributedOptimizer
// (ours: "sgd", PyTorch's: torch.optim.SGD). An iteration: a context, the forward through the
// RPC, the distributed backward, the step, the context's release; each side reports the median
// iteration and its phases over the timed iterations, after warm-up ones. The parameter server's
// memory: its peak resident set (VmHWM) against its resident set before the table was made, beside
// the table's own bytes (SGD without momentum keeps no state).
//
// Rounds: for each table size the two sides alternate (ours, PyTorch's, ours, ...) --rounds
// times, so that the machine's drift falls on both alike; the table gives each side's min, median
// and max over the rounds, and the ratios of the medians.
//
// Settings, both sides: 1 intra-op thread per process, 16 RPC worker threads, a 60 s RPC timeout;
// PyTorch at its defaults otherwise (TensorPipe backend). The output states them.
//
// The JSON written to --json holds, under "cases", a list of {case, ours, pytorch, unit, better}
// (medians over the rounds; the iterations also with ours_min, ours_max, pytorch_min,
// pytorch_max and rounds), and the load average (common/report.h).
//
// --replica measures what a replica costs instead (dist_optim/replicas.h): ours alone, each job
// of 3 processes (worker2 the backup), with the parameter server's steps sent to worker2 before
// they return against without (worker2 then idle), alternating; default sizes 1e5 and 1e6 (the
// backup first takes the whole table in one message). The JSON then holds each side's iteration
// (spread_row) and the ratio of the medians.
//
// --id-table measures the collisionless table (rpc/id_embedding_bag.h) instead: ours alone, the
// same job with a ShardedIdEmbeddingBag of R rows on worker1 against a ShardedEmbeddingBag of R
// rows there, alternating, both stepped by Adagrad (lr 0.01: a state row per row), at the same
// batch. The fixed table reads the uniform ids as they are; the collisionless one reads them
// spread over the 64-bit space (a bijection: R distinct raw ids), and every one of the R ids is
// looked up once before the timed iterations, so that the table is full, as one at its bound:
// its memory per live row is then what a table at its bound costs. The JSON holds each side's
// iteration (spread_row), the ratio of the medians' samples/s (collisionless / fixed), and each
// side's server memory growth per row (its resident set at the end above the one before the
// table; the output also gives the peak's) against a row's and its Adagrad state's bytes.
// Default sizes 1e5 and 1e6.
//
// Usage: sparse_ps_bench --json PATH [--rounds 3] [--steps W,T] [--rows R ...] [--quick]
//        [--replica | --id-table]

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/core.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/rpc.h>
#include <distoptim/rpc/id_embedding_bag.h>

#include "../common/ps_job.h"
#include "../common/report.h"

// The parameter server's table: LibTorch's EmbeddingBag with sparse gradients.
DISTOPTIM_REMOTE_MODULE(distoptim::bench::PsEmbeddingBag, int64_t);

namespace distoptim {
namespace bench {
namespace {

namespace rpc = distoptim::rpc;
using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr int kWorldSize = 2;
constexpr int kReplicaWorldSize = 3;  // --replica: worker2 the backup (idle without the replica)
constexpr double kLr = 0.01;

DISTOPTIM_RPC_FUNCTION("bench.ps_memory_kb", [] {
  return std::make_tuple(static_cast<int64_t>(proc_status_kb("VmRSS")),
                         static_cast<int64_t>(proc_status_kb("VmHWM")));
});

struct Config {
  int warmup = 5;
  int timed = 30;
  int rounds = 3;
  std::vector<int64_t> rows{100'000, 1'000'000, 10'000'000};
  int deadline_seconds = 300;
};

// Each run's `key`, in the runs' order.
std::vector<double> values_of(const std::vector<Json>& runs, const char* key) {
  std::vector<double> out;
  for (const Json& run : runs) out.push_back(run.at(key).get<double>());
  return out;
}

// "min/median/max" of a spread, for the printed tables.
std::string spread_text(const Spread& spread) {
  return fmt::format("{:.2f}/{:.2f}/{:.2f}", spread.min, spread.median, spread.max);
}

// worker0: trains and measures; with `replicated`, the server's steps go to worker2 as well.
Json train(int64_t rows, const Config& config, bool replicated) {
  const auto [rss_before_kb, ignored] =
      rpc::rpc_sync<std::tuple<int64_t, int64_t>>("worker1", "bench.ps_memory_kb");
  (void)ignored;
  auto table = std::make_shared<rpc::RemoteModule<PsEmbeddingBag>>("worker1", std::tuple{rows});
  dist_optim::DistributedOptimizer optimizer("sgd", table->remote_parameters(),
                                             optim::OptionBag().set("lr", kLr));
  if (replicated) {
    dist_optim::replicate_steps(optimizer, {}, {table.get()},
                                dist_optim::ReplicaOptions().backups({{"worker1", "worker2"}}));
  }
  auto generator = at::detail::createCPUGenerator(0);
  const at::Tensor offsets = ps_batch_offsets();
  std::vector<double> iteration, forward, backward, step;
  double last_loss = 0;
  for (int i = 0; i < config.warmup + config.timed; ++i) {
    const at::Tensor ids = ps_batch_ids(rows, generator);
    const auto begin = Clock::now();
    Clock::time_point forward_end, backward_end, step_end;
    {
      dist_autograd::ContextGuard context;
      const at::Tensor loss = table->forward(ids, offsets).pow(2).mean();
      forward_end = Clock::now();
      dist_autograd::backward(context.id(), {loss});
      backward_end = Clock::now();
      optimizer.step(context.id());
      step_end = Clock::now();
      last_loss = loss.item<double>();
    }
    const auto end = Clock::now();
    if (i < config.warmup) continue;
    iteration.push_back(ms_between(begin, end));
    forward.push_back(ms_between(begin, forward_end));
    backward.push_back(ms_between(forward_end, backward_end));
    step.push_back(ms_between(backward_end, step_end));
  }
  const auto [rss_kb, peak_kb] =
      rpc::rpc_sync<std::tuple<int64_t, int64_t>>("worker1", "bench.ps_memory_kb");
  (void)rss_kb;
  return {{"iteration_ms", median(iteration)},
          {"forward_ms", median(forward)},
          {"backward_ms", median(backward)},
          {"step_ms", median(step)},
          {"ps_rss_before_mb", rss_before_kb / 1024.0},
          {"ps_peak_mb", peak_kb / 1024.0},
          {"last_loss", last_loss},
          {"intra_op_threads", at::get_num_threads()}};
}

// --id-table: a batch's uniform ids in [0, rows) spread over the 64-bit space, one to one (an odd
// multiplier and xor-shifts, each invertible modulo 2^64).
at::Tensor raw_ids(const at::Tensor& ids) {
  at::Tensor out = at::empty_like(ids);
  const int64_t* in = ids.data_ptr<int64_t>();
  int64_t* raw = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    uint64_t x = static_cast<uint64_t>(in[i]) * 0x9E3779B97F4A7C15ULL;
    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ULL;
    raw[i] = static_cast<int64_t>(x ^ (x >> 32));
  }
  return out;
}

// worker0 of --id-table: the fixed table (`id_table` false) or the collisionless one, on worker1,
// stepped by Adagrad; measures as train() does, and the server's live rows.
Json train_table(int64_t rows, const Config& config, bool id_table) {
  const auto [rss_before_kb, ignored] =
      rpc::rpc_sync<std::tuple<int64_t, int64_t>>("worker1", "bench.ps_memory_kb");
  (void)ignored;
  std::unique_ptr<rpc::ShardedEmbeddingBag> fixed;
  std::unique_ptr<rpc::ShardedIdEmbeddingBag> collisionless;
  if (id_table) {
    collisionless = std::make_unique<rpc::ShardedIdEmbeddingBag>(
        rpc::ShardedIdEmbeddingBagOptions(rows, kPsDim, {"worker1"}).mode(torch::kSum));
  } else {
    fixed = std::make_unique<rpc::ShardedEmbeddingBag>(
        rpc::ShardedEmbeddingBagOptions(rows, kPsDim, {"worker1"}).mode(torch::kSum));
  }
  dist_optim::DistributedOptimizer optimizer(
      "adagrad", id_table ? collisionless->remote_parameters() : fixed->remote_parameters(),
      optim::OptionBag().set("lr", kLr));
  const at::Tensor offsets = ps_batch_offsets();
  auto forward = [&](const at::Tensor& ids) {
    return id_table ? collisionless->forward(raw_ids(ids), offsets) : fixed->forward(ids, offsets);
  };
  if (id_table) {
    // Every id a row of its own: the table full, as one at its bound.
    constexpr int64_t kFillChunk = kPsBags * kPsIdsPerBag;  // no more memory than a batch
    for (int64_t first = 0; first < rows; first += kFillChunk) {
      const at::Tensor ids = at::arange(first, std::min(rows, first + kFillChunk), at::kLong);
      collisionless->forward(raw_ids(ids).reshape({-1, 1}));
    }
  }
  auto generator = at::detail::createCPUGenerator(0);
  std::vector<double> iteration;
  double last_loss = 0;
  for (int i = 0; i < config.warmup + config.timed; ++i) {
    const at::Tensor ids = ps_batch_ids(rows, generator);
    const auto begin = Clock::now();
    {
      dist_autograd::ContextGuard context;
      const at::Tensor loss = forward(ids).pow(2).mean();
      dist_autograd::backward(context.id(), {loss});
      optimizer.step(context.id());
      last_loss = loss.item<double>();
    }
    if (i >= config.warmup) iteration.push_back(ms_between(begin, Clock::now()));
  }
  const auto [rss_kb, peak_kb] =
      rpc::rpc_sync<std::tuple<int64_t, int64_t>>("worker1", "bench.ps_memory_kb");
  const int64_t live_rows = id_table ? collisionless->shard_counters().at(0).at("live_rows") : rows;
  return {{"iteration_ms", median(iteration)},
          {"ps_rss_before_mb", rss_before_kb / 1024.0},
          {"ps_peak_mb", peak_kb / 1024.0},
          {"ps_rss_mb", rss_kb / 1024.0},
          {"live_rows", live_rows},
          {"last_loss", last_loss}};
}

void run_worker(int64_t rows, const Config& config, int world_size, bool replicated,
                const std::string& table) {
  const int rank = init_ps_worker(world_size, 60s, std::chrono::seconds(config.deadline_seconds));
  if (rank == 0) {
    print_result(table.empty() ? train(rows, config, replicated)
                               : train_table(rows, config, table == "id"));
  }
  rpc::shutdown();
}

// --id-table: ours with the fixed table and with the collisionless one, alternating; prints the
// table and returns the results file's cases (or problems).
Json compare_tables(const Config& config, const std::string& self, const std::string& counts,
                    std::vector<std::string>& problems) {
  const double load_at_start = load_average();
  auto job = [&](int64_t rows, bool id_table) {
    return run_side(id_table ? "our workers, collisionless table" : "our workers, fixed table",
                    {DISTOPTIM_DISTRUN_PATH, "--nproc-per-node", std::to_string(kWorldSize), self,
                     "--worker", "--worker-rows", std::to_string(rows), "--worker-table",
                     id_table ? "id" : "fixed", "--steps", counts},
                    config.deadline_seconds)
        .front();
  };
  std::map<int64_t, std::pair<std::vector<Json>, std::vector<Json>>> runs;
  for (int64_t rows : config.rows) {
    runs[rows] = alternate_rounds(
        "sparse_ps_bench", rows_label(rows) + " rows, fixed and collisionless tables",
        config.rounds, [&] { return job(rows, false); }, [&] { return job(rows, true); });
  }
  const double load_at_end = load_average();
  // What a row and its Adagrad state hold: the bound a table's memory per row is measured against.
  const double row_bytes = 2.0 * kPsDim * sizeof(float);
  // The server's growth per row, at its peak or at the end (`at`), from before the table.
  auto bytes_per_row = [&](const std::vector<Json>& side, const char* at) {
    std::vector<double> out;
    for (const Json& run : side) {
      const double growth =
          (run.at(at).get<double>() - run.at("ps_rss_before_mb").get<double>()) * 1024 * 1024;
      out.push_back(growth / run.at("live_rows").get<double>());
    }
    return median(out);
  };
  fmt::print(
      "\nsparse_ps_bench --id-table: the same job (trainer, parameter server) with a collisionless "
      "table (ShardedIdEmbeddingBag, R rows, full: every one of R raw ids looked up once before "
      "timing) and with a fixed one (ShardedEmbeddingBag, R rows), {} floats a row, sum, Adagrad "
      "lr "
      "{}; batch {} bags of {} uniform ids (spread over the 64-bit space for the collisionless "
      "table); {} warm-up + {} timed iterations per run, {} rounds per size alternating; 1 "
      "intra-op thread per process, {} RPC worker threads\n",
      kPsDim, kLr, kPsBags, kPsIdsPerBag, config.warmup, config.timed, config.rounds,
      kPsRpcThreads);
  fmt::print("{}\n\n", machine_load_line(load_at_start, load_at_end));
  fmt::print("{:<6} {:>26} {:>26} {:>18} {:>28} {:>28}\n", "rows", "fixed ms (min/med/max)",
             "collisionless ms (min/med/max)", "samples/s id/fixed",
             fmt::format("end B/row fixed, id ({:.0f})", row_bytes),
             fmt::format("peak B/row fixed, id ({:.0f})", row_bytes));
  Json cases = Json::array();
  for (int64_t rows : config.rows) {
    const auto& [fixed, ids] = runs[rows];
    const Spread a = spread_of(values_of(fixed, "iteration_ms"));
    const Spread b = spread_of(values_of(ids, "iteration_ms"));
    const double fixed_bytes = bytes_per_row(fixed, "ps_rss_mb"),
                 id_bytes = bytes_per_row(ids, "ps_rss_mb");
    fmt::print("{:<6} {:>26} {:>26} {:>17.2f}x {:>28} {:>28}\n", rows_label(rows), spread_text(a),
               spread_text(b), a.median / b.median,
               fmt::format("{:.0f}, {:.0f}", fixed_bytes, id_bytes),
               fmt::format("{:.0f}, {:.0f}", bytes_per_row(fixed, "ps_peak_mb"),
                           bytes_per_row(ids, "ps_peak_mb")));
    const std::string label = rows_label(rows);
    cases.push_back(spread_row("iteration, fixed table, " + label + " rows",
                               values_of(fixed, "iteration_ms"), "ms", "lower"));
    cases.push_back(spread_row("iteration, collisionless table, " + label + " rows",
                               values_of(ids, "iteration_ms"), "ms", "lower"));
    cases.push_back({{"case", "samples/s, collisionless / fixed table, " + label + " rows"},
                     {"ours", a.median / b.median},
                     {"unit", "x"},
                     {"better", "higher"}});
    cases.push_back({{"case",
                      "memory per live row at the end / row and state bytes, "
                      "collisionless, " +
                          label + " rows"},
                     {"ours", id_bytes / row_bytes},
                     {"unit", "x"},
                     {"better", "lower"}});
    cases.push_back(
        {{"case", "memory per row at the end / row and state bytes, fixed, " + label + " rows"},
         {"ours", fixed_bytes / row_bytes},
         {"unit", "x"},
         {"better", "lower"}});
    for (const Json& run : ids) {
      if (run.at("live_rows").get<int64_t>() != rows) {
        problems.push_back(fmt::format("the collisionless table held {} live rows of {}",
                                       run.at("live_rows").get<int64_t>(), rows));
      }
    }
  }
  return cases;
}

// --replica: ours without and with one replica, alternating; prints the table and returns the
// results file's cases.
Json compare_replica(const Config& config, const std::string& self, const std::string& counts) {
  const double load_at_start = load_average();
  auto job = [&](int64_t rows, bool replicated) {
    std::vector<std::string> command = {DISTOPTIM_DISTRUN_PATH,
                                        "--nproc-per-node",
                                        std::to_string(kReplicaWorldSize),
                                        self,
                                        "--worker",
                                        "--worker-rows",
                                        std::to_string(rows),
                                        "--worker-world-size",
                                        std::to_string(kReplicaWorldSize),
                                        "--steps",
                                        counts};
    if (replicated) command.push_back("--worker-replicated");
    return run_side(replicated ? "our workers, one replica" : "our workers, no replica", command,
                    config.deadline_seconds)
        .front();
  };
  std::map<int64_t, std::pair<std::vector<Json>, std::vector<Json>>> runs;
  for (int64_t rows : config.rows) {
    runs[rows] = alternate_rounds(
        "sparse_ps_bench", rows_label(rows) + " rows, without and with a replica", config.rounds,
        [&] { return job(rows, false); }, [&] { return job(rows, true); });
  }
  const double load_at_end = load_average();
  fmt::print(
      "\nsparse_ps_bench --replica: the same job (3 processes: trainer, parameter server, its "
      "backup) with the server's steps copied to the backup before they return "
      "(dist_optim::replicate_steps) and without; {} warm-up + {} timed iterations per run, {} "
      "rounds per size alternating; 1 intra-op thread per process, {} RPC worker threads\n",
      config.warmup, config.timed, config.rounds, kPsRpcThreads);
  fmt::print("{}\n\n", machine_load_line(load_at_start, load_at_end));
  fmt::print("{:<6} {:>26} {:>26} {:>10} {:>30}\n", "rows", "no replica ms (min/med/max)",
             "one replica ms (min/med/max)", "cost", "step ms, no replica / replica");
  Json cases = Json::array();
  for (int64_t rows : config.rows) {
    const auto& [without, with] = runs[rows];
    const Spread a = spread_of(values_of(without, "iteration_ms"));
    const Spread b = spread_of(values_of(with, "iteration_ms"));
    fmt::print("{:<6} {:>26} {:>26} {:>9.2f}x {:>30}\n", rows_label(rows), spread_text(a),
               spread_text(b), b.median / a.median,
               fmt::format("{:.2f} / {:.2f}", median(values_of(without, "step_ms")),
                           median(values_of(with, "step_ms"))));
    const std::string label = rows_label(rows);
    cases.push_back(spread_row("iteration without a replica, " + label + " rows",
                               values_of(without, "iteration_ms"), "ms", "lower"));
    cases.push_back(spread_row("iteration with one replica, " + label + " rows",
                               values_of(with, "iteration_ms"), "ms", "lower"));
    cases.push_back({{"case", "replica cost (medians' ratio), " + label + " rows"},
                     {"ours", b.median / a.median},
                     {"unit", "x"},
                     {"better", "lower"}});
  }
  return cases;
}

// --- the driver ------------------------------------------------------------------------------

int run(int argc, char** argv) {
  Config config;
  std::string json_path;
  std::string steps;
  bool quick = false;
  bool worker = false;
  bool replica = false;
  bool worker_replicated = false;
  bool id_table = false;
  std::string worker_table;
  int worker_world_size = kWorldSize;
  int64_t worker_rows = 0;
  std::string python = DISTOPTIM_REFERENCE_PYTHON;
  std::string script = DISTOPTIM_PYTORCH_SPARSE_PS_SCRIPT;
  CLI::App app{"Sparse parameter-server benchmark: distoptim against PyTorch"};
  app.add_option("--json", json_path, "Write the results as JSON to this file");
  app.add_option("--rounds", config.rounds, "Rounds of ours then PyTorch's per table size")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "W,T: warm-up and timed iterations (default 5,30)");
  app.add_option("--rows", config.rows, "Table sizes (default 1e5 1e6 1e7)");
  app.add_flag("--quick", quick, "One round, few iterations, small tables: a smoke run");
  app.add_option("--deadline-seconds", config.deadline_seconds, "each run is killed past this")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--python", python, "Python with PyTorch 1.13")->capture_default_str();
  app.add_flag("--worker", worker, "Run as one of our workers (started by the benchmark)");
  app.add_option("--worker-rows", worker_rows)->group("");
  app.add_option("--worker-world-size", worker_world_size)->group("");
  app.add_flag("--worker-replicated", worker_replicated)->group("");
  app.add_option("--worker-table", worker_table)->group("")->check(CLI::IsMember({"fixed", "id"}));
  app.add_flag("--replica", replica,
               "Measure one replica's cost (ours with and without) instead of PyTorch against us");
  app.add_flag("--id-table", id_table,
               "Measure the collisionless table against the fixed one (ours alone) instead")
      ->excludes("--replica");
  CLI11_PARSE(app, argc, argv);
  if (!steps.empty()) {
    StepCounts counts{config.warmup, config.timed};
    parse_step_counts("--steps", steps, counts);
    config.warmup = counts.warmup;
    config.timed = counts.timed;
  }
  if (worker) {
    run_worker(worker_rows, config, worker_world_size, worker_replicated, worker_table);
    return 0;
  }
  if ((replica || id_table) && app.count("--rows") == 0) config.rows = {100'000, 1'000'000};
  if (quick) {
    config.rounds = 1;
    config.warmup = 2;
    config.timed = 5;
    config.rows = {10'000, 100'000};
  }
  ResultsFile results_file(json_path, "sparse_ps_bench");
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string counts = fmt::format("{},{}", config.warmup, config.timed);
  if (replica) return results_file.write_unless(compare_replica(config, self, counts), {});
  if (id_table) {
    std::vector<std::string> problems;
    Json cases = compare_tables(config, self, counts, problems);
    return results_file.write_unless(cases, problems);
  }
  const double load_at_start = load_average();

  std::map<int64_t, std::vector<Json>> ours, pytorch;
  for (int64_t rows : config.rows) {
    std::tie(ours[rows], pytorch[rows]) = alternate_rounds(
        "sparse_ps_bench", rows_label(rows) + " rows", config.rounds,
        [&] {
          return run_side(
                     "our workers (distrun)",
                     {DISTOPTIM_DISTRUN_PATH, "--nproc-per-node", std::to_string(kWorldSize), self,
                      "--worker", "--worker-rows", std::to_string(rows), "--steps", counts},
                     config.deadline_seconds)
              .front();
        },
        [&] {
          return run_side(script,
                          {python, script, "--rows", std::to_string(rows), "--steps", counts},
                          config.deadline_seconds)
              .front();
        });
  }
  const double load_at_end = load_average();

  // Each side's iteration per table size, over the rounds.
  auto per_rows = [](const std::vector<Json>& runs, const char* key) {
    return spread_of(values_of(runs, key));
  };
  fmt::print(
      "\nsparse_ps_bench: a parameter server's EmbeddingBag (R x {} floats, sum, sparse "
      "gradients) trained through RPC + distributed autograd + DistributedOptimizer(SGD lr {}), "
      "distoptim vs PyTorch {}\n",
      kPsDim, kLr, pytorch.begin()->second.front().value("torch_version", "?"));
  fmt::print(
      "batch: {} bags of {} uniform random ids; {} warm-up + {} timed iterations per run, {} "
      "rounds per size alternating ours and PyTorch's; settings, both sides: 1 intra-op thread "
      "per process, {} RPC worker threads, 60 s RPC timeout (PyTorch: TensorPipe, "
      "TensorPipeRpcBackendOptions(num_worker_threads={}, rpc_timeout=60), defaults otherwise)\n",
      kPsBags, kPsIdsPerBag, config.warmup, config.timed, config.rounds, kPsRpcThreads,
      kPsRpcThreads);
  fmt::print("{}\n\n", machine_load_line(load_at_start, load_at_end));
  fmt::print("{:<6} {:>26} {:>26} {:>12} {:>22} {:>22}\n", "rows", "ours ms (min/med/max)",
             "pytorch ms (min/med/max)", "ours faster", "ours ps peak/table MB",
             "pytorch ps peak/table MB");
  Json cases = Json::array();
  std::vector<std::string> problems;
  for (int64_t rows : config.rows) {
    const Spread o = per_rows(ours[rows], "iteration_ms");
    const Spread p = per_rows(pytorch[rows], "iteration_ms");
    const double table_mb = rows * kPsDim * 4 / (1024.0 * 1024.0);
    auto growth = [&](const std::vector<Json>& runs) {
      return per_rows(runs, "ps_peak_mb").median - per_rows(runs, "ps_rss_before_mb").median;
    };
    fmt::print("{:<6} {:>26} {:>26} {:>11.2f}x {:>22} {:>22}\n", rows_label(rows), spread_text(o),
               spread_text(p), p.median / o.median,
               fmt::format("{:.0f}/{:.0f}", growth(ours[rows]), table_mb),
               fmt::format("{:.0f}/{:.0f}", growth(pytorch[rows]), table_mb));
    const std::string label = rows_label(rows);
    cases.push_back(comparison_row("iteration, " + label + " rows", o, p,
                                   static_cast<size_t>(config.rounds), "ms", true));
    cases.push_back({{"case", "samples/s, " + label + " rows"},
                     {"ours", kPsBags * 1e3 / o.median},
                     {"pytorch", kPsBags * 1e3 / p.median},
                     {"unit", "bags/s"},
                     {"better", "higher"}});
    cases.push_back({{"case", "ps memory growth, " + label + " rows"},
                     {"ours", growth(ours[rows])},
                     {"pytorch", growth(pytorch[rows])},
                     {"unit", "MB"},
                     {"better", "lower"}});
    for (const auto& run : ours[rows]) {
      if (!std::isfinite(run.at("last_loss").get<double>())) {
        problems.push_back("ours: the loss is not finite at " + label + " rows");
      }
    }
  }
  for (const auto& [side, runs] : {std::pair{"ours", &ours}, std::pair{"pytorch", &pytorch}}) {
    fmt::print("{} phases (median of runs' medians, ms): ", side);
    for (int64_t rows : config.rows) {
      fmt::print("{}: forward {:.2f}, backward {:.2f}, step {:.2f}; ", rows_label(rows),
                 per_rows((*runs)[rows], "forward_ms").median,
                 per_rows((*runs)[rows], "backward_ms").median,
                 per_rows((*runs)[rows], "step_ms").median);
    }
    fmt::print("\n");
  }
  const int64_t smallest = config.rows.front(), largest = config.rows.back();
  fmt::print(
      "ours: the iteration at {} rows is {:.2f}x the one at {} rows (the issue's bound: 1.3x)\n\n",
      rows_label(largest),
      per_rows(ours[largest], "iteration_ms").median /
          per_rows(ours[smallest], "iteration_ms").median,
      rows_label(smallest));
  return results_file.write_unless(cases, problems);
}

}  // namespace
}  // namespace bench
}  // namespace distoptim

int main(int argc, char** argv) {
  return distoptim::bench::run_main("sparse_ps_bench", distoptim::bench::run, argc, argv);
}
