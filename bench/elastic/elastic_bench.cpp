// elastic_bench: what a trainer's loss and its replacement cost a parameter-server job, measured
// on examples/rnn_parameter_server --elastic (a dynamic RPC group, one model on the server that
// every trainer trains) under distrun --restart-policy rank.
//
// Each round runs the job once: a server and --trainers trainers (3), each --steps steps; the
// last trainer SIGKILLs itself in step --kill-at (the example's --kill-trainer-at: after its
// backward pass, before its step), and distrun starts it again alone, under a new name. From
// the job's output and the server's log (loss.csv: the server's clock at each step it was told
// of) the round gives:
//   rejoin, init_rpc to first step (s): the replacement's time from its init_rpc call to the
//     return of its first DistributedOptimizer step, as it measures itself: joining the group
//     (rank assignment, every member told), fetching the shared model's references and its
//     slot's progress, building its DistributedOptimizer (an optimizer on each owner), and one
//     step (forward, backward, step). The corpus is read before init_rpc, and the process's own
//     start (exec, loading LibTorch) is not in it.
//   rejoin, init_rpc alone (s): the part of it init_rpc takes.
//   first join, init_rpc to first step (s): the same for the trainers that start with the job
//     (they start at once with the server and with each other, so they wait for its store too).
//   survivors' steps/s in the gap / steady: the other trainers' steps per second, together, from
//     the kill to the replacement's first step (the gap: the server drops the lost trainer's
//     state while the replacement starts, loads LibTorch and joins), over their steady steps per
//     second: with all trainers running, past a warm-up, before the kill (from the killed
//     trainer's 10th step) and after the rejoin (from the replacement's 3rd step to the first
//     trainer's finish), both windows together. Above 1: the survivors ran faster in the gap (on
//     a machine of 2 cores, a dead trainer leaves them its share of the cores).
// Every figure is the min/median/max over the rounds; the load average at the start and the end
// is printed. There is no PyTorch side: PyTorch 1.13 refuses distributed autograd and the
// DistributedOptimizer in dynamic groups (init_rpc without a world size), so it has no
// counterpart of this job.

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <fmt/core.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "child_process.h"
#include "report.h"

namespace distoptim {
namespace bench {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

struct Config {
  int trainers = 3;
  int steps = 200;
  int kill_at = 60;
  int rounds = 3;
  int deadline_seconds = 600;
  // The example's model: smaller than its defaults (ninp = nhid = 256, bptt 35), so a round
  // takes seconds of training rather than minutes on 2 cores.
  int ninp = 64;
  int nhid = 64;
  int bptt = 20;
};

// One row of the server's loss.csv.
struct LogRow {
  double seconds = 0;
  std::string event;
  int slot = 0;
  std::string worker;
  int64_t step = 0;
};

std::vector<LogRow> read_log(const fs::path& csv) {
  std::ifstream in(csv);
  TORCH_CHECK(in.good(), "elastic_bench: cannot read the server's log ", csv.string());
  std::string line;
  std::getline(in, line);  // header
  std::vector<LogRow> rows;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string seconds, slot, step;
    LogRow row;
    std::getline(fields, seconds, ',');
    std::getline(fields, row.event, ',');
    std::getline(fields, slot, ',');
    std::getline(fields, row.worker, ',');
    std::getline(fields, step, ',');
    row.seconds = std::stod(seconds);
    row.slot = std::stoi(slot);
    row.step = std::stoll(step);
    rows.push_back(row);
  }
  return rows;
}

// What one round measured.
struct Round {
  double rejoin_to_first_step = NAN;
  double rejoin_init_rpc = NAN;
  std::vector<double> first_join_to_first_step;
  double steady_steps_per_second = NAN;
  double before_steps_per_second = NAN;
  double after_steps_per_second = NAN;
  double gap_steps_per_second = NAN;
  double gap_seconds = NAN;
};

Round run_round(const Config& config, const fs::path& out_dir) {
  fs::remove_all(out_dir);
  const std::vector<std::string> argv = {"/usr/bin/timeout",
                                         "--kill-after=10",
                                         std::to_string(config.deadline_seconds),
                                         DISTOPTIM_DISTRUN_PATH,
                                         "--nproc-per-node",
                                         std::to_string(config.trainers + 1),
                                         "--restart-policy",
                                         "rank",
                                         "--max-restarts",
                                         "1",
                                         DISTOPTIM_RNN_PS_EXAMPLE_PATH,
                                         "--elastic",
                                         "--kill-trainer-at",
                                         std::to_string(config.kill_at),
                                         "--steps",
                                         std::to_string(config.steps),
                                         "--seconds",
                                         "100000",
                                         "--ninp",
                                         std::to_string(config.ninp),
                                         "--nhid",
                                         std::to_string(config.nhid),
                                         "--bptt",
                                         std::to_string(config.bptt),
                                         "--out-dir",
                                         out_dir.string()};
  const ChildResult child = run_child(argv, "");
  TORCH_CHECK(child.exit_code == 0, "elastic_bench: the job exited with status ", child.exit_code,
              "; its output:\n", child.stdout_text);

  Round round;
  const std::string killed = fmt::format("trainer{}", config.trainers);
  const std::string replacement = killed + "-restart1";
  // "NAME: init_rpc took X s; its first step (step N of slot R) returned Y s after it called
  // init_rpc" (after distrun's "[rank R] ").
  static const std::regex kJoined(
      R"((trainer[0-9]+(-restart[0-9]+)?): init_rpc took ([0-9.]+) s; its first step .* returned ([0-9.]+) s after)");
  std::istringstream lines(child.stdout_text);
  std::string line;
  while (std::getline(lines, line)) {
    std::smatch m;
    if (!std::regex_search(line, m, kJoined)) continue;
    const double init = std::stod(m[3]), first = std::stod(m[4]);
    if (m[1] == replacement) {
      round.rejoin_init_rpc = init;
      round.rejoin_to_first_step = first;
    } else {
      round.first_join_to_first_step.push_back(first);
    }
  }
  TORCH_CHECK(!std::isnan(round.rejoin_to_first_step) &&
                  round.first_join_to_first_step.size() == static_cast<size_t>(config.trainers),
              "elastic_bench: the job did not print every trainer's first step; its output:\n",
              child.stdout_text);

  // The server's log: the kill, the replacement's first step, and the survivors' steps.
  const std::vector<LogRow> log = read_log(out_dir / "loss.csv");
  double kill = NAN, back = NAN, before_from = NAN, after_from = NAN, first_end = INFINITY;
  std::map<std::string, int> steps_seen;
  for (const LogRow& row : log) {
    if (row.event == "kill" && row.worker == killed) kill = row.seconds;
    if (row.event == "step" && row.worker == replacement && std::isnan(back)) back = row.seconds;
    if (row.event == "step") {
      const int seen = ++steps_seen[row.worker];
      if (row.worker == killed && seen == 10) before_from = row.seconds;
      if (row.worker == replacement && seen == 3) after_from = row.seconds;
    }
    if (row.event == "finish") first_end = std::min(first_end, row.seconds);
  }
  TORCH_CHECK(
      !std::isnan(kill) && !std::isnan(back) && !std::isnan(before_from) && !std::isnan(after_from),
      "elastic_bench: the server's log lacks the kill, the rejoin or a steady phase");
  TORCH_CHECK(first_end > after_from,
              "elastic_bench: a trainer finished before the "
              "replacement's third step (",
              first_end, " s < ", after_from, " s): give more --steps");
  auto survivor_steps = [&](double from, double to) {
    return std::count_if(log.begin(), log.end(), [&](const LogRow& row) {
      return row.event == "step" && row.slot != config.trainers && row.seconds > from &&
             row.seconds <= to;
    });
  };
  const auto before = static_cast<double>(survivor_steps(before_from, kill));
  const auto after = static_cast<double>(survivor_steps(after_from, first_end));
  round.before_steps_per_second = before / (kill - before_from);
  round.after_steps_per_second = after / (first_end - after_from);
  round.steady_steps_per_second = (before + after) / (kill - before_from + first_end - after_from);
  round.gap_steps_per_second = static_cast<double>(survivor_steps(kill, back)) / (back - kill);
  round.gap_seconds = back - kill;
  return round;
}

int run(int argc, char** argv) {
  Config config;
  std::string json_path;
  CLI::App app{
      "elastic_bench: a trainer lost and replaced in examples/rnn_parameter_server --elastic"};
  app.add_option("--json", json_path, "Write the results as JSON to this file");
  app.add_option("--rounds", config.rounds, "Runs of the job")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--trainers", config.trainers, "Trainers (the last one is killed)")
      ->capture_default_str()
      ->check(CLI::Range(2, 8));
  app.add_option("--steps", config.steps, "Steps of every trainer")->capture_default_str();
  app.add_option("--kill-at", config.kill_at, "The step in which the last trainer kills itself")
      ->capture_default_str();
  app.add_option("--deadline-seconds", config.deadline_seconds,
                 "each job is killed after this long")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  TORCH_CHECK_VALUE(config.kill_at >= 4 && config.kill_at < config.steps,
                    "--kill-at must be from 4 to --steps - 1, got ", config.kill_at);
  ResultsFile results_file(json_path, "elastic_bench");
  const fs::path work = fs::path(results_file.path()).parent_path() / "elastic_bench_runs";

  const double load_at_start = load_average();
  std::vector<double> rejoin, rejoin_init, first_join, ratio, steady, before, after, gap,
      gap_seconds;
  for (int r = 0; r < config.rounds; ++r) {
    fmt::print(stderr, "elastic_bench: round {} of {}...\n", r + 1, config.rounds);
    const Round round = run_round(config, work / fmt::format("round{}", r + 1));
    rejoin.push_back(round.rejoin_to_first_step);
    rejoin_init.push_back(round.rejoin_init_rpc);
    first_join.insert(first_join.end(), round.first_join_to_first_step.begin(),
                      round.first_join_to_first_step.end());
    steady.push_back(round.steady_steps_per_second);
    before.push_back(round.before_steps_per_second);
    after.push_back(round.after_steps_per_second);
    gap.push_back(round.gap_steps_per_second);
    ratio.push_back(round.gap_steps_per_second / round.steady_steps_per_second);
    gap_seconds.push_back(round.gap_seconds);
  }

  Json cases = Json::array();
  cases.push_back(spread_row("rejoin: init_rpc to first step", rejoin, "s", "lower"));
  cases.push_back(spread_row("rejoin: init_rpc alone", rejoin_init, "s", "lower"));
  cases.push_back(spread_row("first join: init_rpc to first step", first_join, "s", "lower"));
  cases.push_back(
      spread_row("survivors' steps/s, steady before the kill", before, "steps/s", "higher"));
  cases.push_back(
      spread_row("survivors' steps/s, steady after the rejoin", after, "steps/s", "higher"));
  cases.push_back(spread_row("survivors' steps/s, steady (both)", steady, "steps/s", "higher"));
  cases.push_back(
      spread_row("survivors' steps/s, kill to replacement's first step", gap, "steps/s", "higher"));
  cases.push_back(spread_row("survivors' steps/s, gap / steady", ratio, "ratio", "higher"));
  cases.push_back(spread_row("gap: kill to replacement's first step", gap_seconds, "s", "lower"));
  const std::string settings = fmt::format(
      "{} trainers + 1 server on one machine, {} steps each, the last killed in step {}; "
      "examples/rnn_parameter_server --elastic, ninp = nhid = {}, bptt {}, batch 20, adam",
      config.trainers, config.steps, config.kill_at, config.ninp, config.bptt);
  const std::string no_pytorch =
      "no PyTorch side: PyTorch 1.13 refuses distributed autograd and the DistributedOptimizer "
      "in dynamic groups (init_rpc without a world size)";

  return finish_ours_alone(results_file, "elastic_bench", std::move(cases), settings, no_pytorch,
                           config.rounds, load_at_start);
}

}  // namespace
}  // namespace bench
}  // namespace distoptim

int main(int argc, char** argv) {
  return distoptim::bench::run_main("elastic_bench", distoptim::bench::run, argc, argv);
}
