// server_loss_bench: what a parameter server's death costs a training job, measured on
// examples/click_through --elastic (two servers, two trainers, one table sharded over both, the
// MLP on the first server) under distrun --restart-policy rank.
//
// Each round runs the job once: the first trainer snapshots the servers' state every
// --snapshot-every steps; server --kill-server (1, the second, by default) SIGKILLs itself once
// the trainers have taken --kill-at steps each; distrun starts it again, it takes its old name,
// the trainers bind to it and one of them gives it back what it held from the latest snapshot
// (dist_optim::recover_lost_owners). Killing the first server (--kill-server 0) needs the group's
// membership in etcd: the benchmark starts a real etcd on loopback (Debian's etcd-server) and runs
// the job with distrun --rdzv-backend etcd. From the job's output and the first server's log
// (loss.csv) the round gives:
//   every trainer stepping again (ms): the largest of the trainers' own times from the step that
//     failed on the lost server to the next step of theirs that returned (each trainer prints
//     it): the dead process's drop, the new process's start (exec, LibTorch), its join, and the
//     restore (the shard's rows and their optimizer state read from the snapshot, the MLP's).
//   a trainer's failed step to its next step (ms): each trainer's time, every trainer.
//   the snapshot's lag (steps): the first trainer's steps between the snapshot the server got
//     back and the kill (--kill-at): the updates the loss cost, per trainer.
//   samples/s before the kill, after every trainer is back: all trainers' samples per second in
//     the first server's log, from the 20th step to the kill, and from the step at which every
//     trainer has stepped again to the first trainer's finish; and after / before.
// With --replicas each round runs the job twice, alternating: as above, then with the example's
// --replicas (each server's steps copied to the other before they return; when the server dies
// its backup serves what it held at once, made there from its copies: hot standby, no snapshot
// read, no step that returned lost, no wait for the new process), and the rows are given for
// each, with the replicas' price before the kill (samples/s, replicas over snapshots, per round).
// Every figure is the min/median/max over the rounds; the load average at the start and the end
// is printed. There is no PyTorch side: a PyTorch 1.13 RPC job ends when a worker dies. Each
// round's job (its output in job.log, the first server's log) stays in server_loss_bench_runs/
// beside the JSON results.

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <fmt/core.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "child_process.h"
#include "harness/etcd_server.h"
#include "report.h"

namespace distoptim {
namespace bench {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

struct Config {
  int kill_server = 1;
  int steps = 200;
  int kill_at = 100;
  int snapshot_every = 25;
  int rounds = 3;
  int deadline_seconds = 600;
  // The example's table and batch (1M x 32 rows, Adagrad: 256 MB a snapshot writes and a
  // restore reads).
  int64_t rows = 1 << 20;
  int64_t dim = 32;
  int64_t batch = 512;
};

constexpr int kTrainers = 2;

// One step row of the first server's loss.csv (seconds,event,slot,worker,step,global_step,...).
struct StepRow {
  double seconds = 0;
  std::string worker;
  int64_t global_step = 0;
};

// The log's step rows in order, and where the first finish comes (rows.size() if none).
struct Log {
  std::vector<StepRow> steps;
  size_t first_finish = 0;
};

Log read_log(const fs::path& csv) {
  std::ifstream in(csv);
  TORCH_CHECK(in.good(), "server_loss_bench: cannot read the first server's log ", csv.string());
  std::string line;
  std::getline(in, line);  // header
  Log log;
  bool finished = false;
  while (std::getline(in, line)) {
    std::vector<std::string> fields;
    std::istringstream row(line);
    for (std::string field; std::getline(row, field, ',');) fields.push_back(field);
    TORCH_CHECK(fields.size() >= 6, "server_loss_bench: malformed row of ", csv.string(), ": ",
                line);
    if (fields[1] == "finish" && !finished) {
      finished = true;
      log.first_finish = log.steps.size();
    }
    if (fields[1] != "step") continue;
    log.steps.push_back({std::stod(fields[0]), fields[3], std::stoll(fields[5])});
  }
  if (!finished) log.first_finish = log.steps.size();
  return log;
}

// Samples per second of the step rows [from, to) (times within one server's clock).
double samples_per_second(const Log& log, size_t from, size_t to, int64_t batch) {
  TORCH_CHECK(to > from + 1, "server_loss_bench: too few steps in a window of the log (", from,
              " to ", to, "): give more --steps");
  const double seconds = log.steps[to - 1].seconds - log.steps[from].seconds;
  return static_cast<double>(to - from - 1) * static_cast<double>(batch) / seconds;
}

struct Round {
  std::vector<double> failed_to_next_ms;  // one per trainer
  bool restored = false;                  // a trainer said it restored the server
  double lag_steps = NAN;                 // from a snapshot: the first trainer's steps since it
  double before = NAN, after = NAN;
};

// One run of the job; `replicas`: with the example's --replicas (each server backed up by the
// other; the lost one's backup takes over what it held, hot standby, rather than a restart).
Round run_round(const Config& config, bool replicas, const fs::path& out_dir) {
  fs::remove_all(out_dir);
  std::unique_ptr<testing::EtcdServer> etcd;
  std::vector<std::string> argv = {"/usr/bin/timeout",
                                   "--kill-after=10",
                                   std::to_string(config.deadline_seconds),
                                   DISTOPTIM_DISTRUN_PATH,
                                   "--nproc-per-node",
                                   "4",
                                   "--restart-policy",
                                   "rank",
                                   "--max-restarts",
                                   "1"};
  if (config.kill_server == 0) {
    etcd = std::make_unique<testing::EtcdServer>();
    argv.insert(argv.end(), {"--rdzv-backend", "etcd", "--rdzv-endpoint", etcd->endpoint()});
  }
  argv.insert(argv.end(), {DISTOPTIM_CLICK_THROUGH_EXAMPLE_PATH,
                           "--elastic",
                           "--kill-server-at",
                           std::to_string(config.kill_at),
                           "--kill-server",
                           std::to_string(config.kill_server),
                           "--snapshot-every",
                           std::to_string(config.snapshot_every),
                           "--steps",
                           std::to_string(config.steps),
                           "--table",
                           "fixed",  // --replicas needs it: both modes on the same table
                           "--rows",
                           std::to_string(config.rows),
                           "--dim",
                           std::to_string(config.dim),
                           "--batch",
                           std::to_string(config.batch),
                           "--eval-every",
                           std::to_string(config.steps),
                           "--out",
                           out_dir.string()});
  if (replicas) argv.push_back("--replicas");
  const ChildResult child = run_child(argv, "");
  // Kept beside the job's logs, so that a round's outlier can be read afterwards.
  std::ofstream(out_dir / "job.log") << child.stdout_text;
  TORCH_CHECK(child.exit_code == 0, "server_loss_bench: the job exited with status ",
              child.exit_code, "; its output:\n", child.stdout_text);

  Round round;
  const std::string server = fmt::format("ps{}", config.kill_server);
  // "NAME: worker 'psK' is back; restored what it held from the snapshot of step S (...);
  // stepping again N ms after the failed step" (or "... from its backup 'psJ' (...); ...").
  static const std::regex kBack(
      R"((trainer[0-9]+): worker '(ps[0-9]+)' is back; (restored|another trainer restored) what it held from (the snapshot of step ([0-9]+)|no snapshot|its backup '(ps[0-9]+)').*; stepping again ([0-9]+) ms after)");
  // With --replicas (hot standby): "NAME: worker 'psK' was lost; its backup 'psJ' took over what
  // it held (...), made there by this trainer (M ms); stepping again N ms after the failed step".
  static const std::regex kTakenOver(
      R"((trainer[0-9]+): worker '(ps[0-9]+)' was lost; its backup '(ps[0-9]+)' took over what it held .*, made there by (this|another) trainer .*; stepping again ([0-9]+) ms after)");
  std::istringstream lines(child.stdout_text);
  std::string line;
  while (std::getline(lines, line)) {
    std::smatch m;
    if (std::regex_search(line, m, kTakenOver) && m[2] == server) {
      TORCH_CHECK(replicas, "server_loss_bench: ", server, " was taken over by its backup: ", line);
      round.failed_to_next_ms.push_back(std::stod(m[5]));
      if (m[4] == "this") round.restored = true;
      continue;
    }
    if (!std::regex_search(line, m, kBack) || m[2] != server) continue;
    TORCH_CHECK(m[6].matched == replicas, "server_loss_bench: ", server, " was restored ",
                m[6].matched ? "from its backup" : "not from its backup", ": ", line);
    round.failed_to_next_ms.push_back(std::stod(m[7]));
    if (m[3] == "restored") {
      round.restored = true;
      if (!replicas)
        round.lag_steps = m[5].matched ? config.kill_at - std::stod(m[5]) : config.kill_at;
    }
  }
  TORCH_CHECK(round.failed_to_next_ms.size() == kTrainers && round.restored,
              "server_loss_bench: the job did not print every trainer's recovery of ", server,
              "; its output:\n", child.stdout_text);

  // Windows of the first server's log, by the order of its rows (the first server started again
  // goes on with its log; its clock does not count the time it was down, so no window spans it).
  const Log log = read_log(out_dir / "loss.csv");
  const int64_t kill_step = static_cast<int64_t>(config.kill_at) * kTrainers;
  auto at_global_step = [&](int64_t step) {
    const auto it = std::find_if(log.steps.begin(), log.steps.end(),
                                 [&](const StepRow& row) { return row.global_step >= step; });
    return static_cast<size_t>(it - log.steps.begin());
  };
  const size_t warm = at_global_step(20), kill = at_global_step(kill_step);
  // Every trainer has stepped again: past the rows of the steps taken before the server's loss
  // was seen, each trainer's next rows come after its recovery.
  size_t all_back = kill;
  for (int t = 0; t < kTrainers; ++t) {
    const std::string trainer = fmt::format("trainer{}", t);
    size_t i = kill + 1;
    while (i < log.steps.size() && log.steps[i].worker != trainer) ++i;
    all_back = std::max(all_back, i);
  }
  round.before = samples_per_second(log, warm, kill + 1, config.batch);
  round.after = samples_per_second(log, all_back, log.first_finish, config.batch);
  return round;
}

int run(int argc, char** argv) {
  Config config;
  std::string json_path;
  CLI::App app{
      "server_loss_bench: a parameter server lost and started again in "
      "examples/click_through --elastic"};
  app.add_option("--json", json_path, "Write the results as JSON to this file");
  app.add_option("--rounds", config.rounds, "Runs of the job")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--kill-server", config.kill_server,
                 "The server killed: 1 (over the TCP store) or 0 (the first, with the group in "
                 "etcd)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1));
  app.add_option("--steps", config.steps, "Steps of every trainer")->capture_default_str();
  app.add_option("--kill-at", config.kill_at,
                 "The server dies once the trainers have taken this many steps each")
      ->capture_default_str();
  app.add_option("--snapshot-every", config.snapshot_every, "The first trainer's snapshots")
      ->capture_default_str();
  app.add_option("--rows", config.rows, "Rows of the table")->capture_default_str();
  bool compare_replicas = false;
  app.add_flag("--replicas", compare_replicas,
               "Each round also runs the job with the example's --replicas (after the run "
               "without), and compares");
  app.add_option("--deadline-seconds", config.deadline_seconds,
                 "each job is killed after this long")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  TORCH_CHECK_VALUE(config.kill_at > 20 && config.kill_at + 20 < config.steps,
                    "--kill-at must leave 20 steps before it and after it, got ", config.kill_at,
                    " of --steps ", config.steps);
  ResultsFile results_file(json_path, "server_loss_bench");
  const fs::path work = fs::path(results_file.path()).parent_path() / "server_loss_bench_runs";

  // Each round runs the job as configured; with --replicas, first so and then with replicas, so
  // that the two alternate on the machine as it is.
  std::vector<bool> variants = {false};
  if (compare_replicas) variants.push_back(true);
  struct Figures {
    std::vector<double> all_back, each, lag, before, after, ratio;
  };
  std::vector<Figures> figures(variants.size());
  const double load_at_start = load_average();
  for (int r = 0; r < config.rounds; ++r) {
    for (size_t v = 0; v < variants.size(); ++v) {
      fmt::print(stderr, "server_loss_bench: round {} of {}{}...\n", r + 1, config.rounds,
                 variants[v] ? ", with replicas" : "");
      const Round round =
          run_round(config, variants[v],
                    work / fmt::format("round{}{}", r + 1, variants[v] ? "-replicas" : ""));
      Figures& f = figures[v];
      f.all_back.push_back(
          *std::max_element(round.failed_to_next_ms.begin(), round.failed_to_next_ms.end()));
      f.each.insert(f.each.end(), round.failed_to_next_ms.begin(), round.failed_to_next_ms.end());
      if (!variants[v]) f.lag.push_back(round.lag_steps);
      f.before.push_back(round.before);
      f.after.push_back(round.after);
      f.ratio.push_back(round.after / round.before);
    }
  }

  Json cases = Json::array();
  for (size_t v = 0; v < variants.size(); ++v) {
    const Figures& f = figures[v];
    const std::string of = !compare_replicas ? "" : variants[v] ? " (replicas)" : " (snapshots)";
    cases.push_back(spread_row("every trainer stepping again" + of, f.all_back, "ms", "lower"));
    cases.push_back(spread_row("a trainer's failed step to its next" + of, f.each, "ms", "lower"));
    // With replicas nothing is lost: each trainer checks its step counts on the restored server
    // right after the restore, and the job fails otherwise (examples::check_applied_steps).
    if (!variants[v]) {
      cases.push_back(spread_row("snapshot's lag behind the kill" + of, f.lag, "steps", "lower"));
    }
    cases.push_back(spread_row("samples/s before the kill" + of, f.before, "samples/s", "higher"));
    cases.push_back(
        spread_row("samples/s after every trainer is back" + of, f.after, "samples/s", "higher"));
    cases.push_back(spread_row("samples/s after / before" + of, f.ratio, "ratio", "higher"));
  }
  if (compare_replicas) {
    // Per round, replicas over snapshots: the price of the replica before the kill.
    std::vector<double> cost;
    for (int r = 0; r < config.rounds; ++r) {
      cost.push_back(figures[1].before[r] / figures[0].before[r]);
    }
    cases.push_back(
        spread_row("samples/s before the kill, replicas / snapshots", cost, "ratio", "higher"));
  }
  const std::string settings = fmt::format(
      "examples/click_through --elastic: 2 servers + 2 trainers on one machine, a {} x {} table "
      "(Adagrad), batch {}, {} steps each; ps{} SIGKILLed after {} steps each{}, snapshots every "
      "{} steps of the first trainer{}",
      config.rows, config.dim, config.batch, config.steps, config.kill_server, config.kill_at,
      config.kill_server == 0 ? " (the group in a real etcd on loopback)" : "",
      config.snapshot_every,
      compare_replicas ? "; each round runs the job twice, alternating: as so, then with "
                         "--replicas (each server backed up by the other; the lost one's backup "
                         "takes over what it held at once, hot standby)"
                       : "");
  const std::string no_pytorch = "no PyTorch side: a PyTorch 1.13 RPC job ends when a worker dies";

  return finish_ours_alone(results_file, "server_loss_bench", std::move(cases), settings,
                           no_pytorch, config.rounds, load_at_start);
}

}  // namespace
}  // namespace bench
}  // namespace distoptim

int main(int argc, char** argv) {
  return distoptim::bench::run_main("server_loss_bench", distoptim::bench::run, argc, argv);
}
