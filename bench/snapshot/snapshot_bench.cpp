// snapshot_bench: what a snapshot of a parameter server's table costs the trainer that goes on
// stepping while the server writes it. The question it answers: are trainers stopped for a snapshot
// beyond a stated bound? A step's p50, p99 and max during a snapshot of a 1e7-row table, against
// the same steps without one.
//
// A job of 1 + --servers processes on loopback, this program again (`--worker`), started by
// distrun: worker0 the trainer, worker1.. the parameter servers. The model: an
// rpc::ShardedEmbeddingBag of R rows x 32 floats split over the servers (sum pooling), a batch
// of 512 bags of 8 uniformly random ids, loss = mean of the pooled rows squared, a
// DistributedOptimizer "adagrad" (lr 0.01), so that every row has state: the servers hold 2 x
// R x 128 bytes (2.56 GB at 1e7 rows), and a snapshot copies and writes both. A step: a
// distributed autograd context, the forward, the distributed backward, the optimizer's step, the
// context's release, and SnapshotSchedule::step().
//
// Each round (--rounds) runs, in this order:
//   without: W warm-up steps, then T timed steps, each calling step() of a schedule that never
//            begins a snapshot (made at the round's start, timed apart: making a schedule has the
//            servers map the memory of their copies, kept from then on, so in the first round
//            only);
//   during:  W warm-up steps as above, then the same T timed steps counted by a second
//            dist_optim::SnapshotSchedule (every_steps P, keep_last 1) made just before them: a
//            snapshot begins at timed steps P, 2P, ... (5 at the defaults, each written over a
//            few hundred steps here), so that the steps while written number over a thousand a
//            round. Each step's time is kept, and whether a snapshot was being written during
//            it: from the step whose schedule.step() begins it (the trainer waits there for the
//            servers' copies) to the one whose schedule.step() finishes it (if the T steps end
//            first, flush() finishes the last, the trainer waiting); the rest of the phase's
//            steps are "between snapshots". A snapshot's duration is the time from that begin
//            to that finish (seen at step granularity), its size the bytes of its directory
//            (the manifest and blocks);
//   blocking: in the last --blocking-rounds rounds (1), one save_snapshot of the same optimizer
//            and table: what a trainer waits for with the synchronous API.
// The round's snapshot directories are removed at its end, and the page cache synced, so no
// round's writes spill into the next. Phases alternate within and across rounds (without,
// during, without, ...), so the machine's drift falls on both alike. The figures of a phase: the
// p50 (median), p99 (nearest rank) and max of its steps' times, which step was the longest, their
// total, and for "during" the same of the steps while written and of those between; each figure
// is given as the min/median/max over the rounds, and so are the ratios of each round's p50 and
// p99: during / without, while written / without, and while written / between (the last two
// interleaved within one phase, so the slower drift of a shared machine falls on both); the p99
// ratio while written / without is also given over every round's steps pooled, the headline
// figure. Each snapshot: its duration from begin to finished, its bytes and their rate; the
// blocking save's wall time and rate. The machine's disk: in every round, once its snapshots are
// removed and synced, dd writes as many MiB as a snapshot's bytes into the snapshot directory's
// file system with conv=fdatasync, timed as a whole (the snapshot's files are fsynced too),
// twice: through the page cache in 1 MiB writes (the common dd probe of a disk), then around it
// with oflag=direct in 4 MiB writes, as the snapshot writes (a disk may take direct writes far
// faster than the page cache hands it buffered ones); each snapshot's rate over each dd's of its
// round says whether the background write keeps up with the disk (a virtual disk's rate drifts
// between minutes, so one probe beside three rounds says little).
//
// There is no PyTorch side: PyTorch has no snapshot of a parameter server (its
// DistributedOptimizer has no state dict), so ours during a snapshot is compared with ours
// without one.
//
// Settings: 1 intra-op thread per process, 16 RPC worker threads, a 300 s RPC timeout (a
// server's write of its shard is one call). The output states them with the load average.
//
// Usage: snapshot_bench --json PATH [--rounds 6] [--steps W,T] [--every-steps P] [--rows R]
//                       [--servers 1|2] [--disk-share D] [--blocking-rounds 1] [--dir DIR]
//                       [--quick]

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <numeric>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/core.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/dist_optim/snapshot.h>
#include <distoptim/rpc.h>
#include <distoptim/rpc/sharded_embedding_bag.h>

#include "../common/child_process.h"
#include "../common/ps_job.h"
#include "../common/report.h"

namespace distoptim {
namespace bench {
namespace {

namespace fs = std::filesystem;
namespace rpc = distoptim::rpc;
using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr double kLr = 0.01;
constexpr auto kRpcTimeout = 300s;

struct Config {
  int warmup = 20;
  int timed = 3000;
  // A snapshot begins every this many timed steps of the "during" phase (at P, 2P, ... <= T): 5
  // at the defaults, each written over about 230 steps here, so that a round's p99 while
  // written rests on about 1150 steps. (One snapshot a round, about 230 steps, made its p99
  // their second or third longest, and the ratio of one build swung from 1.1x to 2.5x between
  // runs.)
  int every = 520;
  // SnapshotOptions::disk_share of the scheduled snapshots.
  double disk_share = 1;
  int rounds = 6;
  int64_t rows = 10'000'000;
  int servers = 1;
  // The blocking save_snapshot in the last this many rounds (each writes the whole table again:
  // at 1e7 rows, as long as the rest of a round).
  int blocking_rounds = 1;
  std::string directory = "/tmp/distoptim_snapshot_bench";
  int deadline_seconds = 1500;
};

// The bytes of the files under `directory` (their sizes, as du --apparent-size counts them).
int64_t bytes_under(const fs::path& directory) {
  int64_t bytes = 0;
  for (const auto& entry : fs::recursive_directory_iterator(directory)) {
    if (entry.is_regular_file()) bytes += static_cast<int64_t>(entry.file_size());
  }
  return bytes;
}

// p50, p99 and max of a phase's step times (ms), which of its steps was the longest (1: the
// first), and their sum.
Json step_figures(const std::vector<double>& ms) {
  if (ms.empty()) return Json{{"steps", 0}};
  const auto longest = std::max_element(ms.begin(), ms.end());
  return Json{{"p50", percentile(ms, 50)},
              {"p99", percentile(ms, 99)},
              {"max", *longest},
              {"max_at", longest - ms.begin() + 1},
              {"total_s", std::accumulate(ms.begin(), ms.end(), 0.0) / 1e3},
              {"steps", ms.size()}};
}

// dd's write of `mib` MiB into `directory`, timed as a whole, then synced (conv=fdatasync):
// MB/s. `direct`: around the page cache (oflag=direct) in 4 MiB writes, as the snapshot writes its
// files; else through it in 1 MiB writes, the common dd probe of a disk.
double disk_write_mb_per_s(const fs::path& directory, int64_t mib, bool direct) {
  const fs::path file = directory / "dd.tmp";
  const int64_t block_mib = direct ? 4 : 1;
  const int64_t blocks = (mib + block_mib - 1) / block_mib;
  std::vector<std::string> argv = {"/usr/bin/dd",
                                   "if=/dev/zero",
                                   "of=" + file.string(),
                                   fmt::format("bs={}M", block_mib),
                                   "count=" + std::to_string(blocks),
                                   "conv=fdatasync",
                                   "status=none"};
  if (direct) argv.push_back("oflag=direct");
  const auto begin = Clock::now();
  const ChildResult dd = run_child(argv, "");
  const double seconds = ms_between(begin, Clock::now()) / 1e3;
  fs::remove(file);
  TORCH_CHECK(dd.exit_code == 0, "snapshot_bench: dd into ", directory.string(),
              " exited with status ", dd.exit_code);
  return static_cast<double>(blocks * block_mib) * 1024.0 * 1024.0 / 1e6 / seconds;
}

// worker0: trains, snapshots, measures.
class Trainer {
 public:
  Trainer(const Config& config, std::vector<std::string> servers)
      : config_(config),
        table_(rpc::ShardedEmbeddingBagOptions(config.rows, kPsDim, std::move(servers))
                   .mode(torch::kSum)),
        optimizer_("adagrad", table_.remote_parameters(), optim::OptionBag().set("lr", kLr)),
        generator_(at::detail::createCPUGenerator(0)),
        offsets_(ps_batch_offsets()) {}

  Json round(int index) {
    const fs::path scheduled = fs::path(config_.directory) / fmt::format("round-{}", index);
    const fs::path blocking = fs::path(config_.directory) / fmt::format("round-{}-save", index);
    Json result;
    {
      // Counts the steps outside the snapshots' timed steps and never begins one, so that every
      // step calls a schedule's step() alike; making it maps the servers' copies' memory.
      const auto made_at = Clock::now();
      dist_optim::SnapshotSchedule idle(dist_optim::SnapshotOptions(scheduled.string()), optimizer_,
                                        {&table_});
      const double schedule_made_s = ms_between(made_at, Clock::now()) / 1e3;
      std::vector<double> without;
      for (int i = 0; i < config_.warmup + config_.timed; ++i) {
        const double ms = step(idle).ms;
        if (i >= config_.warmup) without.push_back(ms);
      }
      for (int i = 0; i < config_.warmup; ++i) step(idle);

      // The timed steps count from 0 here: a snapshot begins at timed steps P, 2P, ...
      dist_optim::SnapshotSchedule schedule(dist_optim::SnapshotOptions(scheduled.string())
                                                .every_steps(config_.every)
                                                .keep_last(1)
                                                .disk_share(config_.disk_share),
                                            optimizer_, {&table_});
      std::vector<double> during, while_written, between;
      Json snapshots = Json::array();
      Clock::time_point begun;
      int64_t begun_count = 0;
      // The snapshot just finished: its time and bytes (the next one to finish removes it).
      auto record = [&](int64_t finished_step, Clock::time_point done, bool in_phase) {
        const std::optional<dist_optim::SnapshotInfo> latest =
            dist_optim::latest_snapshot(scheduled.string());
        TORCH_CHECK(latest && latest->step == finished_step,
                    "snapshot_bench: the schedule finished the snapshot of step ", finished_step,
                    " but the latest complete one is ", latest ? latest->step : -1);
        snapshots.push_back({{"step", finished_step},
                             {"seconds", ms_between(begun, done) / 1e3},
                             {"bytes", bytes_under(latest->path)},
                             {"finished_in_phase", in_phase}});
      };
      for (int i = 0; i < config_.timed; ++i) {
        const bool writing_before = schedule.writing().has_value();
        const Step timed = step(schedule);
        if (timed.finished) record(*timed.finished, Clock::now(), true);
        const bool begins = schedule.writing() && (!writing_before || timed.finished.has_value());
        if (begins) {
          begun = timed.schedule_called;
          ++begun_count;
        }
        during.push_back(timed.ms);
        (writing_before || schedule.writing() ? while_written : between).push_back(timed.ms);
      }
      if (schedule.writing()) {
        const int64_t last = *schedule.flush();
        record(last, Clock::now(), false);
      }
      TORCH_CHECK(static_cast<int64_t>(snapshots.size()) == begun_count && begun_count > 0,
                  "snapshot_bench: ", begun_count, " snapshots begun in the timed steps and ",
                  snapshots.size(), " finished");
      pooled_without_.insert(pooled_without_.end(), without.begin(), without.end());
      pooled_written_.insert(pooled_written_.end(), while_written.begin(), while_written.end());
      pooled_between_.insert(pooled_between_.end(), between.begin(), between.end());

      const double pooled_written_p99 = percentile(pooled_written_, 99);
      result = {{"without", step_figures(without)},
                {"during", step_figures(during)},
                {"while_written", step_figures(while_written)},
                {"between", step_figures(between)},
                {"snapshots", snapshots},
                {"pooled_p99_ratio", pooled_written_p99 / percentile(pooled_without_, 99)},
                {"pooled_p99_ratio_between", pooled_written_p99 / percentile(pooled_between_, 99)},
                {"schedule_made_s", schedule_made_s},
                {"last_loss", last_loss_}};
      if (index > config_.rounds - config_.blocking_rounds) {
        const auto save_begin = Clock::now();
        dist_optim::save_snapshot(blocking.string(), optimizer_, {&table_});
        result["blocking_s"] = ms_between(save_begin, Clock::now()) / 1e3;
        result["blocking_bytes"] = bytes_under(blocking);
      }
    }
    fs::remove_all(scheduled);
    fs::remove_all(blocking);
    ::sync();
    // The disk's rate now, for as many bytes as a snapshot wrote.
    const int64_t mib =
        (result.at("snapshots").at(0).at("bytes").get<int64_t>() + (1 << 20) - 1) >> 20;
    result["dd_mb_s"] = disk_write_mb_per_s(config_.directory, mib, /*direct=*/false);
    result["dd_direct_mb_s"] = disk_write_mb_per_s(config_.directory, mib, /*direct=*/true);
    return result;
  }

 private:
  struct Step {
    double ms;                          // the whole step, schedule.step() included
    std::optional<int64_t> finished;    // the snapshot schedule.step() finished, if any
    Clock::time_point schedule_called;  // when schedule.step() was called
  };
  // One step and the schedule's count of it.
  Step step(dist_optim::SnapshotSchedule& schedule) {
    const at::Tensor ids = ps_batch_ids(config_.rows, generator_);
    const auto begin = Clock::now();
    {
      dist_autograd::ContextGuard context;
      const at::Tensor loss = table_.forward(ids, offsets_).pow(2).mean();
      dist_autograd::backward(context.id(), {loss});
      optimizer_.step(context.id());
      last_loss_ = loss.item<double>();
    }
    Step result;
    result.schedule_called = Clock::now();
    result.finished = schedule.step();
    result.ms = ms_between(begin, Clock::now());
    return result;
  }

  const Config& config_;
  // Every round's timed steps so far: without a snapshot, while one was written, between.
  std::vector<double> pooled_without_, pooled_written_, pooled_between_;
  rpc::ShardedEmbeddingBag table_;
  dist_optim::DistributedOptimizer optimizer_;
  at::Generator generator_;
  at::Tensor offsets_;
  double last_loss_ = 0;
};

void run_worker(const Config& config) {
  const int rank = init_ps_worker(1 + config.servers, kRpcTimeout,
                                  std::chrono::seconds(config.deadline_seconds));
  if (rank == 0) {
    std::vector<std::string> servers;
    for (int s = 1; s <= config.servers; ++s) servers.push_back("worker" + std::to_string(s));
    Trainer trainer(config, servers);
    Json rounds = Json::array();
    for (int r = 0; r < config.rounds; ++r) {
      fmt::print(stderr, "snapshot_bench: round {} of {}...\n", r + 1, config.rounds);
      rounds.push_back(trainer.round(r + 1));
    }
    print_result({{"rounds", rounds}, {"intra_op_threads", at::get_num_threads()}});
  }
  rpc::shutdown();
}

// --- the driver ------------------------------------------------------------------------------

int run(int argc, char** argv) {
  Config config;
  std::string json_path;
  std::string steps;
  bool quick = false;
  bool worker = false;
  CLI::App app{"Snapshot benchmark: a trainer's steps during a parameter server's snapshot"};
  app.add_option("--json", json_path, "Write the results as JSON to this file");
  app.add_option("--rounds", config.rounds, "Rounds of without, during, blocking")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "W,T: warm-up and timed steps per phase (default 20,3000)");
  app.add_option("--every-steps", config.every,
                 "P: a snapshot begins every P timed steps of the during phase (default 520)")
      ->check(CLI::PositiveNumber);
  app.add_option("--disk-share", config.disk_share,
                 "SnapshotOptions::disk_share of the scheduled snapshots (0 < D <= 1)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--rows", config.rows, "Rows of the table")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--servers", config.servers, "Parameter servers holding the table's shards")
      ->capture_default_str()
      ->check(CLI::Range(1, 2));
  app.add_option("--blocking-rounds", config.blocking_rounds,
                 "The blocking save_snapshot in the last this many rounds (0: none)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--dir", config.directory,
                 "Where the snapshots are written (on local disk; removed after each round)")
      ->capture_default_str();
  app.add_flag("--quick", quick, "One round, 1e6 rows, fewer steps: a smoke run");
  app.add_option("--deadline-seconds", config.deadline_seconds, "the job is killed past this")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_flag("--worker", worker, "Run as one of the job's processes (started by the benchmark)");
  CLI11_PARSE(app, argc, argv);
  if (quick) {
    config.rounds = 1;
    config.warmup = 5;
    config.timed = 500;
    if (app.count("--every-steps") == 0) config.every = 90;
    if (app.count("--rows") == 0) config.rows = 1'000'000;
  }
  if (!steps.empty()) {
    StepCounts counts{config.warmup, config.timed};
    parse_step_counts("--steps", steps, counts);
    config.warmup = counts.warmup;
    config.timed = counts.timed;
  }
  config.blocking_rounds = std::min(config.blocking_rounds, config.rounds);
  TORCH_CHECK_VALUE(config.every <= config.timed, "--every-steps: ", config.every,
                    " is more than the ", config.timed, " timed steps: no snapshot would begin");
  if (worker) {
    run_worker(config);
    return 0;
  }

  ResultsFile results_file(json_path, "snapshot_bench");
  const double load_at_start = load_average();
  // Room for two snapshots at a time (the parameters and their Adagrad sums, plus headers), and
  // for dd's as many bytes after it.
  const double state_gb = 2.0 * config.rows * kPsDim * 4 / 1e9;
  // A directory of this run's own under --dir, so that nothing else in --dir is removed.
  config.directory =
      (fs::absolute(config.directory) / fmt::format("snapshot_bench.{}", ::getpid())).string();
  fs::create_directories(config.directory);
  const double free_gb = static_cast<double>(fs::space(config.directory).available) / 1e9;
  // keep_last 1: the last complete snapshot stays until the next is complete.
  const double needed_gb = 2.2 * state_gb + 1.0;
  TORCH_CHECK(free_gb >= needed_gb, "snapshot_bench: ", config.directory, " has ", free_gb,
              " GB free; a snapshot of ", config.rows, " rows needs about ", needed_gb);

  const std::string self = fs::read_symlink("/proc/self/exe").string();
  const Json job = run_side("the job (distrun)",
                            {DISTOPTIM_DISTRUN_PATH,
                             "--nproc-per-node",
                             std::to_string(1 + config.servers),
                             self,
                             "--worker",
                             "--rows",
                             std::to_string(config.rows),
                             "--servers",
                             std::to_string(config.servers),
                             "--rounds",
                             std::to_string(config.rounds),
                             "--blocking-rounds",
                             std::to_string(config.blocking_rounds),
                             "--steps",
                             fmt::format("{},{}", config.warmup, config.timed),
                             "--every-steps",
                             std::to_string(config.every),
                             "--disk-share",
                             fmt::format("{}", config.disk_share),
                             "--dir",
                             config.directory,
                             "--deadline-seconds",
                             std::to_string(config.deadline_seconds)},
                            config.deadline_seconds)
                       .front();
  fs::remove_all(config.directory);
  const double load_at_end = load_average();

  const Json& rounds = job.at("rounds");
  auto over_rounds = [&](const std::string& phase, const std::string& figure) {
    std::vector<double> values;
    for (const Json& round : rounds) values.push_back(round.at(phase).at(figure).get<double>());
    return values;
  };
  auto per_round = [&](const std::function<double(const Json&)>& of) {
    std::vector<double> values;
    for (const Json& round : rounds) values.push_back(of(round));
    return values;
  };
  // Every snapshot of every round; its rate also over its round's dd's.
  std::vector<double> snapshot_s, snapshot_mb, snapshot_mb_s, of_dd, of_dd_direct;
  double finished_in_phase = 0;
  for (const Json& round : rounds) {
    for (const Json& snapshot : round.at("snapshots")) {
      snapshot_s.push_back(snapshot.at("seconds").get<double>());
      snapshot_mb.push_back(snapshot.at("bytes").get<double>() / 1e6);
      snapshot_mb_s.push_back(snapshot_mb.back() / snapshot_s.back());
      of_dd.push_back(snapshot_mb_s.back() / round.at("dd_mb_s").get<double>());
      of_dd_direct.push_back(snapshot_mb_s.back() / round.at("dd_direct_mb_s").get<double>());
      finished_in_phase += snapshot.at("finished_in_phase").get<bool>() ? 1 : 0;
    }
  }
  std::vector<double> blocking_s, blocking_mb_s;
  for (const Json& round : rounds) {
    if (!round.contains("blocking_s")) continue;
    blocking_s.push_back(round.at("blocking_s").get<double>());
    blocking_mb_s.push_back(round.at("blocking_bytes").get<double>() / 1e6 / blocking_s.back());
  }
  const std::vector<double> dd_mb_s =
      per_round([](const Json& r) { return r.at("dd_mb_s").get<double>(); });
  const std::vector<double> dd_direct_mb_s =
      per_round([](const Json& r) { return r.at("dd_direct_mb_s").get<double>(); });
  const std::vector<double> written_steps =
      per_round([](const Json& r) { return r.at("while_written").at("steps").get<double>(); });
  const std::vector<double> snapshots_per_round =
      per_round([](const Json& r) { return static_cast<double>(r.at("snapshots").size()); });
  const std::string settings = fmt::format(
      "1 trainer + {} parameter server(s) on one machine (loopback, distrun); "
      "ShardedEmbeddingBag of {} rows x {} floats (sum), adagrad lr {}: {:.2f} GB of rows and "
      "state on the server(s); batch {} bags of {} uniform random ids; {} intra-op thread per "
      "process, {} RPC threads, {} s RPC timeout; {} round(s) of without / during, the blocking "
      "save in the last {}; W = {} warm-up and T = {} timed steps per phase, a snapshot begun "
      "every P = {} timed steps of the during phase (keep_last 1, disk_share {}); snapshots in {} "
      "(local disk, removed after each round); disk: dd of the snapshot's bytes with "
      "conv=fdatasync there after each round's snapshots are removed, timed whole, through the "
      "page cache (bs=1M) and around it (oflag=direct bs=4M)",
      config.servers, rows_label(config.rows), kPsDim, kLr, state_gb, kPsBags, kPsIdsPerBag,
      job.value("intra_op_threads", kPsIntraOpThreads), kPsRpcThreads, kRpcTimeout.count(),
      config.rounds, config.blocking_rounds, config.warmup, config.timed, config.every,
      config.disk_share, config.directory);
  const std::string no_pytorch =
      "no PyTorch side: PyTorch has no snapshot of a parameter server (its DistributedOptimizer "
      "has no state dict); ours during a snapshot against ours without";
  fmt::print("\nsnapshot_bench: {}\n{}\n{}\n\n", settings, no_pytorch,
             machine_load_line(load_at_start, load_at_end));

  Json cases = Json::array();
  const char* phases[][2] = {{"without", "without a snapshot"},
                             {"during", "during (all T steps)"},
                             {"while_written", "during, while written"},
                             {"between", "during, between snapshots"}};
  fmt::print("{:<24} {:>22} {:>22} {:>24} {:>14}\n", "step ms, phase", "p50 (min/med/max)",
             "p99 (min/med/max)", "max (min/med/max)", "steps (med)");
  for (const auto& [phase, label] : phases) {
    std::vector<std::string> cells;
    for (const char* figure : {"p50", "p99", "max"}) {
      const std::vector<double> values = over_rounds(phase, figure);
      const Spread s = spread_of(values);
      cells.push_back(fmt::format("{:.2f}/{:.2f}/{:.2f}", s.min, s.median, s.max));
      cases.push_back(spread_row(fmt::format("step {}, {}", figure, label), values, "ms", "lower"));
    }
    fmt::print("{:<24} {:>22} {:>22} {:>24} {:>14.0f}\n", label, cells[0], cells[1], cells[2],
               median(over_rounds(phase, "steps")));
  }
  // The rest, ours alone over the rounds, as one table below the phases'.
  const size_t phase_rows = cases.size();
  struct Ratio {
    const char* phase;
    const char* over;
    const char* label;
  };
  const Ratio ratios[] = {{"during", "without", "during (all T) / without"},
                          {"while_written", "without", "while written / without"},
                          {"while_written", "between", "while written / between snapshots"}};
  for (const char* figure : {"p50", "p99"}) {
    for (const Ratio& ratio : ratios) {
      std::vector<double> values;
      const std::vector<double> with = over_rounds(ratio.phase, figure);
      const std::vector<double> over = over_rounds(ratio.over, figure);
      for (size_t r = 0; r < with.size(); ++r) values.push_back(with[r] / over[r]);
      cases.push_back(spread_row(fmt::format("step {} ratio, {}", figure, ratio.label), values,
                                 "ratio", "lower"));
    }
  }
  // The same ratio over every round's steps pooled (the last round's figure) rests on more of
  // them: a run's headline figure.
  cases.push_back(spread_row("step p99 ratio, while written / without, rounds pooled",
                             {rounds.back().at("pooled_p99_ratio").get<double>()}, "ratio",
                             "lower"));
  cases.push_back(spread_row("step p99 ratio, while written / between snapshots, rounds pooled",
                             {rounds.back().at("pooled_p99_ratio_between").get<double>()}, "ratio",
                             "lower"));
  cases.push_back(spread_row("T steps' total time, without a snapshot",
                             over_rounds("without", "total_s"), "s", "lower"));
  cases.push_back(
      spread_row("T steps' total time, during", over_rounds("during", "total_s"), "s", "lower"));
  cases.push_back(spread_row("during: the longest step's place (1: the first)",
                             over_rounds("during", "max_at"), "step", "lower"));
  cases.push_back(
      spread_row("making the schedule (the servers map the copies' memory in the first round)",
                 per_round([](const Json& r) { return r.at("schedule_made_s").get<double>(); }),
                 "s", "lower"));
  cases.push_back(spread_row("a snapshot: begin to finished", snapshot_s, "s", "lower"));
  cases.push_back(spread_row("a snapshot: bytes written", snapshot_mb, "MB", "lower"));
  cases.push_back(spread_row("a snapshot: write throughput", snapshot_mb_s, "MB/s", "higher"));
  cases.push_back(spread_row("snapshots per round", snapshots_per_round, "snapshots", "higher"));
  cases.push_back(
      spread_row("timed steps while written, per round", written_steps, "steps", "higher"));
  cases.push_back(spread_row("snapshots finished within the T steps, of all",
                             {finished_in_phase / static_cast<double>(snapshot_s.size())}, "share",
                             "higher"));
  if (!blocking_s.empty()) {
    cases.push_back(spread_row("blocking save_snapshot: wall time", blocking_s, "s", "lower"));
    cases.push_back(
        spread_row("blocking save_snapshot: write throughput", blocking_mb_s, "MB/s", "higher"));
  }
  cases.push_back(
      spread_row("disk: dd of a snapshot's bytes, conv=fdatasync", dd_mb_s, "MB/s", "higher"));
  cases.push_back(
      spread_row("a snapshot's write rate / dd's (its round's)", of_dd, "ratio", "higher"));
  cases.push_back(spread_row("disk: dd of a snapshot's bytes, oflag=direct bs=4M", dd_direct_mb_s,
                             "MB/s", "higher"));
  cases.push_back(spread_row("a snapshot's write rate / dd oflag=direct's (its round's)",
                             of_dd_direct, "ratio", "higher"));
  fmt::print("\n{:<56} {:>9} {:>9} {:>9}  {}\n", "case", "min", "median", "max", "unit");
  for (size_t i = phase_rows; i < cases.size(); ++i) {
    const Json& row = cases[i];
    fmt::print("{:<56} {:>9.2f} {:>9.2f} {:>9.2f}  {}\n", row["case"].get<std::string>(),
               row["min"].get<double>(), row["median"].get<double>(), row["max"].get<double>(),
               row["unit"].get<std::string>());
  }
  fmt::print("\n");
  cases.push_back(Json{{"case", "settings"}, {"settings", settings}, {"note", no_pytorch}});

  std::vector<std::string> problems;
  for (const Json& round : rounds) {
    if (!std::isfinite(round.at("last_loss").get<double>())) {
      problems.push_back("the loss is not finite");
    }
  }
  return results_file.write_unless(cases, problems);
}

}  // namespace
}  // namespace bench
}  // namespace distoptim

int main(int argc, char** argv) {
  return distoptim::bench::run_main("snapshot_bench", distoptim::bench::run, argc, argv);
}
