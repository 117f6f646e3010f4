// click_through_bench: the collisionless table (rpc::ShardedIdEmbeddingBag) on the click-through
// example's data, against the fixed hashed table of the same rows, ours and PyTorch's.
//
// Three sides train the same job, 2 parameter servers and 2 trainers on this machine, on the
// same samples (the example's teacher: raw 64-bit ids, half of the features from catalogues that
// grow every step), each trainer the same batches in the same order:
// - ours, collisionless: examples/click_through --table id (at most R live ids, the least
//   recently used dropped first);
// - ours, hashed: examples/click_through --table fixed (the ids hashed into R rows);
// - PyTorch 1.13, hashed: pytorch_click_through.py, the same model written as a PyTorch user
//   would (nn.EmbeddingBag shards on the servers, the MLP on the first, Adagrad through
//   torch.distributed.optim.DistributedOptimizer), reading the samples this program writes
//   first from the example's own teacher code.
// Each round runs the three, alternating. From each run: all trainers' samples per second from
// the first trainer's start (its evaluation before training included) until every trainer has
// applied its last step, and the held-out log loss and AUC then, on the example's held-out set
// (drawn at the last step's time). The tables give each side's min, median and max over the
// rounds, and per round the collisionless table's samples/s over the hashed table's (the issue's
// aim: at least 0.8x) and ours over PyTorch's. Each run's output stays in
// click_through_bench_runs/ beside the JSON results.

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/core.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "child_process.h"
#include "report.h"
#include "teacher.h"

namespace distoptim {
namespace bench {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr int kTrainers = 2;
constexpr int kDim = 32;
constexpr double kLr = 0.1, kMlpLr = 0.01;  // the example's defaults

struct Config {
  int rounds = 3;
  int steps = 300;
  int batch = 512;
  int64_t rows = 131072;
  int held_out = 20000;
  int64_t seed = 0;
  int64_t teacher_seed = 1;
  int deadline_seconds = 900;
};

// One run's figures.
struct Run {
  double samples_per_second = NAN;
  double log_loss = NAN;
  double auc = NAN;
};

// Appends `tensor`'s bytes (contiguous, native little-endian) to `out`.
void write_bytes(std::ofstream& out, const at::Tensor& tensor) {
  const at::Tensor contiguous = tensor.contiguous();
  out.write(static_cast<const char*>(contiguous.data_ptr()),
            static_cast<std::streamsize>(contiguous.nbytes()));
}

// The samples every side trains on, as the example draws them, for pytorch_click_through.py:
// meta.json, then per trainer its steps' ids, dense features and labels, and the held-out set.
void write_samples(const Config& config, const fs::path& dir) {
  fs::create_directories(dir);
  const click_through::Teacher teacher(static_cast<uint64_t>(config.teacher_seed));
  const auto open = [&](const std::string& name) {
    std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out, "click_through_bench: cannot write ", (dir / name).string());
    return out;
  };
  for (int t = 0; t < kTrainers; ++t) {
    std::ofstream ids = open(fmt::format("trainer{}_ids.bin", t));
    std::ofstream dense = open(fmt::format("trainer{}_dense.bin", t));
    std::ofstream labels = open(fmt::format("trainer{}_labels.bin", t));
    for (int64_t step = 1; step <= config.steps; ++step) {
      const click_through::Batch batch = teacher.training_batch(config.seed, t, step, config.batch);
      write_bytes(ids, batch.ids);
      write_bytes(dense, batch.dense);
      write_bytes(labels, batch.labels);
    }
    TORCH_CHECK(ids && dense && labels, "click_through_bench: writing trainer ", t,
                "'s samples failed");
  }
  const click_through::Batch held_out =
      teacher.held_out(config.seed, config.steps, config.held_out);
  for (const auto& [name, tensor] :
       std::map<std::string, at::Tensor>{{"held_out_ids.bin", held_out.ids},
                                         {"held_out_dense.bin", held_out.dense},
                                         {"held_out_labels.bin", held_out.labels},
                                         {"held_out_probability.bin", held_out.probability}}) {
    std::ofstream out = open(name);
    write_bytes(out, tensor);
    TORCH_CHECK(out, "click_through_bench: writing ", name, " failed");
  }
  open("meta.json") << Json{{"trainers", kTrainers},
                            {"steps", config.steps},
                            {"batch", config.batch},
                            {"held_out", config.held_out},
                            {"categorical", click_through::kCategorical},
                            {"dense", click_through::kDense}}
                           .dump(2);
}

// Ours: the example under distrun with `table` ("id" or "fixed").
Run run_ours(const Config& config, const std::string& table, const fs::path& out_dir) {
  fs::remove_all(out_dir);
  const std::vector<std::string> argv = {"/usr/bin/timeout",
                                         "--kill-after=10",
                                         std::to_string(config.deadline_seconds),
                                         DISTOPTIM_DISTRUN_PATH,
                                         "--nproc-per-node",
                                         std::to_string(2 + kTrainers),
                                         DISTOPTIM_CLICK_THROUGH_EXAMPLE_PATH,
                                         "--table",
                                         table,
                                         "--rows",
                                         std::to_string(config.rows),
                                         "--steps",
                                         std::to_string(config.steps),
                                         "--batch",
                                         std::to_string(config.batch),
                                         "--held-out",
                                         std::to_string(config.held_out),
                                         "--eval-every",
                                         std::to_string(config.steps),
                                         "--seed",
                                         std::to_string(config.seed),
                                         "--teacher-seed",
                                         std::to_string(config.teacher_seed),
                                         "--out",
                                         out_dir.string()};
  const ChildResult child = run_child(argv, "");
  fs::create_directories(out_dir);
  std::ofstream(out_dir / "job.log") << child.stdout_text;
  TORCH_CHECK(child.exit_code == 0, "click_through_bench: the example with --table ", table,
              " exited with status ", child.exit_code, "; its output:\n", child.stdout_text);
  // "held-out log loss L (AUC A) after N steps per trainer, ...; R samples/s of all trainers"
  static const std::regex kLast(
      R"(held-out log loss ([0-9.]+) \(AUC ([0-9.]+)\) after [0-9]+ steps per trainer.*; ([0-9.]+) samples/s of all trainers)");
  std::smatch m;
  TORCH_CHECK(std::regex_search(child.stdout_text, m, kLast),
              "click_through_bench: the example with --table ", table,
              " printed no last line; its output:\n", child.stdout_text);
  return {std::stod(m[3]), std::stod(m[1]), std::stod(m[2])};
}

// PyTorch's hashed table on the samples in `data`.
Run run_pytorch(const Config& config, const fs::path& data) {
  const Json result =
      run_side("PyTorch",
               {DISTOPTIM_REFERENCE_PYTHON, DISTOPTIM_PYTORCH_CLICK_THROUGH_SCRIPT, "--data",
                data.string(), "--rows", std::to_string(config.rows), "--dim", std::to_string(kDim),
                "--lr", fmt::format("{}", kLr), "--mlp-lr", fmt::format("{}", kMlpLr)},
               config.deadline_seconds)
          .front();
  const auto number = [&](const char* key) {
    const Json& value = result.at(key);
    return value.is_null() ? NAN : value.get<double>();  // null: not finite (an AUC of one class)
  };
  return {number("samples_per_second"), number("held_out_log_loss"), number("held_out_auc")};
}

std::string spread_text(const Spread& spread, const char* format) {
  return fmt::format(fmt::runtime(fmt::format("{0}/{0}/{0}", format)), spread.min, spread.median,
                     spread.max);
}

int run(int argc, char** argv) {
  Config config;
  std::string json_path;
  CLI::App app{
      "click_through_bench: the collisionless table against hashed ones, ours and PyTorch's, on "
      "the click-through example's data"};
  app.add_option("--json", json_path, "Write the results as JSON to this file");
  app.add_option("--rounds", config.rounds, "Runs of each side")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--steps", config.steps, "Steps of every trainer")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--batch", config.batch, "Samples per step and trainer")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--rows", config.rows, "The table's rows, every side")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 30));
  app.add_option("--held-out", config.held_out, "Held-out samples")
      ->capture_default_str()
      ->check(CLI::Range(2, 1 << 24));
  app.add_option("--deadline-seconds", config.deadline_seconds,
                 "Each run is killed after this long")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  ResultsFile results_file(json_path, "click_through_bench");
  const fs::path work = fs::path(results_file.path()).parent_path() / "click_through_bench_runs";
  fmt::print(stderr, "click_through_bench: writing the samples ({} steps x {} per trainer)...\n",
             config.steps, config.batch);
  write_samples(config, work / "samples");

  // Each side's name and the example's --table (PyTorch's: none).
  const std::vector<std::pair<std::string, std::string>> side_tables = {
      {"ours, collisionless", "id"}, {"ours, hashed", "fixed"}, {"PyTorch, hashed", ""}};
  std::vector<std::string> sides;
  for (const auto& side_table : side_tables) sides.push_back(side_table.first);
  std::map<std::string, std::vector<Run>> runs;
  const double load_at_start = load_average();
  for (int r = 0; r < config.rounds; ++r) {
    for (const auto& [side, table] : side_tables) {
      fmt::print(stderr, "click_through_bench: round {} of {}, {}...\n", r + 1, config.rounds,
                 side);
      runs[side].push_back(
          table.empty() ? run_pytorch(config, work / "samples")
                        : run_ours(config, table, work / fmt::format("round{}-{}", r + 1, table)));
    }
  }
  const double load_at_end = load_average();

  const auto values = [&](const std::string& side, double Run::*field) {
    std::vector<double> out;
    for (const Run& run : runs[side]) out.push_back(run.*field);
    return out;
  };
  const auto ratios = [&](const std::string& a, const std::string& b) {
    std::vector<double> out;
    for (int r = 0; r < config.rounds; ++r) {
      out.push_back(runs[a][r].samples_per_second / runs[b][r].samples_per_second);
    }
    return out;
  };
  const std::string settings = fmt::format(
      "examples/click_through's job (2 servers + {} trainers on this machine, a table of {} rows "
      "x {} shared by the 26 features, the MLP on the first server, Adagrad lr {} (table) and {} "
      "(MLP), {} steps of {} samples per trainer, held-out set of {} at the last step's time), "
      "the same samples on every side; {} rounds alternating the sides. Every side: 1 intra-op "
      "thread per process; ours the example's defaults under distrun; PyTorch 1.13 TensorPipe "
      "with 16 RPC worker threads, defaults otherwise, one DistributedOptimizer per learning rate "
      "(it has no param groups)",
      kTrainers, config.rows, kDim, kLr, kMlpLr, config.steps, config.batch, config.held_out,
      config.rounds);
  fmt::print("\nclick_through_bench: {}\n", settings);
  fmt::print("{}\n\n", machine_load_line(load_at_start, load_at_end));
  fmt::print("{:<22} {:>26} {:>26} {:>26}\n", "side", "samples/s (min/med/max)",
             "held-out AUC (min/med/max)", "log loss (min/med/max)");
  Json cases = Json::array();
  std::vector<std::string> problems;
  for (const std::string& side : sides) {
    const Spread rate = spread_of(values(side, &Run::samples_per_second));
    const Spread auc = spread_of(values(side, &Run::auc));
    const Spread loss = spread_of(values(side, &Run::log_loss));
    fmt::print("{:<22} {:>26} {:>26} {:>26}\n", side, spread_text(rate, "{:.0f}"),
               spread_text(auc, "{:.4f}"), spread_text(loss, "{:.4f}"));
    cases.push_back(spread_row(side + ": samples/s", values(side, &Run::samples_per_second),
                               "samples/s", "higher"));
    cases.push_back(spread_row(side + ": held-out AUC", values(side, &Run::auc), "AUC", "higher"));
    cases.push_back(spread_row(side + ": held-out log loss", values(side, &Run::log_loss),
                               "log loss", "lower"));
    for (const Run& run : runs[side]) {
      if (!std::isfinite(run.log_loss)) problems.push_back(side + ": a held-out loss not finite");
    }
  }
  const std::vector<double> id_over_fixed = ratios(sides[0], sides[1]);
  const std::vector<double> id_over_pytorch = ratios(sides[0], sides[2]);
  const std::vector<double> fixed_over_pytorch = ratios(sides[1], sides[2]);
  fmt::print(
      "\nper round, samples/s: collisionless over hashed {:.2f} (the aim: at least 0.8x); "
      "collisionless over PyTorch's hashed {:.2f}; our hashed over PyTorch's {:.2f} "
      "(min/med/max: {}, {}, {})\n\n",
      spread_of(id_over_fixed).median, spread_of(id_over_pytorch).median,
      spread_of(fixed_over_pytorch).median, spread_text(spread_of(id_over_fixed), "{:.2f}"),
      spread_text(spread_of(id_over_pytorch), "{:.2f}"),
      spread_text(spread_of(fixed_over_pytorch), "{:.2f}"));
  // What the table buys, per round (the table's rows round them to two decimals).
  const auto differences = [&](double Run::*field, const std::string& b) {
    std::vector<double> out;
    for (int r = 0; r < config.rounds; ++r)
      out.push_back(runs[sides[0]][r].*field - runs[b][r].*field);
    return out;
  };
  for (const std::string& other : {sides[1], sides[2]}) {
    cases.push_back(spread_row("held-out AUC, collisionless minus " + other,
                               differences(&Run::auc, other), "AUC", "higher"));
    cases.push_back(spread_row("held-out log loss, collisionless minus " + other,
                               differences(&Run::log_loss, other), "log loss", "lower"));
  }
  cases.push_back(
      spread_row("samples/s, collisionless over hashed", id_over_fixed, "ratio", "higher"));
  cases.push_back(spread_row("samples/s, collisionless over PyTorch's hashed", id_over_pytorch,
                             "ratio", "higher"));
  cases.push_back(spread_row("samples/s, our hashed over PyTorch's hashed", fixed_over_pytorch,
                             "ratio", "higher"));
  cases.push_back(Json{
      {"case", "settings"},
      {"settings", settings},
      {"note",
       "each side's rows are its runs' min/median/max; the ratios are taken per round, of runs "
       "one after the other"}});
  return results_file.write_unless(cases, problems);
}

}  // namespace
}  // namespace bench
}  // namespace distoptim

int main(int argc, char** argv) {
  return distoptim::bench::run_main("click_through_bench", distoptim::bench::run, argc, argv);
}
