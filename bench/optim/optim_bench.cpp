// optim_bench: how fast are our optimizer steps, against the machine and against PyTorch?
//
// In one run it measures
//   (a) the memory-bandwidth limit for this kind of kernel: the fastest of several STREAM-style
//       in-place probes over arrays far larger than the cache, from 2 to 7 streams of reads and
//       writes (the optimizers' patterns lie within), see stream_kernel.h;
//   (b) our step: distoptim::optim::create_optimizer(...)->step(gradients);
//   (c) LibTorch's torch::optim step;
//   (d) PyTorch's torch.optim step in Python (bench/optim/pytorch_step.py under the system
//       Python, the faster of foreach=True and foreach=False);
// for SGD with momentum, Adam, AdamW, Adagrad and RMSprop over two parameter sets: the seed's
// model (20 x Linear(2000, 2000), about 80M floats) and 2000 tensors of 1000 floats. And the
// seed's QHM, three ways: "qhm" is ours in C++ (examples/custom_qhm/qhm.h), "qhm_script" the
// recipe's TorchScript file (examples/custom_qhm/qhm_torchscript.py, made at start-up) loaded by
// optim::register_torchscript_optimizer, both against PyTorch running that same file from Python
// (its update called per step, as the seed's DistributedOptimizer would); LibTorch has no QHM. (d)
// and then (b) and (c) alternate in rounds; in each round a time is the minimum over repetitions
// (the machine is shared and noisy), and the figure reported is the median over the rounds, with
// the min and max beside it. It prints a table and writes the same as JSON to the file named by
// --json.
//
// Usage: optim_bench --json PATH [--rounds N] [--reps N] [--quick] [--optimizers LIST]
//                    [--warm-cache]

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <distoptim/optim.h>
#include <distoptim/optim/kernel_isa.h>

#include "../common/child_process.h"
#include "../common/report.h"
#include "qhm.h"
#include "stream_kernel.h"

namespace distoptim {
namespace bench {
namespace {

using json = nlohmann::json;  // NOLINT: the library's own spelling
using Clock = std::chrono::steady_clock;

constexpr int kThreads = 2;
// Untimed steps before the timed ones: the first creates the optimizer state (and touches its
// pages), the second runs with everything in place.
constexpr int kWarmupSteps = 2;
constexpr int kMinStreamReps = 5;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// --- (a) the bandwidth limit ---------------------------------------------------------------------

// One probe (see stream_kernel.h) compiled for one instruction set.
struct StreamVariant {
  StreamProbeShape shape;
  const char* isa;
  StreamProbeFn fn;
  // Best time of a whole pass over the arrays, and of one block of a pass (see kStreamBlock).
  double best_s = std::numeric_limits<double>::infinity();
  double best_block_s = std::numeric_limits<double>::infinity();
};

std::string probe_name(const StreamProbeShape& shape) {
  return fmt::format("{} streams ({} in place + {} read)", shape.streams(), shape.read_write,
                     shape.read_only);
}

// Each pass is also timed block by block. On a busy machine the minimum of many short windows
// is less often cut by another process than that of a pass over the whole arrays, and the
// optimizer steps it is compared with (the small set moves 40-56 MB) are short windows too, so
// timing whole passes only would set the limit low and flatter the steps. A block of the
// smallest probe (one 16 MB array, read and written) is below the 32-36 MB L3, but the pass
// reaches it after sweeping the rest of the arrays, so it still comes from memory.
constexpr int64_t kStreamBlock = int64_t{4} << 20;
// The s of the probes: the arrays (from 1) stay far from overflow over any number of passes, yet
// each pass changes them (1e-6 is above half an ulp of 1).
constexpr float kStreamScale = 1e-6f;
// 17 cache lines: see StreamBench's constructor.
constexpr int64_t kStreamStaggerFloats = 272;

struct StreamResult {
  int64_t elements = 0;
  int64_t block_elements = 0;
  int reps = 0;
  std::vector<StreamVariant> variants;
  double limit_gbps = 0;
  std::string limit_variant;
};

// Runs `fn` over [0, n) split between the intra-op threads, as the optimizer kernels are.
void parallel_stream(StreamProbeFn fn, float* const* x, int64_t n) {
  at::parallel_for(0, n, /*grain_size=*/1 << 16,
                   [&](int64_t begin, int64_t end) { fn(x, kStreamScale, begin, end); });
}

// Owns the arrays, allocated and filled once (fill_ writes every page, in parallel, so no page
// fault lands in a timed pass), and accumulates each variant's best times over all rounds. The
// limit is the best probe's best time over rounds spread through the run: before everything,
// before each case and at the end, so one busy moment on the shared machine does not set it.
// The probes bracket the optimizers' access patterns (2 to 7 streams): the memory system serves
// some mixes of reads and writes faster than others, and the limit is the fastest of them, so
// no optimizer's fraction of it can exceed 100% by streaming a friendlier mix.
class StreamBench {
 public:
  explicit StreamBench(int64_t n) {
    __builtin_cpu_init();
    // Array k starts k * 1088 bytes into its allocation: arrays that all start on a page
    // boundary put the i-th elements of every stream at the same address modulo 4 KB, where the
    // CPU mistakes loads for dependent on earlier stores (4K aliasing) and the probe measures
    // that rather than memory.
    for (int k = 0; k < kStreamProbeArrays; ++k) {
      const int64_t stagger = k * kStreamStaggerFloats;
      arrays_.push_back(at::empty({n + stagger}, at::kFloat).fill_(1.0f).narrow(0, stagger, n));
      pointers_.push_back(arrays_.back().data_ptr<float>());
    }
    result_.elements = n;
    result_.block_elements = std::min(n, kStreamBlock);
    struct Isa {
      const char* name;
      const StreamProbeFn* probes;
      bool supported;
    };
    const Isa isas[] = {
        {"default", stream_probes_default(), true},
        {"avx2", stream_probes_avx2(),
         __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")},
        {"avx512", stream_probes_avx512(), static_cast<bool>(__builtin_cpu_supports("avx512f"))},
    };
    for (int k = 0; k < kNumStreamProbes; ++k) {
      for (const Isa& isa : isas) {
        if (!isa.supported) continue;
        result_.variants.push_back({kStreamProbes[k], isa.name, isa.probes[k]});
        parallel_stream(isa.probes[k], pointers_.data(), n);
      }
    }
  }

  /// `reps` timed passes of every supported variant.
  void round(int reps);
  const StreamResult& result() const { return result_; }

 private:
  StreamResult result_;
  std::vector<at::Tensor> arrays_;
  std::vector<float*> pointers_;
};

double pass_gbps(const StreamVariant& v, int64_t elements) {
  return v.shape.bytes_per_element() * static_cast<double>(elements) / v.best_s / 1e9;
}
double block_gbps(const StreamVariant& v, int64_t block_elements) {
  return v.shape.bytes_per_element() * static_cast<double>(block_elements) / v.best_block_s / 1e9;
}

void StreamBench::round(int reps) {
  StreamResult& result = result_;
  const int64_t n = result.elements;
  // Variants take turns within each repetition, so a noisy moment does not favour one of them.
  for (int r = 0; r < reps; ++r) {
    for (auto& v : result.variants) {
      const auto start = Clock::now();
      for (int64_t begin = 0; begin < n; begin += result.block_elements) {
        const int64_t count = std::min(result.block_elements, n - begin);
        std::vector<float*> block(pointers_.size());
        for (size_t k = 0; k < block.size(); ++k) block[k] = pointers_[k] + begin;
        const auto block_start = Clock::now();
        parallel_stream(v.fn, block.data(), count);
        if (count == result.block_elements) {
          v.best_block_s = std::min(v.best_block_s, seconds_since(block_start));
        }
      }
      v.best_s = std::min(v.best_s, seconds_since(start));
    }
  }
  result.reps += reps;
  for (const auto& a : arrays_) {
    TORCH_CHECK(std::isfinite(a[n - 1].item<float>()), "a stream probe made a non-finite value");
  }
  result.limit_gbps = 0;
  for (const auto& v : result.variants) {
    // The faster of whole passes and blocks: the higher limit, the stricter fraction.
    const double pass = pass_gbps(v, n);
    const double block = block_gbps(v, result.block_elements);
    if (std::max(pass, block) > result.limit_gbps) {
      result.limit_gbps = std::max(pass, block);
      result.limit_variant = fmt::format("{}, {}, {}", probe_name(v.shape), v.isa,
                                         block > pass ? "block" : "whole pass");
    }
  }
}

// --- the cases -----------------------------------------------------------------------------------

// A parameter set: `shapes` repeated `repeat` times (per layer of a model: weight, bias).
struct ParamSet {
  std::string name;
  std::string description;
  int64_t repeat;
  std::vector<std::vector<int64_t>> shapes;
  // Timed steps are `rep_factor` x --reps: a small set's step takes milliseconds, and on a shared
  // machine more samples make its minimum steadier at little cost.
  int rep_factor = 1;

  int64_t numel() const {
    int64_t per_repeat = 0;
    for (const auto& shape : shapes) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      per_repeat += n;
    }
    return repeat * per_repeat;
  }
  int64_t num_tensors() const { return repeat * static_cast<int64_t>(shapes.size()); }
};

using LibTorchFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(const std::vector<at::Tensor>&)>;

struct OptimizerSpec {
  std::string name;  // registry name, also the torch.optim class key in pytorch_step.py
  // Bytes an ideal one-pass float32 kernel must move per parameter; see kOptimizers.
  int bytes_per_param;
  optim::OptionBag bag;      // ours
  json python_options;       // torch.optim keyword arguments
  LibTorchFactory libtorch;  // none: LibTorch has no such optimizer
};

// The optimizers and options compared, with the bytes per parameter that an ideal kernel (one
// pass over memory, each float32 operand read and/or written once, 4 bytes each) must move:
//   sgd, momentum=0.9:         param r+w, grad r, momentum_buffer r+w          5 x 4 = 20 B
//   adam / adamw (defaults):   param r+w, grad r, exp_avg r+w, exp_avg_sq r+w  7 x 4 = 28 B
//   adagrad:                   param r+w, grad r, sum r+w                      5 x 4 = 20 B
//   rmsprop (no momentum,      param r+w, grad r, square_avg r+w               5 x 4 = 20 B
//            not centered):
// AdamW's decoupled weight decay touches only the parameter, already counted.
std::vector<OptimizerSpec> optimizer_specs() {
  namespace to = torch::optim;
  std::vector<OptimizerSpec> specs;
  specs.push_back({"sgd", 20, optim::OptionBag{{"lr", 0.01}, {"momentum", 0.9}},
                   json{{"lr", 0.01}, {"momentum", 0.9}}, [](const std::vector<at::Tensor>& p) {
                     return std::unique_ptr<to::Optimizer>(
                         new to::SGD(p, to::SGDOptions(0.01).momentum(0.9)));
                   }});
  specs.push_back({"adam", 28, optim::OptionBag{{"lr", 1e-3}}, json{{"lr", 1e-3}},
                   [](const std::vector<at::Tensor>& p) {
                     return std::unique_ptr<to::Optimizer>(new to::Adam(p, to::AdamOptions(1e-3)));
                   }});
  specs.push_back({"adamw", 28, optim::OptionBag{{"lr", 1e-3}}, json{{"lr", 1e-3}},
                   [](const std::vector<at::Tensor>& p) {
                     return std::unique_ptr<to::Optimizer>(
                         new to::AdamW(p, to::AdamWOptions(1e-3)));
                   }});
  specs.push_back({"adagrad", 20, optim::OptionBag{{"lr", 0.01}}, json{{"lr", 0.01}},
                   [](const std::vector<at::Tensor>& p) {
                     return std::unique_ptr<to::Optimizer>(
                         new to::Adagrad(p, to::AdagradOptions(0.01)));
                   }});
  specs.push_back({"rmsprop", 20, optim::OptionBag{{"lr", 0.01}}, json{{"lr", 0.01}},
                   [](const std::vector<at::Tensor>& p) {
                     return std::unique_ptr<to::Optimizer>(
                         new to::RMSprop(p, to::RMSpropOptions(0.01)));
                   }});
  // QHM (no weight decay): param r+w, grad r, momentum_buffer r+w, as SGD with momentum.
  const optim::OptionBag qhm{{"lr", 0.01}, {"momentum", 0.9}, {"nu", 0.7}};
  const json python_qhm{{"lr", 0.01}, {"momentum", 0.9}, {"nu", 0.7}, {"weight_decay", 0.0}};
  specs.push_back({"qhm", 20, qhm, python_qhm, nullptr});
  specs.push_back({"qhm_script", 20, qhm, python_qhm, nullptr});
  return specs;
}

struct CaseResult {
  std::string name;
  const ParamSet* param_set;
  const OptimizerSpec* optimizer;
  double target_fraction;
  double ours_s = 0;
  double libtorch_s = 0;
  double pytorch_s = 0;
  bool pytorch_foreach = false;
  // Each round's figures (the three above are set per round, then to the medians).
  std::vector<double> ours_rounds, libtorch_rounds, pytorch_rounds;

  // Keeps this round's figures.
  void end_round() {
    ours_rounds.push_back(ours_s);
    libtorch_rounds.push_back(libtorch_s);
    pytorch_rounds.push_back(pytorch_s);
  }
  // Sets the figures to their medians over the rounds.
  void settle() {
    ours_s = median(ours_rounds);
    libtorch_s = median(libtorch_rounds);
    pytorch_s = median(pytorch_rounds);
  }
};

// Reading a buffer several times the size of the last-level cache before a timed step evicts the
// previous step's parameters and state (and writes back their dirty lines) outside the timed
// region, so a step whose data would fit in the cache (the small set is about 40 MB against a
// 36 MB L3) is still measured from memory, as it runs in training between forward and backward.
class CacheEvictor {
 public:
  explicit CacheEvictor(int64_t floats) {
    if (floats > 0) buffer_ = at::ones({floats}, at::kFloat);
  }
  int64_t floats() const { return buffer_.defined() ? buffer_.numel() : 0; }
  void evict() {
    if (buffer_.defined()) sink_ += buffer_.sum().item<float>();
  }

 private:
  at::Tensor buffer_;
  float sink_ = 0;
};

int64_t eviction_floats() {
  long l3 = ::sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 <= 0) l3 = 64L << 20;
  return std::max<int64_t>(int64_t{3} * l3, int64_t{64} << 20) / 4;
}

template <class Step>
double min_step_time(int reps, CacheEvictor& evictor, Step&& step) {
  for (int i = 0; i < kWarmupSteps; ++i) step();
  double best = std::numeric_limits<double>::infinity();
  for (int r = 0; r < reps; ++r) {
    evictor.evict();
    const auto start = Clock::now();
    step();
    best = std::min(best, seconds_since(start));
  }
  return best;
}

// --- (d) PyTorch, in one child process for every case -------------------------------------------

void run_pytorch(const std::string& python, const std::string& script,
                 const std::vector<ParamSet>& sets, std::vector<CaseResult>& cases, int reps,
                 int64_t evict_floats, const std::string& qhm_script, std::string& torch_version) {
  json spec;
  spec["threads"] = kThreads;
  spec["warmup"] = kWarmupSteps;
  spec["evict_floats"] = evict_floats;
  spec["seed"] = 0;
  for (const auto& set : sets) {
    spec["param_sets"][set.name] = {
        {"repeat", set.repeat}, {"shapes", set.shapes}, {"reps", reps * set.rep_factor}};
  }
  spec["cases"] = json::array();
  for (const auto& c : cases) {
    spec["cases"].push_back({{"case", c.name},
                             {"optimizer", c.optimizer->name},
                             {"param_set", c.param_set->name},
                             {"options", c.optimizer->python_options}});
  }
  spec["qhm_script"] = qhm_script;
  const ChildResult child = run_child({python, script}, spec.dump());
  TORCH_CHECK(child.exit_code == 0, "optim_bench: '", python, " ", script, "' exited with code ",
              child.exit_code);
  json out;
  try {
    out = json::parse(child.stdout_text);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, "optim_bench: cannot parse the output of ", script, ": ", e.what(),
                "; output was: ", child.stdout_text);
  }
  TORCH_CHECK(out.at("threads").get<int>() == kThreads, "optim_bench: PyTorch ran with ",
              out.at("threads").get<int>(), " threads, wanted ", kThreads);
  torch_version = out.at("torch_version").get<std::string>();
  for (auto& c : cases) {
    bool found = false;
    for (const auto& r : out.at("results")) {
      if (r.at("case").get<std::string>() != c.name) continue;
      c.pytorch_s = r.at("best_s").get<double>();
      c.pytorch_foreach = r.at("foreach").get<bool>();
      found = true;
    }
    TORCH_CHECK(found, "optim_bench: ", script, " reported no result for case ", c.name);
  }
}

// --- (b) ours and (c) LibTorch, in this process --------------------------------------------------

// `before_case` runs before each case (a round of the bandwidth measurement).
void run_cpp(const std::vector<ParamSet>& sets, std::vector<CaseResult>& cases, int reps,
             CacheEvictor& evictor, const std::function<void()>& before_case) {
  torch::manual_seed(0);
  for (const auto& set : sets) {
    // Parameters and their fixed gradients, shared by our optimizers and LibTorch's (each
    // optimizer has its own state and is destroyed before the next is made). randn writes every
    // page, so no first-touch fault lands in a timed step.
    std::vector<at::Tensor> params;
    std::vector<at::Tensor> grads;
    for (int64_t r = 0; r < set.repeat; ++r) {
      for (const auto& shape : set.shapes) {
        params.push_back(torch::randn(shape));
        grads.push_back(torch::randn(shape));
      }
    }
    for (auto& c : cases) {
      if (c.param_set != &set) continue;
      before_case();
      fmt::print(stderr, "optim_bench: {}: ours...", c.name);
      {
        auto ours = optim::create_optimizer(c.optimizer->name, {optim::ParamGroup(params)},
                                            c.optimizer->bag);
        c.ours_s = min_step_time(reps * set.rep_factor, evictor, [&] { ours->step(grads); });
      }
      fmt::print(stderr, " {:.2f} ms; libtorch...", c.ours_s * 1e3);
      if (c.optimizer->libtorch) {
        for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i];
        auto theirs = c.optimizer->libtorch(params);
        c.libtorch_s = min_step_time(reps * set.rep_factor, evictor, [&] { theirs->step(); });
        for (auto& p : params) p.mutable_grad() = at::Tensor();
      } else {
        c.libtorch_s = std::numeric_limits<double>::quiet_NaN();
      }
      fmt::print(stderr, " {:.2f} ms\n", c.libtorch_s * 1e3);
      for (const auto& p : params) {
        TORCH_CHECK(p.isfinite().all().item<bool>(), "optim_bench: ", c.name,
                    " made a parameter non-finite");
      }
    }
  }
}

// --- report --------------------------------------------------------------------------------------

double gbps_of(const CaseResult& c) {
  return static_cast<double>(c.optimizer->bytes_per_param) *
         static_cast<double>(c.param_set->numel()) / c.ours_s / 1e9;
}

void print_report(const StreamResult& stream, const std::vector<ParamSet>& sets,
                  const std::vector<CaseResult>& cases, int reps, int rounds, bool evict,
                  const std::string& torch_version, const std::pair<double, double>& load) {
  fmt::print("\noptim_bench: {} threads, our kernels: {}, LibTorch {}, PyTorch {} (Python)\n",
             at::get_num_threads(), optim::kernel_isa(), TORCH_VERSION, torch_version);
  fmt::print(
      "times: the median over {} rounds (each PyTorch's steps, then ours and LibTorch's) of each "
      "round's minimum over the timed steps after {} warm-up steps{}\n",
      rounds, kWarmupSteps,
      evict ? ", caches evicted before each timed step" : ", caches left warm");
  fmt::print("{}\n", machine_load_line(load.first, load.second));
  for (const auto& set : sets) {
    fmt::print("  {:<6} {} ({} tensors, {:.1f}M floats), {} timed steps\n", set.name,
               set.description, set.num_tensors(), static_cast<double>(set.numel()) / 1e6,
               reps * set.rep_factor);
  }
  fmt::print(
      "\n(a) bandwidth limit: the fastest of {} streaming probes (x_j += s * reads, in place) over "
      "{} arrays of {}M floats, best of {} (rounds at the start, before each case and at the "
      "end); GB/s of the best whole pass / best {}M-float block\n",
      kNumStreamProbes, kStreamProbeArrays, stream.elements >> 20, stream.reps,
      stream.block_elements >> 20);
  for (const auto& v : stream.variants) {
    fmt::print("  {:<36} {:<8} {:2} B/el  pass {:6.2f} GB/s  block {:6.2f} GB/s\n",
               probe_name(v.shape), v.isa, v.shape.bytes_per_element(),
               pass_gbps(v, stream.elements), block_gbps(v, stream.block_elements));
  }
  fmt::print("  limit: {:.2f} GB/s ({})\n", stream.limit_gbps, stream.limit_variant);
  // On a quiet machine the best whole pass comes within a few percent of the best block; far
  // below it means other processes held the cores or the memory for much of the run, and every
  // time here, ours included, is then unreliable.
  double best_pass_gbps = 0;
  for (const auto& v : stream.variants) {
    best_pass_gbps = std::max(best_pass_gbps, pass_gbps(v, stream.elements));
  }
  if (best_pass_gbps < 0.8 * stream.limit_gbps) {
    fmt::print(
        "  WARNING: the best whole pass reached only {:.0f}% of the best block: the machine "
        "was busy during this run; rerun on a quiet machine before trusting the numbers\n",
        100 * best_pass_gbps / stream.limit_gbps);
  }
  fmt::print("\n");

  fmt::print("{:<16} {:>5} {:>10} {:>7} {:>7} {:>11} {:>8} {:>11} {:>9} {:>8}  {}\n", "case",
             "B/par", "ours ms", "GB/s", "limit", "libtorch ms", "vs lt", "pytorch ms", "(variant)",
             "vs py", "target");
  for (const auto& c : cases) {
    const double gbps = gbps_of(c);
    const double fraction = gbps / stream.limit_gbps;
    const double vs_libtorch = c.libtorch_s / c.ours_s;
    std::string verdict;
    if (fraction < c.target_fraction) {
      verdict += fmt::format("below {:.0f}% of limit", c.target_fraction * 100);
    }
    if (vs_libtorch <= 1.0)
      verdict += verdict.empty() ? "slower than LibTorch" : ", slower than LibTorch";
    if (verdict.empty())
      verdict = fmt::format("ok (>= {:.0f}%, beats LibTorch)", c.target_fraction * 100);
    // LibTorch has no QHM: its columns say so.
    const bool libtorch = !std::isnan(c.libtorch_s);
    fmt::print(
        "{:<16} {:>5} {:>10.2f} {:>7.2f} {:>6.0f}% {:>11} {:>8} {:>11.2f} {:>9} {:>7.2f}x  {}\n",
        c.name, c.optimizer->bytes_per_param, c.ours_s * 1e3, gbps, fraction * 100,
        libtorch ? fmt::format("{:.2f}", c.libtorch_s * 1e3) : "-",
        libtorch ? fmt::format("{:.2f}x", vs_libtorch) : "-", c.pytorch_s * 1e3,
        libtorch ? (c.pytorch_foreach ? "foreach" : "for-loop") : "script", c.pytorch_s / c.ours_s,
        verdict);
  }
  fmt::print("\nspread over the rounds, ms (min/median/max):\n");
  for (const auto& c : cases) {
    const Spread o = spread_of(c.ours_rounds), p = spread_of(c.pytorch_rounds);
    fmt::print("  {:<16} ours {:.2f}/{:.2f}/{:.2f}  pytorch {:.2f}/{:.2f}/{:.2f}\n", c.name,
               o.min * 1e3, o.median * 1e3, o.max * 1e3, p.min * 1e3, p.median * 1e3, p.max * 1e3);
  }
  fmt::print(
      "\nGB/s = bytes an ideal one-pass kernel moves (B/par x params) / our time; "
      "limit = that / bandwidth limit;\nvs lt, vs py = LibTorch's, PyTorch's time / ours; "
      "targets: large >= 80% of limit, small >= 50%, faster than LibTorch.\n");
}

json to_json(const StreamResult& stream, const std::vector<CaseResult>& cases) {
  json out = json::array();
  for (const auto& c : cases) {
    const double gbps = gbps_of(c);
    out.push_back({{"case", c.name},
                   {"ours_s", c.ours_s},
                   {"libtorch_s", c.libtorch_s},
                   {"pytorch_s", c.pytorch_s},
                   {"gbps", gbps},
                   {"limit_gbps", stream.limit_gbps},
                   {"limit_probe", stream.limit_variant},
                   {"limit_fraction", gbps / stream.limit_gbps},
                   {"speedup_vs_libtorch", c.libtorch_s / c.ours_s},
                   {"speedup_vs_pytorch", c.pytorch_s / c.ours_s},
                   {"ours_min_s", spread_of(c.ours_rounds).min},
                   {"ours_max_s", spread_of(c.ours_rounds).max},
                   {"pytorch_min_s", spread_of(c.pytorch_rounds).min},
                   {"pytorch_max_s", spread_of(c.pytorch_rounds).max},
                   {"rounds", c.ours_rounds.size()}});
  }
  return out;
}

int run(int argc, char** argv) {
  std::string json_path;
  int reps = 0;
  int rounds = 0;
  bool quick = false;
  bool warm_cache = false;
  std::string python = DISTOPTIM_REFERENCE_PYTHON;
  std::string script = DISTOPTIM_PYTORCH_STEP_SCRIPT;

  CLI::App app{
      "Optimizer-step benchmark: our functional optimizers against the memory-bandwidth limit, "
      "LibTorch's torch::optim and PyTorch's torch.optim, on 2 threads."};
  app.add_option("--json", json_path, "Write the results as JSON to this file")->required();
  app.add_option("--reps", reps,
                 "Timed repetitions per measurement, the minimum is reported (default 7, or 2 "
                 "with --quick; the small set's steps run 4 times as many)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--quick", quick,
               "Smoke run: fewer repetitions, one round and a 2-layer model instead of 20 layers");
  app.add_option("--rounds", rounds,
                 "Rounds of PyTorch's steps then ours and LibTorch's (figures: the median over "
                 "the rounds of each round's minimum; default 3, or 1 with --quick)")
      ->check(CLI::PositiveNumber);
  std::vector<std::string> only;
  app.add_option("--optimizers", only,
                 "Run only these optimizers (comma-separated; default: sgd,adam,adamw,adagrad,"
                 "rmsprop,qhm,qhm_script)")
      ->delimiter(',')
      ->check(CLI::IsMember({"sgd", "adam", "adamw", "adagrad", "rmsprop", "qhm", "qhm_script"}));
  app.add_flag("--warm-cache", warm_cache,
               "Do not evict the caches before each timed step (the small set then partly runs "
               "from the L3 cache)");
  app.add_option("--python", python, "Python with PyTorch 1.13")->capture_default_str();
  app.add_option("--pytorch-script", script, "pytorch_step.py")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (reps == 0) reps = quick ? 2 : 7;
  if (rounds == 0) rounds = quick ? 1 : 3;

  ResultsFile results_file(json_path, "optim_bench");
  const double load_at_start = load_average();

  // The seed's QHM as the recipe saves it, beside the results; ours in C++ and from that file.
  const std::string qhm_script =
      (std::filesystem::path(results_file.path()).parent_path() / "qhm_script.pt").string();
  const ChildResult made = run_child(
      {python, DISTOPTIM_SOURCE_DIR "/examples/custom_qhm/qhm_torchscript.py", qhm_script}, "");
  TORCH_CHECK(made.exit_code == 0, "optim_bench: qhm_torchscript.py exited with code ",
              made.exit_code);
  qhm::register_qhm();
  optim::register_torchscript_optimizer("qhm_script", qhm_script);

  // Exactly two threads for everything: the bandwidth kernel, our steps and LibTorch's here,
  // PyTorch's in the child.
  at::set_num_threads(kThreads);
  TORCH_CHECK(at::get_num_threads() == kThreads, "optim_bench: at::get_num_threads() is ",
              at::get_num_threads(), " after at::set_num_threads(", kThreads, ")");
  // at::parallel_for is inlined here; it runs on one thread if this file was built without
  // OpenMP (see bench/CMakeLists.txt), which would halve the bandwidth limit unnoticed.
  std::atomic<int> chunks{0};
  at::parallel_for(0, kThreads, 1, [&](int64_t, int64_t) { ++chunks; });
  TORCH_CHECK(chunks.load() == kThreads, "optim_bench: at::parallel_for ran ", chunks.load(),
              " chunk(s) on ", kThreads, " threads: build this file with OpenMP");

  const std::vector<ParamSet> sets = {
      {"large",
       quick ? "2 x Linear(2000, 2000) (--quick; the seed's model has 20)"
             : "the seed's model: 20 x Linear(2000, 2000), weight and bias per layer",
       quick ? 2 : 20,
       {{2000, 2000}, {2000}},
       1},
      {"small", "2000 tensors of 1000 floats", 2000, {{1000}}, 4},
  };
  std::vector<OptimizerSpec> optimizers = optimizer_specs();
  if (!only.empty()) {
    optimizers.erase(std::remove_if(optimizers.begin(), optimizers.end(),
                                    [&](const OptimizerSpec& o) {
                                      return std::find(only.begin(), only.end(), o.name) ==
                                             only.end();
                                    }),
                     optimizers.end());
  }
  std::vector<CaseResult> cases;
  for (const auto& set : sets) {
    for (const auto& o : optimizers) {
      CaseResult c;
      c.name = o.name + "/" + set.name;
      c.param_set = &set;
      c.optimizer = &o;
      c.target_fraction = set.name == "large" ? 0.8 : 0.5;
      cases.push_back(c);
    }
  }

  // (a) first, before anything else is allocated; then a round before each of our cases and a
  // last one at the end (see StreamBench).
  fmt::print(stderr, "optim_bench: measuring the bandwidth limit...\n");
  StreamBench stream_bench(int64_t{quick ? 16 : 32} << 20);
  const int stream_reps = std::max(kMinStreamReps, reps);
  stream_bench.round(stream_reps);

  // (d) then (b) and (c), alternating round after round, so that drift in the shared machine's
  // load reaches every side alike. PyTorch's child runs while this process sits idle.
  const int64_t evict_floats = warm_cache ? 0 : eviction_floats();
  CacheEvictor evictor(evict_floats);
  std::string torch_version;
  for (int round = 1; round <= rounds; ++round) {
    fmt::print(stderr, "optim_bench: round {} of {}: running {} {}...\n", round, rounds, python,
               script);
    run_pytorch(python, script, sets, cases, reps, evict_floats, qhm_script, torch_version);
    run_cpp(sets, cases, reps, evictor, [&] { stream_bench.round(1); });
    for (auto& c : cases) c.end_round();
  }
  for (auto& c : cases) c.settle();

  fmt::print(stderr, "optim_bench: measuring the bandwidth limit again...\n");
  stream_bench.round(stream_reps);
  const StreamResult& stream = stream_bench.result();

  print_report(stream, sets, cases, reps, rounds, !warm_cache, torch_version,
               {load_at_start, load_average()});

  return results_file.write_unless(to_json(stream, cases), {});
}

}  // namespace
}  // namespace bench
}  // namespace distoptim

int main(int argc, char** argv) {
  return distoptim::bench::run_main("optim_bench", distoptim::bench::run, argc, argv);
}
