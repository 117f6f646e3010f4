// rpc_bench: distoptim::rpc against PyTorch 1.13's torch.distributed.rpc (TensorPipe backend).
//
// In one run, with 3 workers on loopback on this machine, the same number of RPC worker threads
// on both sides (16, PyTorch's default, set explicitly) and 1 intra-op thread per process, it
// measures
//   ours:    this program's workers, started by distrun (`rpc_bench --worker ...`);
//   PyTorch: bench/rpc/pytorch_rpc.py under the system Python, which spawns its own 3 workers.
// Each side's worker0 measures and prints one "RESULT {json}" line with the same keys:
//   latency_median_us, latency_p99_us: rpc_sync from worker0 to worker1 of a function returning
//     its argument, at::ones({4}); 2000 timed calls after 200 warm-up ones. p99 is nearest-rank.
//   echo_4mb_mb_per_s: rpc_sync of the same function on a 4 MiB float tensor (1M floats), 200
//     timed calls after 20 warm-up ones. MB/s counts BOTH directions: 2 * 4,194,304 bytes per
//     call over the summed call times, 1 MB = 10^6 bytes.
//   sustained_*: the parameter-server load of PyTorch issue #57158 (round trips growing under
//     load). worker1 and worker2 each make half of the calls (100,000 in all) to worker0 with
//     rpc_async, each keeping a window of 32 calls in flight (the next is sent when one
//     completes). worker0 returns its argument, an int64 tensor of 4 equal values, plus one;
//     every result is checked. A call's latency runs from just before it is sent to its
//     completion callback. calls_per_s: all calls over the span from the first send to the last
//     completion. first10k/last10k: median latency of the first and last 10,000 calls in send
//     order across both callers (steady_clock, one clock for every process of the machine), and
//     latency_growth their ratio. server_rss_growth_mb: worker0's VmRSS when it served the last
//     call minus when it served the 10,000th; server_heap_growth_mb: the same for the bytes it has
//     allocated with malloc and not freed (glibc's mallinfo2). RSS grows also where nothing
//     leaks: shared-memory ring pages become resident as they are first written, and malloc
//     keeps freed memory; the heap shows what the process itself still holds.
// Each caller first makes 200 sequential warm-up calls so connection set-up is not timed.
// PyTorch's side is too slow for the time budget at 100,000 calls (about 75 s here), so it makes
// --pytorch-sustained-calls (default 40,000) while ours keeps 100,000; the table says so, and
// its last-10k median and growth then cover a shorter run than ours. A wrong result or a failed
// call makes the benchmark exit non-zero and write no JSON.
//
// The JSON written to --json is a list of {case, ours, pytorch, unit, ratio}. ratio is >1 where
// ours is better: pytorch/ours for times, growth factors and memory, ours/pytorch for
// throughputs; null where a value is not positive (an RSS that did not grow) and for the row
// sustained_calls, which records how many calls each side made.
//
// Every wait is bounded: RPCs carry timeouts, and each side runs under timeout(1), which kills
// its whole process group (distrun's ranks, Python's spawned workers) past --deadline-seconds.
//
// Usage: rpc_bench --json PATH [--sustained-calls N] [--pytorch-sustained-calls N] [--window N]
//                  [--threads N] [--deadline-seconds N]

#include <malloc.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/core.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <distoptim/comm/rendezvous.h>
#include <distoptim/rpc.h>

#include "../common/child_process.h"
#include "../common/report.h"

namespace distoptim {
namespace bench {
namespace {

namespace rpc = distoptim::rpc;
using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr int kWorldSize = 3;
constexpr int64_t kEchoFloats = 1 << 20;
constexpr int64_t kEchoBytes = kEchoFloats * static_cast<int64_t>(sizeof(float));
// The first and last calls of the sustained load whose median latencies are compared.
constexpr int64_t kEdgeCalls = 10000;
constexpr auto kCallTimeout = 30s;
constexpr char kTimeoutProgram[] = "/usr/bin/timeout";

struct Config {
  int threads = 16;
  int latency_warmup = 200;
  int latency_calls = 2000;
  int echo_warmup = 20;
  int echo_calls = 200;
  int64_t sustained_calls = 100000;
  // PyTorch needs about 75 s for 100,000 calls on this 2-core machine (0.75 s per 1,000), over
  // the time budget, so its side makes fewer by default; the table and JSON show both counts.
  int64_t pytorch_sustained_calls = 40000;
  int window = 32;
  int caller_warmup = 200;
  int deadline_seconds = 240;
};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

std::string worker_name(int rank) { return "worker" + std::to_string(rank); }

// --- the registered functions (every worker has them) --------------------------------------------

// Bytes the process has allocated with malloc and not freed, over every arena. Unlike VmRSS it
// leaves out memory malloc keeps after a free and the pages of TensorPipe's shared-memory rings,
// which become resident as the rings are first filled.
int64_t heap_in_use_bytes() {
  const struct mallinfo2 info = mallinfo2();
  return static_cast<int64_t>(info.uordblks + info.hblkhd);
}

// Calls of bench.plus_one served by this process, and its VmRSS and heap in use when the count
// reached kEdgeCalls and when it reached g_expected_calls, the last call of the load. Both are
// taken inside the server function, so the growth leaves out the timings the callers send back
// at the end (several MB at 100,000 calls).
struct MemoryMark {
  std::atomic<long> rss_kb{-1};
  std::atomic<int64_t> heap_bytes{-1};
  void take() {
    rss_kb = proc_status_kb("VmRSS");
    heap_bytes = heap_in_use_bytes();
  }
};
std::atomic<int64_t> g_served{0};
std::atomic<int64_t> g_expected_calls{-1};
MemoryMark g_at_edge;
MemoryMark g_at_end;

at::Tensor echo(const at::Tensor& tensor) { return tensor; }
DISTOPTIM_RPC_FUNCTION("bench.echo", echo);

at::Tensor plus_one(const at::Tensor& tensor) {
  const int64_t served = g_served.fetch_add(1) + 1;
  if (served == kEdgeCalls) g_at_edge.take();
  if (served == g_expected_calls.load()) g_at_end.take();
  return tensor + 1;
}
DISTOPTIM_RPC_FUNCTION("bench.plus_one", plus_one);

bool is_plus_one(const at::Tensor& result, int64_t value) {
  if (result.scalar_type() != at::kLong || result.dim() != 1 || result.size(0) != 4) return false;
  const at::Tensor contiguous = result.contiguous();
  const int64_t* data = contiguous.data_ptr<int64_t>();
  return std::all_of(data, data + 4, [&](int64_t x) { return x == value + 1; });
}

// One caller's share of the sustained load, per call in its send order: send time and latency
// (ns), then the counts of wrong results and of failed calls.
using LoadResult = std::tuple<at::Tensor, at::Tensor, int64_t, int64_t>;

// What the completion callbacks share with the sending thread; callbacks hold it by shared_ptr,
// so it outlives a sender that gave up.
struct LoadState {
  explicit LoadState(int64_t calls) : latency_ns(calls, -1) {}
  std::vector<int64_t> latency_ns;  // slot i written only by call i's callback
  std::atomic<int64_t> mismatches{0};
  std::atomic<int64_t> failures{0};
  std::mutex mutex;
  std::condition_variable changed;
  int64_t in_flight = 0;  // guarded by mutex
  int64_t completed = 0;  // guarded by mutex
};

// Runs on a caller (worker1 or worker2), inside the request worker0 sends it.
LoadResult run_load(const std::string& server, int64_t calls, int64_t window, int64_t first_value,
                    int64_t warmup, int64_t deadline_ms) {
  for (int64_t i = 0; i < warmup; ++i) {
    rpc::rpc_sync<at::Tensor>(server, "bench.echo", std::tuple{at::ones({4})}, kCallTimeout);
  }
  const auto deadline = Clock::now() + std::chrono::milliseconds(deadline_ms);
  auto state = std::make_shared<LoadState>(calls);
  std::vector<int64_t> sent_ns(calls);
  for (int64_t i = 0; i < calls; ++i) {
    {
      std::unique_lock<std::mutex> lock(state->mutex);
      TORCH_CHECK(
          state->changed.wait_until(lock, deadline, [&] { return state->in_flight < window; }),
          rpc::get_worker_info().name, " found no free slot by its deadline");
      ++state->in_flight;
    }
    const int64_t value = first_value + i;
    at::Tensor argument = at::full({4}, value, at::kLong);
    const int64_t sent = now_ns();
    sent_ns[i] = sent;
    // The lock is not held here: a call that completes at once runs its callback on this thread.
    rpc::rpc_async<at::Tensor>(server, "bench.plus_one", std::tuple{std::move(argument)},
                               kCallTimeout)
        .add_done_callback([state, i, value, sent](const rpc::RpcFuture<at::Tensor>& done) {
          state->latency_ns[i] = now_ns() - sent;
          try {
            if (!is_plus_one(done.wait(), value)) ++state->mismatches;
          } catch (const std::exception&) {
            ++state->failures;
          }
          {
            std::lock_guard<std::mutex> lock(state->mutex);
            --state->in_flight;
            ++state->completed;
          }
          state->changed.notify_one();
        });
  }
  std::unique_lock<std::mutex> lock(state->mutex);
  TORCH_CHECK(state->changed.wait_until(lock, deadline, [&] { return state->completed == calls; }),
              rpc::get_worker_info().name, " had ", calls - state->completed,
              " calls outstanding at its deadline");
  return {at::tensor(sent_ns, at::kLong), at::tensor(state->latency_ns, at::kLong),
          state->mismatches.load(), state->failures.load()};
}
DISTOPTIM_RPC_FUNCTION("bench.load", run_load);

// --- worker0: the measurements -------------------------------------------------------------------

// Nearest-rank percentile (pytorch_rpc.py computes it the same way).
double percentile(std::vector<double> values, double p) {
  TORCH_CHECK(!values.empty(), "percentile of nothing");
  std::sort(values.begin(), values.end());
  const auto rank = static_cast<size_t>(std::ceil(p / 100.0 * values.size()));
  return values[std::clamp<size_t>(rank, 1, values.size()) - 1];
}

double elapsed_us(Clock::time_point from) {
  return std::chrono::duration<double, std::micro>(Clock::now() - from).count();
}

void measure_latency(const Config& config, Json& result) {
  const at::Tensor tiny = at::ones({4});
  std::vector<double> times_us;
  int64_t wrong = 0;
  for (int i = 0; i < config.latency_warmup + config.latency_calls; ++i) {
    const auto begin = Clock::now();
    const auto back =
        rpc::rpc_sync<at::Tensor>("worker1", "bench.echo", std::tuple{tiny}, kCallTimeout);
    const double us = elapsed_us(begin);
    if (i >= config.latency_warmup) times_us.push_back(us);
    wrong += !back.equal(tiny);
  }
  result["latency_median_us"] = median(times_us);
  result["latency_p99_us"] = percentile(times_us, 99);
  result["latency_mismatches"] = wrong;
}

void measure_echo(const Config& config, Json& result) {
  const at::Tensor big = at::rand({kEchoFloats});
  double total_s = 0;
  int64_t wrong = 0;
  for (int i = 0; i < config.echo_warmup + config.echo_calls; ++i) {
    const auto begin = Clock::now();
    const auto back =
        rpc::rpc_sync<at::Tensor>("worker1", "bench.echo", std::tuple{big}, kCallTimeout);
    const double us = elapsed_us(begin);
    if (i >= config.echo_warmup) total_s += us * 1e-6;
    wrong += !back.equal(big);  // outside the timed part
  }
  result["echo_4mb_mb_per_s"] = 2.0 * kEchoBytes * config.echo_calls / total_s / 1e6;
  result["echo_mismatches"] = wrong;
}

void measure_sustained(const Config& config, Json& result) {
  const int64_t per_caller = config.sustained_calls / 2;
  const auto deadline_ms = static_cast<int64_t>(config.deadline_seconds) * 1000;
  const auto load_timeout = std::chrono::milliseconds(deadline_ms + 30000);
  g_expected_calls = config.sustained_calls;
  std::vector<rpc::RpcFuture<LoadResult>> loads;
  for (int caller = 1; caller <= 2; ++caller) {
    // Distinct values per caller, so a result routed to the wrong call would show.
    loads.push_back(rpc::rpc_async<LoadResult>(
        worker_name(caller), "bench.load",
        std::tuple{worker_name(0), per_caller, static_cast<int64_t>(config.window),
                   (caller - 1) * per_caller, static_cast<int64_t>(config.caller_warmup),
                   deadline_ms},
        load_timeout));
  }
  std::vector<std::pair<int64_t, int64_t>> calls;  // (sent ns, latency ns)
  int64_t mismatches = 0;
  int64_t failures = 0;
  for (const auto& load : loads) {
    const auto [sent, latency, wrong, failed] = load.wait();
    TORCH_CHECK(sent.numel() == per_caller && latency.numel() == per_caller, "a caller timed ",
                sent.numel(), " calls of ", per_caller);
    const at::Tensor sent_c = sent.contiguous();
    const at::Tensor latency_c = latency.contiguous();
    const int64_t* sent_ns = sent_c.data_ptr<int64_t>();
    const int64_t* latency_ns = latency_c.data_ptr<int64_t>();
    for (int64_t i = 0; i < per_caller; ++i) calls.emplace_back(sent_ns[i], latency_ns[i]);
    mismatches += wrong;
    failures += failed;
  }
  std::sort(calls.begin(), calls.end());
  const int64_t n = static_cast<int64_t>(calls.size());
  auto median_us = [&](int64_t from, int64_t to) {
    std::vector<double> us;
    for (int64_t i = from; i < to; ++i) us.push_back(calls[i].second * 1e-3);
    return median(std::move(us));
  };
  int64_t last_done_ns = 0;
  for (const auto& [sent, latency] : calls) last_done_ns = std::max(last_done_ns, sent + latency);
  const double span_s = (last_done_ns - calls.front().first) * 1e-9;
  const double first_us = median_us(0, kEdgeCalls);
  const double last_us = median_us(n - kEdgeCalls, n);
  result["sustained_calls"] = n;
  result["sustained_seconds"] = span_s;
  result["sustained_calls_per_s"] = n / span_s;
  result["sustained_first10k_median_us"] = first_us;
  result["sustained_last10k_median_us"] = last_us;
  result["sustained_latency_growth"] = last_us / first_us;
  result["sustained_server_rss_at_10k_mb"] = g_at_edge.rss_kb.load() * 1024 / 1e6;
  result["sustained_server_rss_end_mb"] = g_at_end.rss_kb.load() * 1024 / 1e6;
  result["sustained_server_rss_growth_mb"] =
      (g_at_end.rss_kb.load() - g_at_edge.rss_kb.load()) * 1024 / 1e6;
  result["sustained_server_heap_growth_mb"] =
      (g_at_end.heap_bytes.load() - g_at_edge.heap_bytes.load()) / 1e6;
  result["sustained_served"] = g_served.load();
  result["sustained_mismatches"] = mismatches;
  result["sustained_failures"] = failures;
}

// --- a worker of ours ----------------------------------------------------------------------------

void run_worker(const Config& config) {
  // The work is messaging, not compute: keep the 3 processes off each other's 2 cores.
  at::set_num_threads(1);
  const comm::LaunchEnv env = comm::LaunchEnv::from_environment();
  TORCH_CHECK(env.rank && env.world_size == kWorldSize,
              "--worker: start it with distrun --nproc-per-node ", kWorldSize);
  const int rank = *env.rank;
  const auto deadline = std::chrono::seconds(config.deadline_seconds);
  rpc::init_rpc(worker_name(rank), rank, kWorldSize,
                rpc::RpcBackendOptions("env://")
                    .num_worker_threads(config.threads)
                    .rpc_timeout(kCallTimeout)
                    .init_timeout(60s)
                    .shutdown_timeout(deadline)
                    .launch_env(env));
  if (rank == 0) {
    Json result;
    measure_latency(config, result);
    measure_echo(config, result);
    measure_sustained(config, result);
    fmt::print("{}{}\n", kResultPrefix, result.dump());
    std::fflush(stdout);
  }
  // worker1 and worker2 serve (and run their load) until worker0 gets here too.
  rpc::shutdown();
}

// --- the driver ----------------------------------------------------------------------------------

// Which way a row's ratio goes: it is > 1 where ours is better. kNone: a count, not compared.
enum class Better { kLower, kHigher, kNone };

// One row of the comparison: a key of both sides' RESULT.
struct Row {
  std::string key;
  std::string unit;
  Better better;
};

const std::vector<Row>& rows() {
  static const std::vector<Row> kRows{
      {"latency_median_us", "us", Better::kLower},
      {"latency_p99_us", "us", Better::kLower},
      {"echo_4mb_mb_per_s", "MB/s", Better::kHigher},
      {"sustained_calls", "calls", Better::kNone},
      {"sustained_calls_per_s", "calls/s", Better::kHigher},
      {"sustained_first10k_median_us", "us", Better::kLower},
      {"sustained_last10k_median_us", "us", Better::kLower},
      {"sustained_latency_growth", "x", Better::kLower},
      {"sustained_server_rss_growth_mb", "MB", Better::kLower},
      {"sustained_server_heap_growth_mb", "MB", Better::kLower},
  };
  return kRows;
}

std::optional<double> ratio(const Row& row, double ours, double pytorch) {
  if (row.better == Better::kNone || ours <= 0 || pytorch <= 0) return std::nullopt;
  return row.better == Better::kLower ? pytorch / ours : ours / pytorch;
}

// Runs `argv` under timeout(1) and returns worker0's RESULT (possibly behind distrun's prefix).
Json run_side(const std::string& what, std::vector<std::string> argv, const Config& config) {
  // timeout(1) runs the side in a process group of its own and signals the whole group, so
  // grandchildren (distrun's ranks, Python's spawned workers) go too; SIGKILL 10 s later.
  argv.insert(argv.begin(),
              {kTimeoutProgram, "--kill-after=10", std::to_string(config.deadline_seconds)});
  const ChildResult child = run_child(argv, "");
  TORCH_CHECK(child.exit_code != 124 && child.exit_code != 128 + 9, what,
              " did not finish within --deadline-seconds ", config.deadline_seconds,
              " s and was killed; its output:\n", child.stdout_text);
  TORCH_CHECK(child.exit_code == 0, what, " exited with ", child.exit_code, "; its output:\n",
              child.stdout_text);
  const std::vector<Json> results = result_lines(child.stdout_text);
  TORCH_CHECK(!results.empty(), what, " printed no RESULT line; its output:\n", child.stdout_text);
  return results.front();
}

std::vector<std::string> worker_args(const Config& config, int64_t sustained_calls) {
  return {"--threads",          std::to_string(config.threads),
          "--window",           std::to_string(config.window),
          "--sustained-calls",  std::to_string(sustained_calls),
          "--latency-calls",    std::to_string(config.latency_calls),
          "--echo-calls",       std::to_string(config.echo_calls),
          "--deadline-seconds", std::to_string(config.deadline_seconds)};
}

// The calls every side must have answered correctly; empty if all were.
std::vector<std::string> check_results(const std::string& side, const Json& result,
                                       int64_t sustained_calls) {
  std::vector<std::string> problems;
  for (const char* key :
       {"latency_mismatches", "echo_mismatches", "sustained_mismatches", "sustained_failures"}) {
    if (result.at(key).get<int64_t>() != 0) {
      problems.push_back(fmt::format("{}: {} = {}", side, key, result.at(key).get<int64_t>()));
    }
  }
  for (const char* key : {"sustained_calls", "sustained_served"}) {
    if (result.at(key).get<int64_t>() != sustained_calls) {
      problems.push_back(fmt::format("{}: {} = {}, expected {}", side, key,
                                     result.at(key).get<int64_t>(), sustained_calls));
    }
  }
  return problems;
}

// Whole numbers from 100 up, two decimals below.
std::string format_value(double value) {
  return std::abs(value) >= 100 ? fmt::format("{:.0f}", value) : fmt::format("{:.2f}", value);
}

void print_table(const Config& config, const Json& ours, const Json& pytorch) {
  fmt::print(
      "\nrpc_bench: distoptim::rpc vs PyTorch {} torch.distributed.rpc (TensorPipe), {} workers "
      "on loopback, {} RPC worker threads each\n",
      "1.13", kWorldSize, config.threads);
  fmt::print(
      "latency: rpc_sync worker0 -> worker1 echoing ones(4), {} calls after {} warm-up; echo: "
      "4 MiB float tensor, {} calls, MB/s counts both directions\n",
      config.latency_calls, config.latency_warmup, config.echo_calls);
  fmt::print(
      "sustained: rpc_async worker1 + worker2 -> worker0 (arg + 1, every result checked), window "
      "{} per caller; ours {} calls, pytorch {} calls{}\n",
      config.window, config.sustained_calls, config.pytorch_sustained_calls,
      config.pytorch_sustained_calls != config.sustained_calls
          ? " (PyTorch's count is lowered, --pytorch-sustained-calls, to fit the time budget: "
            "its last10k and growth cover a shorter run)"
          : "");
  fmt::print(
      "ratio > 1: ours better (pytorch/ours for times, x and MB; ours/pytorch for "
      "throughputs)\n\n");
  fmt::print("{:<32} {:>12} {:>12} {:>8} {:>8}\n", "case", "ours", "pytorch", "unit", "ratio");
  for (const Row& row : rows()) {
    const double o = ours.at(row.key).get<double>();
    const double p = pytorch.at(row.key).get<double>();
    const auto r = ratio(row, o, p);
    fmt::print("{:<32} {:>12} {:>12} {:>8} {:>8}\n", row.key, format_value(o), format_value(p),
               row.unit, r ? fmt::format("{:.2f}x", *r) : "");
  }
  fmt::print(
      "\nserver VmRSS after 10k calls -> end: ours {:.1f} -> {:.1f} MB, pytorch {:.1f} -> {:.1f} "
      "MB; sustained span: ours {:.1f} s, pytorch {:.1f} s\n\n",
      ours.at("sustained_server_rss_at_10k_mb").get<double>(),
      ours.at("sustained_server_rss_end_mb").get<double>(),
      pytorch.at("sustained_server_rss_at_10k_mb").get<double>(),
      pytorch.at("sustained_server_rss_end_mb").get<double>(),
      ours.at("sustained_seconds").get<double>(), pytorch.at("sustained_seconds").get<double>());
}

Json to_json(const Json& ours, const Json& pytorch) {
  Json out = Json::array();
  for (const Row& row : rows()) {
    const double o = ours.at(row.key).get<double>();
    const double p = pytorch.at(row.key).get<double>();
    const auto r = ratio(row, o, p);
    out.push_back({{"case", row.key},
                   {"ours", o},
                   {"pytorch", p},
                   {"unit", row.unit},
                   {"ratio", r ? Json(*r) : Json(nullptr)}});
  }
  return out;
}

int run(int argc, char** argv) {
  Config config;
  std::string json_path;
  bool worker = false;
  std::string python = DISTOPTIM_REFERENCE_PYTHON;
  std::string script = DISTOPTIM_PYTORCH_RPC_SCRIPT;
  CLI::App app{"RPC benchmark: distoptim::rpc against PyTorch's torch.distributed.rpc"};
  app.add_option("--json", json_path, "Write the results as JSON to this file");
  app.add_option("--threads", config.threads, "RPC worker threads per worker, both sides")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--window", config.window, "sustained load: calls in flight per caller")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--sustained-calls", config.sustained_calls,
                 "sustained load: calls in all (half per caller), ours")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2 * kEdgeCalls}, int64_t{10'000'000}));
  app.add_option("--pytorch-sustained-calls", config.pytorch_sustained_calls,
                 "sustained load: calls in all, PyTorch's side (lower it if PyTorch is too slow)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2 * kEdgeCalls}, int64_t{10'000'000}));
  app.add_option("--latency-calls", config.latency_calls, "timed rpc_sync calls of ones(4)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--echo-calls", config.echo_calls, "timed rpc_sync calls of 4 MiB")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--deadline-seconds", config.deadline_seconds,
                 "each side is killed after this long")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--python", python, "Python with PyTorch 1.13")->capture_default_str();
  app.add_option("--pytorch-script", script, "pytorch_rpc.py")->capture_default_str();
  app.add_flag("--worker", worker, "Run as one of our workers (started by the benchmark itself)");
  CLI11_PARSE(app, argc, argv);

  if (worker) {
    run_worker(config);
    return 0;
  }
  TORCH_CHECK_VALUE(config.sustained_calls % 2 == 0 && config.pytorch_sustained_calls % 2 == 0,
                    "--sustained-calls and --pytorch-sustained-calls must be even "
                    "(half per caller), got ",
                    config.sustained_calls, " and ", config.pytorch_sustained_calls);
  ResultsFile results_file(json_path, "rpc_bench");

  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::vector<std::string> ours_argv{DISTOPTIM_DISTRUN_PATH, "--nproc-per-node",
                                     std::to_string(kWorldSize), self, "--worker"};
  for (auto& arg : worker_args(config, config.sustained_calls)) ours_argv.push_back(arg);
  std::vector<std::string> pytorch_argv{python, script, "--world-size", std::to_string(kWorldSize)};
  for (auto& arg : worker_args(config, config.pytorch_sustained_calls)) {
    pytorch_argv.push_back(arg);
  }

  fmt::print(stderr, "rpc_bench: ours...");
  const auto ours_begin = Clock::now();
  const Json ours = run_side("our workers (distrun)", ours_argv, config);
  fmt::print(stderr, " {:.0f} s; pytorch...", elapsed_us(ours_begin) * 1e-6);
  const auto pytorch_begin = Clock::now();
  const Json pytorch = run_side(script, pytorch_argv, config);
  fmt::print(stderr, " {:.0f} s\n", elapsed_us(pytorch_begin) * 1e-6);

  print_table(config, ours, pytorch);
  std::vector<std::string> problems = check_results("ours", ours, config.sustained_calls);
  for (auto& p : check_results("pytorch", pytorch, config.pytorch_sustained_calls)) {
    problems.push_back(std::move(p));
  }
  if (!problems.empty()) {
    results_file.discard();
    for (const auto& p : problems) fmt::print(stderr, "rpc_bench: wrong or failed calls: {}\n", p);
    fmt::print(stderr, "rpc_bench: no results written\n");
    return 1;
  }
  results_file.write(to_json(ours, pytorch));
  fmt::print("results written to {}\n", json_path);
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace distoptim

int main(int argc, char** argv) {
  try {
    return distoptim::bench::run(argc, argv);
  } catch (const c10::Error& e) {
    fmt::print(stderr, "rpc_bench: {}\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "rpc_bench: {}\n", e.what());
    return 1;
  }
}
