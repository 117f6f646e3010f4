// staleness_bench: what bounded staleness (DistributedOptimizer::set_max_staleness) gives a
// training job, measured on examples/click_through (two servers holding a collisionless table of
// at most 1M x 32 sharded over both and the MLP on the first, two trainers, Adagrad) with one
// trainer slowed (--slow-trainer 1 --slowdown 2: before each next step it sleeps as long as the
// last took, as on a machine half as fast).
//
// Each round runs the job once per bound k (0, 1, 4 by default; 0 is the synchronous step, as
// PyTorch's), alternating, so that the machine's drift falls on every k alike. The example's
// --max-staleness k (k >= 1) lets each trainer's forward read parameters up to k of its own steps
// old: its next forward runs while its last backward and optimizer step are under way (one step),
// and its optimizer leaves at most k - 1 steps outstanding (set_max_staleness(k - 1)). From the
// first trainer's last line: all trainers' samples per second from its start until every trainer
// has applied its last step, and the held-out log loss then (every trainer takes the same steps on
// the same batches, so each k has trained on the same samples). The table gives each k's min,
// median and max over the rounds, and per round k's samples/s over k = 0's and its held-out log
// loss against k = 0's (in percent). There is no PyTorch side: PyTorch's DistributedOptimizer has
// no bounded staleness (its step is k = 0). Each round's output stays in staleness_bench_runs/
// beside the JSON results. Each k's rows also give the watched trainer's (the slowed one) mean
// forward and backward and its optimizer step, as the example prints them; at the baseline k, the
// step's share of the three, and how much faster the watched trainer would step were that wait
// hidden whole (1 / (1 - that share)): what the optimizer's bound alone can give, without the next
// forward running beside the last backward.

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <fmt/core.h>
#include <fmt/ranges.h>
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
  std::vector<int> bounds = {0, 1, 4};
  int rounds = 3;
  int steps = 400;
  int trainers = 2;
  int slow_trainer = 1;
  double slowdown = 2;
  int deadline_seconds = 600;
};

// The trainer whose step times the table gives: the slowed one, else the first.
int watched_trainer(const Config& config) { return std::max(config.slow_trainer, 0); }

struct Run {
  double samples_per_second = NAN;
  double held_out_log_loss = NAN;
  // The watched trainer's mean times per step, in ms.
  double forward_and_backward_ms = NAN;
  double optimizer_step_ms = NAN;
};

Run run_job(const Config& config, int bound, const fs::path& out_dir) {
  fs::remove_all(out_dir);
  std::vector<std::string> argv = {"/usr/bin/timeout",
                                   "--kill-after=10",
                                   std::to_string(config.deadline_seconds),
                                   DISTOPTIM_DISTRUN_PATH,
                                   "--nproc-per-node",
                                   std::to_string(2 + config.trainers),
                                   DISTOPTIM_CLICK_THROUGH_EXAMPLE_PATH,
                                   "--steps",
                                   std::to_string(config.steps),
                                   "--eval-every",
                                   std::to_string(config.steps),
                                   "--max-staleness",
                                   std::to_string(bound),
                                   "--out",
                                   out_dir.string()};
  if (config.slow_trainer >= 0) {
    argv.insert(argv.end(), {"--slow-trainer", std::to_string(config.slow_trainer), "--slowdown",
                             fmt::format("{}", config.slowdown)});
  }
  const ChildResult child = run_child(argv, "");
  fs::create_directories(out_dir);
  std::ofstream(out_dir / "job.log") << child.stdout_text;
  TORCH_CHECK(child.exit_code == 0, "staleness_bench: the job with --max-staleness ", bound,
              " exited with status ", child.exit_code, "; its output:\n", child.stdout_text);
  // "held-out log loss L (AUC A) after N steps per trainer, ...; R samples/s of all trainers"
  static const std::regex kLast(
      R"(held-out log loss ([0-9.]+) \(AUC [0-9.]+\) after [0-9]+ steps per trainer.*; ([0-9.]+) samples/s of all trainers)");
  std::smatch m;
  TORCH_CHECK(std::regex_search(child.stdout_text, m, kLast),
              "staleness_bench: the job with --max-staleness ", bound,
              " printed no last line; its output:\n", child.stdout_text);
  Run run{std::stod(m[2]), std::stod(m[1])};
  // "trainerT: N steps, each on average: forward F ms, backward B ms, optimizer step S ms (...)"
  const int watched = watched_trainer(config);
  const std::regex phases(fmt::format(
      R"(trainer{}: [0-9]+ steps, each on average: forward ([0-9.]+) ms, backward ([0-9.]+) ms, optimizer step ([0-9.]+) ms)",
      watched));
  TORCH_CHECK(std::regex_search(child.stdout_text, m, phases), "staleness_bench: trainer", watched,
              " of the job with --max-staleness ", bound, " printed no step times; its output:\n",
              child.stdout_text);
  run.forward_and_backward_ms = std::stod(m[1]) + std::stod(m[2]);
  run.optimizer_step_ms = std::stod(m[3]);
  return run;
}

int run(int argc, char** argv) {
  Config config;
  std::string json_path;
  CLI::App app{"staleness_bench: bounded staleness on examples/click_through, one trainer slowed"};
  app.add_option("--json", json_path, "Write the results as JSON to this file");
  app.add_option("--rounds", config.rounds, "Runs of the job per bound")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--bounds", config.bounds, "The max_staleness values; the first is the baseline")
      ->capture_default_str();
  app.add_option("--steps", config.steps, "Steps of every trainer")->capture_default_str();
  app.add_option("--trainers", config.trainers, "Trainers (beside two servers)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--slow-trainer", config.slow_trainer, "The trainer slowed (-1: none)")
      ->capture_default_str();
  app.add_option("--slowdown", config.slowdown, "How much slower it is")->capture_default_str();
  app.add_option("--deadline-seconds", config.deadline_seconds,
                 "each job is killed after this long")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  TORCH_CHECK_VALUE(!config.bounds.empty(), "--bounds is empty");
  TORCH_CHECK_VALUE(config.slow_trainer < config.trainers, "--slow-trainer ", config.slow_trainer,
                    " names no trainer of ", config.trainers);
  ResultsFile results_file(json_path, "staleness_bench");
  const fs::path work = fs::path(results_file.path()).parent_path() / "staleness_bench_runs";
  std::map<int, std::vector<Run>> runs;
  const double load_at_start = load_average();
  for (int r = 0; r < config.rounds; ++r) {
    for (int bound : config.bounds) {
      fmt::print(stderr, "staleness_bench: round {} of {}, max_staleness {}...\n", r + 1,
                 config.rounds, bound);
      runs[bound].push_back(
          run_job(config, bound, work / fmt::format("round{}-k{}", r + 1, bound)));
    }
  }
  const int base = config.bounds.front();
  Json cases = Json::array();
  const std::string watched = fmt::format("trainer {}", watched_trainer(config));
  for (int bound : config.bounds) {
    std::vector<double> rate, loss, speedup, loss_change, work_ms, step_ms;
    for (int r = 0; r < config.rounds; ++r) {
      rate.push_back(runs[bound][r].samples_per_second);
      loss.push_back(runs[bound][r].held_out_log_loss);
      work_ms.push_back(runs[bound][r].forward_and_backward_ms);
      step_ms.push_back(runs[bound][r].optimizer_step_ms);
      speedup.push_back(runs[bound][r].samples_per_second / runs[base][r].samples_per_second);
      loss_change.push_back(
          100 * (runs[bound][r].held_out_log_loss / runs[base][r].held_out_log_loss - 1));
    }
    const std::string k = fmt::format("max_staleness {}", bound);
    cases.push_back(spread_row(k + ": samples/s", rate, "samples/s", "higher"));
    cases.push_back(spread_row(k + ": held-out log loss", loss, "log loss", "lower"));
    cases.push_back(spread_row(fmt::format("{}: {}'s forward and backward", k, watched), work_ms,
                               "ms", "lower"));
    cases.push_back(
        spread_row(fmt::format("{}: {}'s optimizer step", k, watched), step_ms, "ms", "lower"));
    if (bound == base) {
      // The optimizer's bound alone hides the optimizer step's wait and nothing else: were the
      // wait gone whole, the watched trainer's step would take its forward and backward alone.
      std::vector<double> share, speedup_if_hidden;
      for (int r = 0; r < config.rounds; ++r) {
        share.push_back(100 * step_ms[r] / (work_ms[r] + step_ms[r]));
        speedup_if_hidden.push_back((work_ms[r] + step_ms[r]) / work_ms[r]);
      }
      cases.push_back(
          spread_row(fmt::format("{}: the optimizer step's share of {}'s step", k, watched), share,
                     "%", "higher"));
      cases.push_back(spread_row(
          fmt::format("{}: {}'s step over its forward and backward alone (the optimizer step's "
                      "wait hidden whole)",
                      k, watched),
          speedup_if_hidden, "ratio", "higher"));
    }
    if (bound != base) {
      cases.push_back(spread_row(fmt::format("{}: samples/s over max_staleness {}", k, base),
                                 speedup, "ratio", "higher"));
      cases.push_back(
          spread_row(fmt::format("{}: held-out log loss against max_staleness {}", k, base),
                     loss_change, "%", "lower"));
    }
  }
  const std::string settings = fmt::format(
      "examples/click_through: 2 servers + {} trainers on one machine, the example's defaults "
      "(a collisionless table of at most 1M x 32 over both servers, the MLP on the first, "
      "Adagrad, batch 512), {} steps "
      "each, {}; max_staleness {}, alternating in each round (k >= 1: the next forward beside "
      "the last backward and optimizer step, the optimizer's own bound k - 1)",
      config.trainers, config.steps,
      config.slow_trainer >= 0
          ? fmt::format("trainer {} slowed {}x", config.slow_trainer, config.slowdown)
          : std::string("no trainer slowed"),
      fmt::join(config.bounds, ", "));
  const std::string no_pytorch =
      "no PyTorch side: PyTorch's DistributedOptimizer steps synchronously (max_staleness 0)";
  return finish_ours_alone(results_file, "staleness_bench", std::move(cases), settings, no_pytorch,
                           config.rounds, load_at_start);
}

}  // namespace
}  // namespace bench
}  // namespace distoptim

int main(int argc, char** argv) {
  return distoptim::bench::run_main("staleness_bench", distoptim::bench::run, argc, argv);
}
