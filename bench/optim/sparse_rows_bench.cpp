// sparse_rows_bench: how fast do our optimizers update the rows a sparse gradient names, against
// the machine and against PyTorch?
//
// The case a parameter server's embedding table meets every step: a table of R rows x 32 floats
// (1e6 rows by default: 128 MB, far larger than the cache) and a coalesced sparse COO gradient of
// K distinct uniformly random rows (16384 by default). In one run it measures
//   (a) the limit for this access pattern: a probe that moves exactly the rows an optimizer
//       moves, with no arithmetic to speak of (row r of 1, 2 or 3 table-sized arrays updated in
//       place by x += s * g, g read), on the same rows, split over the same threads; the best of
//       several passes, measured again in every round;
//   (b) our step: distoptim::optim::create_optimizer(name, ...)->step({gradient});
//   (c) PyTorch's torch.optim step with the same gradient (bench/optim/pytorch_sparse_rows.py
//       under the system Python);
// for SGD (lr 0.01: 1 array moved, its probe 3 row streams), Adagrad (lr 0.01: 2 arrays, 5
// streams) and SparseAdam (lr 1e-3: 3 arrays, 7 streams). Ours and PyTorch's alternate in rounds;
// a round's time is the minimum over its timed steps after 2 warm-up steps; the figures are the
// median over rounds, with min and max beside them.
//
// rows/s = K / step time; GB/s = the bytes of the matching probe (streams x K x 128 B) / step
// time; "of the limit" = our GB/s over the probe's in the same round.
//
// Usage: sparse_rows_bench --json PATH [--rounds 3] [--rows R] [--touched K] [--reps N] [--quick]

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/core.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <distoptim/optim.h>

#include "../common/child_process.h"
#include "../common/report.h"

namespace distoptim {
namespace bench {
namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr int kThreads = 2;
constexpr int64_t kDim = 32;
constexpr int kWarmupSteps = 2;
constexpr float kProbeScale = 1e-6f;

struct Case {
  std::string name;  // ours and PyTorch's: sgd, adagrad, sparse_adam
  int arrays;        // table-sized arrays the update reads and writes: the parameter and its state
  optim::OptionBag ours;
  Json pytorch;
};

std::vector<Case> cases() {
  return {{"sgd", 1, optim::OptionBag{{"lr", 0.01}}, Json{{"lr", 0.01}}},
          {"adagrad", 2, optim::OptionBag{{"lr", 0.01}}, Json{{"lr", 0.01}}},
          {"sparse_adam", 3, optim::OptionBag{{"lr", 1e-3}}, Json{{"lr", 1e-3}}}};
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The fastest of `reps` runs of `step`.
template <class Step>
double min_time(int reps, Step&& step) {
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < reps; ++i) {
    const auto start = Clock::now();
    step();
    best = std::min(best, seconds_since(start));
  }
  return best;
}

// The probe's arrays and the gradient, made once.
struct Workload {
  Workload(int64_t rows, int64_t touched) {
    at::manual_seed(0);
    indices = std::get<0>(at::randperm(rows, at::kLong).narrow(0, 0, touched).sort());
    values = at::randn({touched, kDim});
    gradient = at::sparse_coo_tensor(indices.unsqueeze(0), values, {rows, kDim}).coalesce();
    for (int k = 0; k < 3; ++k) probe_arrays.push_back(at::ones({rows, kDim}));
  }
  at::Tensor indices;
  at::Tensor values;
  at::Tensor gradient;
  std::vector<at::Tensor> probe_arrays;
};

// One pass of the probe over `arrays` of the workload's arrays: row r of each += s * its
// gradient row, the rows split between the intra-op threads as the optimizers split them.
void probe_pass(Workload& work, int arrays) {
  const int64_t* rows = work.indices.data_ptr<int64_t>();
  const float* g = work.values.data_ptr<float>();
  float* x[3];
  for (int k = 0; k < arrays; ++k) x[k] = work.probe_arrays[k].data_ptr<float>();
  at::parallel_for(0, work.indices.numel(), 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* gi = g + i * kDim;
      for (int k = 0; k < arrays; ++k) {
        float* xi = x[k] + rows[i] * kDim;
        for (int64_t j = 0; j < kDim; ++j) xi[j] += kProbeScale * gi[j];
      }
    }
  });
}

// Bytes the probe (and an ideal kernel of the same pattern) moves: each array read and written,
// the gradient read.
double pattern_bytes(const Case& c, int64_t touched) {
  return static_cast<double>(2 * c.arrays + 1) * touched * kDim * sizeof(float);
}

// One round of ours: for each case the probe's best pass and our best step.
Json our_round(Workload& work, int64_t rows, int reps) {
  Json out;
  for (const Case& c : cases()) {
    const double probe_s = min_time(reps, [&] { probe_pass(work, c.arrays); });
    at::Tensor table = at::randn({rows, kDim});
    auto optimizer = optim::create_optimizer(c.name, {optim::ParamGroup({table})}, c.ours);
    for (int i = 0; i < kWarmupSteps; ++i) optimizer->step({work.gradient});
    const double step_s = min_time(reps, [&] { optimizer->step({work.gradient}); });
    TORCH_CHECK(table.isfinite().all().item<bool>(), "sparse_rows_bench: ", c.name,
                " made the table non-finite");
    out[c.name] = {{"probe_s", probe_s}, {"step_s", step_s}};
  }
  return out;
}

int run(int argc, char** argv) {
  std::string json_path;
  int rounds = 3;
  int reps = 7;
  int64_t rows = 1'000'000;
  int64_t touched = 16384;
  bool quick = false;
  std::string python = DISTOPTIM_REFERENCE_PYTHON;
  std::string script = DISTOPTIM_PYTORCH_SPARSE_ROWS_SCRIPT;
  CLI::App app{
      "Sparse row updates: our optimizers' step on a sparse gradient against a probe of the "
      "same access pattern and PyTorch's torch.optim, on 2 threads."};
  app.add_option("--json", json_path, "Write the results as JSON to this file")->required();
  app.add_option("--rounds", rounds, "Rounds alternating ours and PyTorch's")
      ->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "Timed steps per case and round (the minimum counts)")
      ->check(CLI::PositiveNumber);
  app.add_option("--rows", rows, "Rows of the table")->check(CLI::PositiveNumber);
  app.add_option("--touched", touched, "Distinct rows the gradient names")
      ->check(CLI::PositiveNumber);
  app.add_flag("--quick", quick, "Smoke run: 1 round, 2 steps, 1e5 rows, 4096 touched");
  app.add_option("--python", python, "Python with PyTorch 1.13");
  CLI11_PARSE(app, argc, argv);
  if (quick) {
    rounds = 1;
    reps = 2;
    rows = 100'000;
    touched = 4096;
  }
  TORCH_CHECK_VALUE(touched <= rows, "sparse_rows_bench: --touched ", touched, " exceeds --rows ",
                    rows);
  at::set_num_threads(kThreads);
  ResultsFile results_file(json_path, "sparse_rows_bench");
  const double load_at_start = load_average();
  Workload work(rows, touched);
  Json spec = {{"threads", kThreads}, {"rows", rows},           {"dim", kDim}, {"touched", touched},
               {"seed", 0},           {"warmup", kWarmupSteps}, {"reps", reps}};
  spec["cases"] = Json::array();
  for (const Case& c : cases()) spec["cases"].push_back({{"case", c.name}, {"options", c.pytorch}});
  const auto [ours, pytorch] = alternate_rounds(
      "sparse_rows_bench", fmt::format("{} of {} rows", touched, rows), rounds,
      [&] { return our_round(work, rows, reps); },
      [&] {
        const ChildResult child = run_child({python, script}, spec.dump());
        TORCH_CHECK(child.exit_code == 0, "sparse_rows_bench: ", script, " exited with ",
                    child.exit_code);
        const std::vector<Json> results = result_lines(child.stdout_text);
        TORCH_CHECK(!results.empty(), "sparse_rows_bench: ", script, " printed no RESULT");
        return results.front();
      });
  const double load_at_end = load_average();

  fmt::print(
      "\nsparse_rows_bench: a table of {} rows x {} floats ({:.0f} MB), a coalesced sparse "
      "gradient of {} distinct uniformly random rows; {} threads both sides; PyTorch {} "
      "(torch.optim at its defaults but lr); {} rounds alternating ours and PyTorch's, each the "
      "minimum of {} steps after {} warm-up steps\n",
      rows, kDim, rows * kDim * 4 / 1e6, touched, kThreads,
      pytorch.front().value("torch_version", "?"), rounds, reps, kWarmupSteps);
  fmt::print("{}\n\n", machine_load_line(load_at_start, load_at_end));
  fmt::print("{:<12} {:>24} {:>10} {:>8} {:>9} {:>24} {:>8}\n", "optimizer",
             "ours us (min/med/max)", "Mrows/s", "GB/s", "of limit", "pytorch us (min/med/max)",
             "vs py");
  Json rows_out = Json::array();
  for (const Case& c : cases()) {
    std::vector<double> our_s, probe_s, fraction, py_s;
    for (const Json& round : ours) {
      our_s.push_back(round.at(c.name).at("step_s").get<double>());
      probe_s.push_back(round.at(c.name).at("probe_s").get<double>());
      fraction.push_back(probe_s.back() / our_s.back());
    }
    for (const Json& round : pytorch) py_s.push_back(round.at("times_s").at(c.name).get<double>());
    const Spread o = spread_of(our_s), p = spread_of(py_s), f = spread_of(fraction);
    const double gbps = pattern_bytes(c, touched) / o.median / 1e9;
    fmt::print("{:<12} {:>24} {:>10.1f} {:>8.2f} {:>8.0f}% {:>24} {:>7.2f}x\n", c.name,
               fmt::format("{:.0f}/{:.0f}/{:.0f}", o.min * 1e6, o.median * 1e6, o.max * 1e6),
               touched / o.median / 1e6, gbps, f.median * 100,
               fmt::format("{:.0f}/{:.0f}/{:.0f}", p.min * 1e6, p.median * 1e6, p.max * 1e6),
               p.median / o.median);
    rows_out.push_back(comparison_row(c.name + " step, " + std::to_string(touched) + " rows", o, p,
                                      ours.size(), "s", true));
    rows_out.push_back({{"case", c.name + " rows/s"},
                        {"ours", touched / o.median},
                        {"pytorch", touched / p.median},
                        {"unit", "rows/s"},
                        {"better", "higher"}});
    rows_out.push_back({{"case", c.name + " fraction of the probe's GB/s (min/median/max)"},
                        {"ours", f.median},
                        {"ours_min", f.min},
                        {"ours_max", f.max},
                        {"pytorch", nullptr},
                        {"unit", "fraction"},
                        {"better", "higher"}});
  }
  fmt::print(
      "\nof limit: the probe's time (the same rows of 1/2/3 arrays read and written, the gradient "
      "read: 3/5/7 row streams of 128 B) over ours, in the same round (median over rounds);\n"
      "vs py: PyTorch's time over ours.\n");
  return results_file.write_unless(rows_out, {});
}

}  // namespace
}  // namespace bench
}  // namespace distoptim

int main(int argc, char** argv) {
  return distoptim::bench::run_main("sparse_rows_bench", distoptim::bench::run, argc, argv);
}
