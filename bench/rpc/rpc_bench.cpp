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
//   latency_context_switches_per_call: context switches (voluntary and involuntary, getrusage,
//     every thread) of worker0 and worker1 over the latency case's calls, warm-up included, per
//     call: how many times a thread went to sleep or was put aside per round trip.
//   chain4_median_us, chain4_p99_us: rpc_sync from worker0 to worker1 of a function that, with
//     `remaining` > 1, makes a blocking rpc_sync of itself to the other of worker1 and worker2
//     with remaining - 1 inside the request and returns its result: worker0 -> worker1 ->
//     worker2 -> worker1 -> worker2, 4 calls nested, the last returning the argument,
//     at::ones({4}); 500 timed calls after 50 warm-up ones.
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
//     sustained_cpu_s_per_1000_calls: CPU time (user + system, getrusage, every thread) of the
//     server from its first plus_one to its last plus each caller's from after its warm-up to
//     its last completion, per 1,000 calls.
// Each caller first makes 200 sequential warm-up calls so connection set-up is not timed.
// PyTorch's side is too slow for the time budget at 100,000 calls (about 75 s here), so it makes
// --pytorch-sustained-calls (default 40,000) while ours keeps 100,000; the table says so, and
// its last-10k median and growth then cover a shorter run than ours. A wrong result or a failed
// call makes the benchmark exit non-zero and write no JSON.
//
// Two more runs of each side, of 2 workers each, measure idle CPU: each worker runs init_rpc,
// makes one rpc_sync to the other (so connections are open, as PyTorch's init_rpc leaves them
// after its all-gather), then sleeps --idle-seconds (10) and calls shutdown. idle_cpu_s: CPU
// time (getrusage, every thread of the worker) used during the sleep, measured by each worker
// at its start and end, summed over both; idle_cpu_percent_per_worker: that sum over the summed
// sleep time, as a percentage of one core.
//
// The transport's floor (transport_floor.h), in the same run: two processes of ours (distrun,
// --floor-worker) ping-pong the latency case's 16 bytes and the echo's 4 MiB over a bare Asio
// TCP connection (a 24-byte header plus the payload), the same over a Unix-domain socket (our
// workers' transport on one host unless --tcp), and over a bare TensorPipe pipe (uv transport,
// basic channel), with the latency and echo cases' call counts.
//
// One core: ours (the latency case alone) and the floor again with every process of each pinned
// to one CPU (--one-core: the first of the process's allowed CPUs, before any thread starts).
// A thread woken there runs on a CPU already awake, as where wake-ups are cheap, so the round
// trip shows the work each side does per call rather than the cost of restarting an idle
// virtual CPU (tens of microseconds on some machines, which then dominates both). Not a
// comparison with PyTorch: its idle workers spin on a whole core each.
//
// Rounds: the main case's runs alternate, --rounds times (3): ours, PyTorch's, the floor, ours
// and the floor on one core, ours, ... so that what else the machine runs weighs on all alike. The
// table prints each side's min/median/max over the rounds and the ratio of the medians; the idle
// case runs once a side (it measures CPU at rest, not speed). The 1-minute load average before and
// after is printed.
//
// The JSON written to --json holds the load average (common/report.h) and, under "cases", a
// list of {case, ours, pytorch, unit, ratio, better, ours_min, ours_max, pytorch_min,
// pytorch_max}: ours and pytorch are the medians over the rounds. ratio is >1 where
// ours is better: pytorch/ours for times, growth factors, memory and CPU time, ours/pytorch for
// throughputs; null where a value is not positive (an RSS that did not grow) and for the row
// sustained_calls, which records how many calls each side made. better: "lower", "higher" or
// null. Rows about the floor are not a
// comparison with PyTorch, and have pytorch and ratio null: floor_<asio|asio_unix|tensorpipe>_*
// hold the bare transport's measurement in `ours` (it is neither side's RPC), and
// tiny_round_trip_over_<asio|asio_unix|tensorpipe>_floor hold in `ours` our latency_median_us
// divided by that floor's tiny median (the table also prints PyTorch's); the same on one core:
// one_core_latency_median_us, one_core_latency_p99_us, one_core_latency_context_switches_per_call,
// one_core_floor_<asio|asio_unix>_tiny_median_us, tiny_round_trip_one_core_over_<...>_floor.
//
// Settings: both sides run 16 RPC worker threads (--threads), 1 intra-op thread and a 30 s
// RPC timeout; ours at its defaults otherwise (workers on one host talk over Unix-domain
// sockets; --tcp makes ours use loopback TCP), PyTorch at its defaults otherwise (TensorPipe
// chooses its transports and channels). The table states them.
//
// Every wait is bounded: RPCs carry timeouts, and each side runs under timeout(1), which kills
// its whole process group (distrun's ranks, Python's spawned workers) past --deadline-seconds.
// SIGINT or SIGTERM to rpc_bench is forwarded to the running side's process group
// (run_child), so Ctrl-C stops the children too.
//
// Usage: rpc_bench --json PATH [--rounds N] [--sustained-calls N] [--pytorch-sustained-calls N]
//                  [--window N] [--threads N] [--chain-calls N] [--idle-seconds N]
//                  [--deadline-seconds N]

#include <malloc.h>
#include <sched.h>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
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
#include "transport_floor.h"

namespace distoptim {
namespace bench {
namespace {

namespace rpc = distoptim::rpc;
using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr int kWorldSize = 3;
// The idle case's workers, and the floor's two ends.
constexpr int kPairSize = 2;
// Calls nested in one call of the chain case.
constexpr int64_t kChainDepth = 4;
constexpr int64_t kEchoFloats = 1 << 20;
constexpr int64_t kEchoBytes = kEchoFloats * static_cast<int64_t>(sizeof(float));
// The first and last calls of the sustained load whose median latencies are compared.
constexpr int64_t kEdgeCalls = 10000;
constexpr auto kCallTimeout = 30s;

struct Config {
  int threads = 16;
  int latency_warmup = 200;
  int latency_calls = 2000;
  int echo_warmup = 20;
  int echo_calls = 200;
  int chain_warmup = 50;
  int chain_calls = 500;
  int idle_seconds = 10;
  int64_t sustained_calls = 100000;
  // PyTorch needs about 75 s for 100,000 calls on this 2-core machine (0.75 s per 1,000), over
  // the time budget, so its side makes fewer by default; the table and JSON show both counts.
  int64_t pytorch_sustained_calls = 40000;
  int window = 32;
  // Our workers on one host talk over loopback TCP instead of Unix-domain sockets.
  bool tcp = false;
  // A worker or floor process pins itself to one CPU; a worker measures the latency case alone.
  bool one_core = false;
  int caller_warmup = 200;
  int deadline_seconds = 240;
  // Rounds of ours, PyTorch's and the floor's runs, alternating.
  int rounds = 3;
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

// Calls of bench.plus_one served by this process, and its VmRSS, heap in use and CPU time when
// the count reached 1, kEdgeCalls and g_expected_calls, the last call of the load. They are
// taken inside the server function, so the growth leaves out the timings the callers send back
// at the end (several MB at 100,000 calls).
struct ServerMark {
  std::atomic<long> rss_kb{-1};
  std::atomic<int64_t> heap_bytes{-1};
  std::atomic<double> cpu_s{-1};
  void take() {
    rss_kb = proc_status_kb("VmRSS");
    heap_bytes = heap_in_use_bytes();
    cpu_s = process_cpu_seconds();
  }
};
std::atomic<int64_t> g_served{0};
std::atomic<int64_t> g_expected_calls{-1};
ServerMark g_at_first;
ServerMark g_at_edge;
ServerMark g_at_end;

at::Tensor echo(const at::Tensor& tensor) { return tensor; }
DISTOPTIM_RPC_FUNCTION("bench.echo", echo);

int64_t context_switches() { return process_context_switches(); }
DISTOPTIM_RPC_FUNCTION("bench.context_switches", context_switches);

at::Tensor plus_one(const at::Tensor& tensor) {
  const int64_t served = g_served.fetch_add(1) + 1;
  if (served == 1) g_at_first.take();
  if (served == kEdgeCalls) g_at_edge.take();
  if (served == g_expected_calls.load()) g_at_end.take();
  return tensor + 1;
}
DISTOPTIM_RPC_FUNCTION("bench.plus_one", plus_one);

// The chain case: worker1 and worker2 call each other until `remaining` reaches 1.
at::Tensor chain(int64_t remaining, const at::Tensor& tensor) {
  if (remaining <= 1) return tensor;
  const std::string other = rpc::get_worker_info().name == "worker1" ? "worker2" : "worker1";
  return rpc::rpc_sync<at::Tensor>(other, "bench.chain", std::tuple{remaining - 1, tensor},
                                   kCallTimeout);
}
DISTOPTIM_RPC_FUNCTION("bench.chain", chain);

bool is_plus_one(const at::Tensor& result, int64_t value) {
  if (result.scalar_type() != at::kLong || result.dim() != 1 || result.size(0) != 4) return false;
  const at::Tensor contiguous = result.contiguous();
  const int64_t* data = contiguous.data_ptr<int64_t>();
  return std::all_of(data, data + 4, [&](int64_t x) { return x == value + 1; });
}

// One caller's share of the sustained load, per call in its send order: send time and latency
// (ns), then the counts of wrong results and of failed calls, and the CPU time the caller used
// from after its warm-up to its last completion.
using LoadResult = std::tuple<at::Tensor, at::Tensor, int64_t, int64_t, double>;

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
  const double cpu_begin = process_cpu_seconds();
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
  const double cpu_s = process_cpu_seconds() - cpu_begin;
  return {at::tensor(sent_ns, at::kLong), at::tensor(state->latency_ns, at::kLong),
          state->mismatches.load(), state->failures.load(), cpu_s};
}
DISTOPTIM_RPC_FUNCTION("bench.load", run_load);

// --- worker0: the measurements -------------------------------------------------------------------

double elapsed_us(Clock::time_point from) {
  return std::chrono::duration<double, std::micro>(Clock::now() - from).count();
}

// Times `warmup` + `calls` round trips of at::ones({4}), `call` making one and returning what came
// back, and writes <key>_median_us, <key>_p99_us and <key>_mismatches.
template <typename Call>
void measure_round_trips(const std::string& key, int warmup, int calls, const Call& call,
                         Json& result) {
  const at::Tensor tiny = at::ones({4});
  std::vector<double> times_us;
  int64_t wrong = 0;
  for (int i = 0; i < warmup + calls; ++i) {
    const auto begin = Clock::now();
    const at::Tensor back = call(tiny);
    const double us = elapsed_us(begin);
    if (i >= warmup) times_us.push_back(us);
    wrong += !back.equal(tiny);
  }
  result[key + "_median_us"] = median(times_us);
  result[key + "_p99_us"] = percentile(times_us, 99);
  result[key + "_mismatches"] = wrong;
}

// Context switches of worker0 and worker1 so far.
int64_t pair_context_switches() {
  return process_context_switches() +
         rpc::rpc_sync<int64_t>("worker1", "bench.context_switches", std::tuple<>{}, kCallTimeout);
}

void measure_latency(const Config& config, Json& result) {
  const int64_t switches_before = pair_context_switches();
  measure_round_trips(
      "latency", config.latency_warmup, config.latency_calls,
      [](const at::Tensor& tiny) {
        return rpc::rpc_sync<at::Tensor>("worker1", "bench.echo", std::tuple{tiny}, kCallTimeout);
      },
      result);
  result["latency_context_switches_per_call"] =
      static_cast<double>(pair_context_switches() - switches_before) /
      (config.latency_warmup + config.latency_calls);
}

void measure_chain(const Config& config, Json& result) {
  measure_round_trips(
      "chain4", config.chain_warmup, config.chain_calls,
      [](const at::Tensor& tiny) {
        return rpc::rpc_sync<at::Tensor>("worker1", "bench.chain", std::tuple{kChainDepth, tiny},
                                         kCallTimeout);
      },
      result);
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
  double callers_cpu_s = 0;
  for (const auto& load : loads) {
    const auto [sent, latency, wrong, failed, cpu_s] = load.wait();
    TORCH_CHECK(sent.numel() == per_caller && latency.numel() == per_caller, "a caller timed ",
                sent.numel(), " calls of ", per_caller);
    const at::Tensor sent_c = sent.contiguous();
    const at::Tensor latency_c = latency.contiguous();
    const int64_t* sent_ns = sent_c.data_ptr<int64_t>();
    const int64_t* latency_ns = latency_c.data_ptr<int64_t>();
    for (int64_t i = 0; i < per_caller; ++i) calls.emplace_back(sent_ns[i], latency_ns[i]);
    mismatches += wrong;
    failures += failed;
    callers_cpu_s += cpu_s;
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
  result["sustained_cpu_s_per_1000_calls"] =
      (g_at_end.cpu_s.load() - g_at_first.cpu_s.load() + callers_cpu_s) / (n / 1000.0);
  result["sustained_served"] = g_served.load();
  result["sustained_mismatches"] = mismatches;
  result["sustained_failures"] = failures;
}

// --- a worker of ours ----------------------------------------------------------------------------

// This process's rank in a job of `world_size` started by distrun (`flag` names the mode).
comm::LaunchEnv launch_env(int world_size, const char* flag) {
  comm::LaunchEnv env = comm::LaunchEnv::from_environment();
  TORCH_CHECK(env.rank && env.world_size == world_size, flag,
              ": start it with distrun --nproc-per-node ", world_size);
  return env;
}

// Pins this process to the first CPU it may run on, so that every process doing the same shares
// it. Before the process starts any thread: threads inherit the mask.
void pin_to_one_core() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  TORCH_CHECK(::sched_getaffinity(0, sizeof(allowed), &allowed) == 0,
              "--one-core: sched_getaffinity failed: ", std::strerror(errno));
  int first = 0;
  while (first < CPU_SETSIZE && !CPU_ISSET(first, &allowed)) ++first;
  TORCH_CHECK(first < CPU_SETSIZE, "--one-core: this process may run on no CPU");
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  TORCH_CHECK(::sched_setaffinity(0, sizeof(one), &one) == 0, "--one-core: sched_setaffinity(",
              first, ") failed: ", std::strerror(errno));
}

void init_worker(const Config& config, const comm::LaunchEnv& env) {
  // The work is messaging, not compute: keep the processes off each other's 2 cores.
  at::set_num_threads(1);
  rpc::init_rpc(worker_name(*env.rank), *env.rank, *env.world_size,
                rpc::RpcBackendOptions("env://")
                    .num_worker_threads(config.threads)
                    .rpc_timeout(kCallTimeout)
                    .init_timeout(60s)
                    .shutdown_timeout(std::chrono::seconds(config.deadline_seconds))
                    .same_host_unix_sockets(!config.tcp)
                    .launch_env(env));
}

void run_worker(const Config& config) {
  const comm::LaunchEnv env = launch_env(kWorldSize, "--worker");
  if (config.one_core) pin_to_one_core();
  init_worker(config, env);
  if (*env.rank == 0) {
    Json result;
    measure_latency(config, result);
    if (!config.one_core) {
      measure_chain(config, result);
      measure_echo(config, result);
      measure_sustained(config, result);
    }
    print_result(result);
  }
  // worker1 and worker2 serve (and run their load) until worker0 gets here too.
  rpc::shutdown();
}

// The idle case: each of the 2 workers prints its own RESULT.
void run_idle_worker(const Config& config) {
  const comm::LaunchEnv env = launch_env(kPairSize, "--idle-worker");
  init_worker(config, env);
  const at::Tensor tiny = at::ones({4});
  rpc::rpc_sync<at::Tensor>(worker_name(1 - *env.rank), "bench.echo", std::tuple{tiny},
                            kCallTimeout);
  const double cpu_begin = process_cpu_seconds();
  const auto begin = Clock::now();
  std::this_thread::sleep_for(std::chrono::seconds(config.idle_seconds));
  const double cpu_s = process_cpu_seconds() - cpu_begin;
  print_result({{"idle_cpu_s", cpu_s}, {"idle_wall_s", elapsed_us(begin) * 1e-6}});
  rpc::shutdown();
}

// The transport's floor: rank 1 echoes, rank 0 measures and prints the RESULT.
void run_floor_worker(const Config& config) {
  const comm::LaunchEnv env = launch_env(kPairSize, "--floor-worker");
  if (config.one_core) pin_to_one_core();
  const comm::Rendezvous meeting = comm::rendezvous(
      comm::RendezvousOptions("env://").launch_env(env).timeout(60s).prefix("rpc_bench/floor"));
  FloorConfig floor;
  floor.tiny_warmup = config.latency_warmup;
  floor.tiny_calls = config.latency_calls;
  floor.echo_warmup = config.echo_warmup;
  floor.echo_calls = config.echo_calls;
  floor.tiny_bytes = 4 * static_cast<int64_t>(sizeof(float));
  floor.echo_bytes = kEchoBytes;
  floor.timeout = std::chrono::duration_cast<std::chrono::seconds>(kCallTimeout);
  const Json result = run_transport_floor(floor, *meeting.store, meeting.rank);
  if (meeting.rank == 0) print_result(result);
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
      {"latency_context_switches_per_call", "switches", Better::kLower},
      {"chain4_median_us", "us", Better::kLower},
      {"chain4_p99_us", "us", Better::kLower},
      {"echo_4mb_mb_per_s", "MB/s", Better::kHigher},
      {"sustained_calls", "calls", Better::kNone},
      {"sustained_calls_per_s", "calls/s", Better::kHigher},
      {"sustained_first10k_median_us", "us", Better::kLower},
      {"sustained_last10k_median_us", "us", Better::kLower},
      {"sustained_latency_growth", "x", Better::kLower},
      {"sustained_server_rss_growth_mb", "MB", Better::kLower},
      {"sustained_server_heap_growth_mb", "MB", Better::kLower},
      {"sustained_cpu_s_per_1000_calls", "CPU-s", Better::kLower},
      {"idle_cpu_s", "CPU-s", Better::kLower},
      {"idle_cpu_percent_per_worker", "% core", Better::kLower},
  };
  return kRows;
}

// The floor's transports, as named in its RESULT keys, and how the table names them.
const std::vector<std::pair<std::string, std::string>>& floors() {
  static const std::vector<std::pair<std::string, std::string>> kFloors{
      {"asio", "Asio TCP, 24-byte header + payload"},
      {"asio_unix", "Asio Unix socket, same messages"},
      {"tensorpipe", "TensorPipe pipe, uv + basic"},
  };
  return kFloors;
}

// The floors compared on one core (TensorPipe's is measured there too, but not compared).
const std::vector<std::string>& one_core_floors() {
  static const std::vector<std::string> kOneCore{"asio", "asio_unix"};
  return kOneCore;
}
const std::vector<std::string>& one_core_keys() {
  static const std::vector<std::string> kKeys{"latency_median_us", "latency_p99_us",
                                              "latency_context_switches_per_call"};
  return kKeys;
}

std::optional<double> ratio(const Row& row, double ours, double pytorch) {
  if (row.better == Better::kNone || ours <= 0 || pytorch <= 0) return std::nullopt;
  return row.better == Better::kLower ? pytorch / ours : ours / pytorch;
}

// The idle case's keys from its 2 workers' RESULTs.
Json idle_result(const std::string& what, const std::vector<Json>& workers) {
  TORCH_CHECK(workers.size() == kPairSize, what, " printed ", workers.size(),
              " idle RESULT lines, expected ", kPairSize);
  double cpu_s = 0;
  double wall_s = 0;
  for (const Json& worker : workers) {
    cpu_s += worker.at("idle_cpu_s").get<double>();
    wall_s += worker.at("idle_wall_s").get<double>();
  }
  return {{"idle_cpu_s", cpu_s}, {"idle_cpu_percent_per_worker", 100.0 * cpu_s / wall_s}};
}

std::vector<std::string> worker_args(const Config& config, int64_t sustained_calls) {
  return {"--threads",          std::to_string(config.threads),
          "--window",           std::to_string(config.window),
          "--sustained-calls",  std::to_string(sustained_calls),
          "--latency-calls",    std::to_string(config.latency_calls),
          "--echo-calls",       std::to_string(config.echo_calls),
          "--chain-calls",      std::to_string(config.chain_calls),
          "--idle-seconds",     std::to_string(config.idle_seconds),
          "--deadline-seconds", std::to_string(config.deadline_seconds)};
}

// The calls every side must have answered correctly; empty if all were.
std::vector<std::string> check_results(const std::string& side, const Json& result,
                                       int64_t sustained_calls) {
  std::vector<std::string> problems;
  for (const char* key : {"latency_mismatches", "chain4_mismatches", "echo_mismatches",
                          "sustained_mismatches", "sustained_failures"}) {
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

// Whole numbers from 100 up, two decimals below, three significant digits below 0.1 (idle CPU).
std::string format_value(double value) {
  if (std::abs(value) >= 100) return fmt::format("{:.0f}", value);
  if (value != 0 && std::abs(value) < 0.1) return fmt::format("{:.3g}", value);
  return fmt::format("{:.2f}", value);
}

// One side's runs over the rounds: each numeric key's min/median/max. `values` holds the
// medians, what the ratios compare.
struct Side {
  Json values = Json::object();
  std::map<std::string, Spread> spread;

  void add(const std::string& key, const std::vector<double>& runs) {
    spread[key] = spread_of(runs);
    values[key] = spread[key].median;
  }
  // Keys measured once (the idle case).
  void add_once(const Json& result) {
    for (const auto& [key, value] : result.items()) add(key, {value.get<double>()});
  }
};

Side over_rounds(const std::vector<Json>& runs) {
  Side side;
  for (const auto& [key, value] : runs.front().items()) {
    if (!value.is_number()) continue;
    std::vector<double> values;
    for (const Json& run : runs) values.push_back(run.at(key).get<double>());
    side.add(key, values);
  }
  return side;
}

std::string spread_text(const Spread& spread) {
  return fmt::format("{}/{}/{}", format_value(spread.min), format_value(spread.median),
                     format_value(spread.max));
}

// Our tiny round trip's median over a floor's (medians over the rounds).
double over_floor(const Json& side, const Json& floor, const std::string& name) {
  return side.at("latency_median_us").get<double>() /
         floor.at("floor_" + name + "_tiny_median_us").get<double>();
}

void print_table(const Config& config, const Side& ours_side, const Side& pytorch_side,
                 const Json& floor, const Side& one_core, const Side& one_core_floor,
                 std::pair<double, double> load) {
  const Json& ours = ours_side.values;
  const Json& pytorch = pytorch_side.values;
  fmt::print(
      "\nrpc_bench: distoptim::rpc vs PyTorch {} torch.distributed.rpc (TensorPipe), {} workers "
      "on loopback (the idle case: 2)\n",
      "1.13", kWorldSize);
  fmt::print(
      "settings, both sides: {} RPC worker threads (PyTorch: TensorPipeRpcBackendOptions("
      "num_worker_threads={}, rpc_timeout=30, init_method='env://')), 1 intra-op thread "
      "(at::set_num_threads / torch.set_num_threads(1)), RPC timeout 30 s; other settings are "
      "each side's defaults (ours: {}; PyTorch's TensorPipe chooses its transports)\n",
      config.threads, config.threads,
      config.tcp ? "loopback TCP between the workers (--tcp)"
                 : "Unix-domain sockets between the workers, all on this host");
  fmt::print(
      "latency: rpc_sync worker0 -> worker1 echoing ones(4), {} calls after {} warm-up; chain4: "
      "worker0 -> worker1 -> worker2 -> worker1 -> worker2, each a blocking rpc_sync inside the "
      "request, returning ones(4), {} calls after {} warm-up; echo: 4 MiB float tensor, {} "
      "calls, MB/s counts both directions\n",
      config.latency_calls, config.latency_warmup, config.chain_calls, config.chain_warmup,
      config.echo_calls);
  fmt::print(
      "sustained: rpc_async worker1 + worker2 -> worker0 (arg + 1, every result checked), window "
      "{} per caller; ours {} calls, pytorch {} calls{}\n",
      config.window, config.sustained_calls, config.pytorch_sustained_calls,
      config.pytorch_sustained_calls != config.sustained_calls
          ? " (PyTorch's count is lowered, --pytorch-sustained-calls, to fit the time budget: "
            "its last10k and growth cover a shorter run)"
          : "");
  fmt::print(
      "cpu per 1000 calls: server + both callers over the load; idle: 2 workers, init_rpc, one "
      "call each way, then CPU time over a {} s sleep, summed over both\n",
      config.idle_seconds);
  fmt::print(
      "{} rounds alternating ours, PyTorch's, the floor, and ours and the floor on one core (the "
      "idle case once a side); "
      "min/median/max over the rounds; ratio > 1: ours better, of the medians (pytorch/ours for "
      "times, x, MB and CPU; ours/pytorch for throughputs)\n",
      config.rounds);
  fmt::print("machine: {} cores, 1-minute load average {:.2f} before and {:.2f} after{}\n\n",
             std::thread::hardware_concurrency(), load.first, load.second,
             std::max(load.first, load.second) > std::thread::hardware_concurrency()
                 ? " (ABOVE the core count: others' work competed with these measurements)"
                 : "");
  fmt::print("{:<32} {:>26} {:>26} {:>8} {:>8}\n", "case", "ours min/med/max",
             "pytorch min/med/max", "unit", "ratio");
  for (const Row& row : rows()) {
    const double o = ours.at(row.key).get<double>();
    const double p = pytorch.at(row.key).get<double>();
    const auto r = ratio(row, o, p);
    fmt::print("{:<32} {:>26} {:>26} {:>8} {:>8}\n", row.key,
               spread_text(ours_side.spread.at(row.key)),
               spread_text(pytorch_side.spread.at(row.key)), row.unit,
               r ? fmt::format("{:.2f}x", *r) : "");
  }
  fmt::print(
      "\nserver VmRSS after 10k calls -> end: ours {:.1f} -> {:.1f} MB, pytorch {:.1f} -> {:.1f} "
      "MB; sustained span: ours {:.1f} s, pytorch {:.1f} s\n\n",
      ours.at("sustained_server_rss_at_10k_mb").get<double>(),
      ours.at("sustained_server_rss_end_mb").get<double>(),
      pytorch.at("sustained_server_rss_at_10k_mb").get<double>(),
      pytorch.at("sustained_server_rss_end_mb").get<double>(),
      ours.at("sustained_seconds").get<double>(), pytorch.at("sustained_seconds").get<double>());
  fmt::print(
      "transport floor: a bare ping-pong between 2 processes with the same payloads and call "
      "counts (not an RPC)\n");
  fmt::print("{:<40} {:>12} {:>12} {:>12} {:>16} {:>16}\n", "floor", "median us", "p99 us",
             "MB/s (4 MiB)", "ours / floor", "pytorch / floor");
  for (const auto& [name, description] : floors()) {
    fmt::print("{:<40} {:>12} {:>12} {:>12} {:>15.2f}x {:>15.2f}x\n", description,
               format_value(floor.at("floor_" + name + "_tiny_median_us").get<double>()),
               format_value(floor.at("floor_" + name + "_tiny_p99_us").get<double>()),
               format_value(floor.at("floor_" + name + "_echo_4mb_mb_per_s").get<double>()),
               over_floor(ours, floor, name), over_floor(pytorch, floor, name));
  }
  fmt::print(
      "(the last two columns: the tiny round trip's median, latency_median_us, over the "
      "floor's)\n\n");
  fmt::print(
      "one core: our workers (the latency case alone) and the floor again, every process of each "
      "pinned to one CPU (--one-core), so that no wake-up restarts an idle CPU; not a comparison "
      "with PyTorch\n");
  fmt::print("{:<40} {:>26} {:>8}\n", "case", "min/med/max", "unit");
  for (const std::string& key : one_core_keys()) {
    fmt::print("{:<40} {:>26} {:>8}\n", "ours " + key, spread_text(one_core.spread.at(key)),
               key == "latency_context_switches_per_call" ? "switches" : "us");
  }
  for (const std::string& name : one_core_floors()) {
    const std::string key = "floor_" + name + "_tiny_median_us";
    fmt::print("{:<40} {:>26} {:>8}   ours / floor {:.2f}x\n", "floor " + name + " tiny median",
               spread_text(one_core_floor.spread.at(key)), "us",
               over_floor(one_core.values, one_core_floor.values, name));
  }
  fmt::print("\n");
}

Json to_json(const Side& ours_side, const Side& pytorch_side, const Json& floor,
             const Side& one_core, const Side& one_core_floor) {
  const Json& ours = ours_side.values;
  Json out = Json::array();
  for (const Row& row : rows()) {
    const Spread& o = ours_side.spread.at(row.key);
    const Spread& p = pytorch_side.spread.at(row.key);
    const auto r = ratio(row, o.median, p.median);
    const Json better = row.better == Better::kLower    ? Json("lower")
                        : row.better == Better::kHigher ? Json("higher")
                                                        : Json(nullptr);
    out.push_back({{"case", row.key},
                   {"ours", o.median},
                   {"pytorch", p.median},
                   {"unit", row.unit},
                   {"ratio", r ? Json(*r) : Json(nullptr)},
                   {"better", better},
                   {"ours_min", o.min},
                   {"ours_max", o.max},
                   {"pytorch_min", p.min},
                   {"pytorch_max", p.max}});
  }
  // Not comparisons with PyTorch: see the file comment.
  auto floor_row = [&](const std::string& key, double value, const char* unit) {
    out.push_back(
        {{"case", key}, {"ours", value}, {"pytorch", nullptr}, {"unit", unit}, {"ratio", nullptr}});
  };
  for (const auto& [name, description] : floors()) {
    const std::string prefix = "floor_" + name + "_";
    for (const auto& [key, unit] :
         {std::pair{"tiny_median_us", "us"}, std::pair{"tiny_p99_us", "us"},
          std::pair{"echo_4mb_mb_per_s", "MB/s"}}) {
      floor_row(prefix + key, floor.at(prefix + key).get<double>(), unit);
    }
  }
  for (const auto& [name, description] : floors()) {
    floor_row("tiny_round_trip_over_" + name + "_floor", over_floor(ours, floor, name), "x");
  }
  for (const std::string& key : one_core_keys()) {
    floor_row("one_core_" + key, one_core.values.at(key).get<double>(),
              key == "latency_context_switches_per_call" ? "switches" : "us");
  }
  for (const std::string& name : one_core_floors()) {
    const std::string key = "floor_" + name + "_tiny_median_us";
    floor_row("one_core_" + key, one_core_floor.values.at(key).get<double>(), "us");
    floor_row("tiny_round_trip_one_core_over_" + name + "_floor",
              over_floor(one_core.values, one_core_floor.values, name), "x");
  }
  return out;
}

int run(int argc, char** argv) {
  Config config;
  std::string json_path;
  bool worker = false;
  bool idle_worker = false;
  bool floor_worker = false;
  std::string python = DISTOPTIM_REFERENCE_PYTHON;
  std::string script = DISTOPTIM_PYTORCH_RPC_SCRIPT;
  CLI::App app{"RPC benchmark: distoptim::rpc against PyTorch's torch.distributed.rpc"};
  app.add_option("--json", json_path, "Write the results as JSON to this file");
  app.add_option("--threads", config.threads, "RPC worker threads per worker, both sides")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--rounds", config.rounds, "rounds of ours, PyTorch's and the floor's runs")
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
  app.add_option("--chain-calls", config.chain_calls, "timed rpc_sync calls of the depth-4 chain")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--idle-seconds", config.idle_seconds, "the idle case's sleep")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--deadline-seconds", config.deadline_seconds,
                 "each side is killed after this long")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--python", python, "Python with PyTorch 1.13")->capture_default_str();
  app.add_option("--pytorch-script", script, "pytorch_rpc.py")->capture_default_str();
  app.add_flag("--tcp", config.tcp, "Our workers talk over loopback TCP, not Unix-domain sockets");
  app.add_flag("--one-core", config.one_core,
               "With --worker or --floor-worker: pin the process to one CPU (a worker then "
               "measures the latency case alone)");
  app.add_flag("--worker", worker, "Run as one of our workers (started by the benchmark itself)");
  app.add_flag("--idle-worker", idle_worker, "Run as one of our idle case's workers (ditto)");
  app.add_flag("--floor-worker", floor_worker, "Run as one end of the transport floor (ditto)");
  CLI11_PARSE(app, argc, argv);

  if (worker) {
    run_worker(config);
    return 0;
  }
  if (idle_worker) {
    run_idle_worker(config);
    return 0;
  }
  if (floor_worker) {
    run_floor_worker(config);
    return 0;
  }
  TORCH_CHECK_VALUE(config.sustained_calls % 2 == 0 && config.pytorch_sustained_calls % 2 == 0,
                    "--sustained-calls and --pytorch-sustained-calls must be even "
                    "(half per caller), got ",
                    config.sustained_calls, " and ", config.pytorch_sustained_calls);
  ResultsFile results_file(json_path, "rpc_bench");

  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  auto ours_argv = [&](int processes, const char* mode) {
    std::vector<std::string> argv{DISTOPTIM_DISTRUN_PATH, "--nproc-per-node",
                                  std::to_string(processes), self, mode};
    for (auto& arg : worker_args(config, config.sustained_calls)) argv.push_back(arg);
    if (config.tcp) argv.push_back("--tcp");
    return argv;
  };
  auto pytorch_argv = [&](const char* test_case, int world_size) {
    std::vector<std::string> argv{python,    script,         "--case",
                                  test_case, "--world-size", std::to_string(world_size)};
    for (auto& arg : worker_args(config, config.pytorch_sustained_calls)) argv.push_back(arg);
    return argv;
  };
  // Runs one side and says how long it took.
  auto timed = [&](const std::string& label, const std::string& what,
                   const std::vector<std::string>& argv) {
    fmt::print(stderr, "rpc_bench: {}...", label);
    const auto begin = Clock::now();
    std::vector<Json> results = run_side(what, argv, config.deadline_seconds);
    fmt::print(stderr, " {:.0f} s\n", elapsed_us(begin) * 1e-6);
    return results;
  };

  const double load_before = load_average();
  std::vector<Json> ours_runs, pytorch_runs, floor_runs, one_core_runs, one_core_floor_runs;
  auto one_core_argv = [&](int processes, const char* mode) {
    std::vector<std::string> argv = ours_argv(processes, mode);
    argv.push_back("--one-core");
    return argv;
  };
  for (int round = 1; round <= config.rounds; ++round) {
    const std::string of = fmt::format("round {}/{}: ", round, config.rounds);
    ours_runs.push_back(
        timed(of + "ours", "our workers (distrun)", ours_argv(kWorldSize, "--worker")).front());
    pytorch_runs.push_back(timed(of + "pytorch", script, pytorch_argv("main", kWorldSize)).front());
    floor_runs.push_back(
        timed(of + "transport floor", "the floor (distrun)", ours_argv(kPairSize, "--floor-worker"))
            .front());
    one_core_runs.push_back(timed(of + "ours on one core", "our workers on one core (distrun)",
                                  one_core_argv(kWorldSize, "--worker"))
                                .front());
    one_core_floor_runs.push_back(timed(of + "transport floor on one core",
                                        "the floor on one core (distrun)",
                                        one_core_argv(kPairSize, "--floor-worker"))
                                      .front());
  }
  const Side one_core = over_rounds(one_core_runs);
  const Side one_core_floor = over_rounds(one_core_floor_runs);
  Side ours = over_rounds(ours_runs);
  Side pytorch = over_rounds(pytorch_runs);
  const Json floor = over_rounds(floor_runs).values;
  ours.add_once(idle_result("our idle workers", timed("ours idle", "our idle workers (distrun)",
                                                      ours_argv(kPairSize, "--idle-worker"))));
  pytorch.add_once(
      idle_result(script, timed("pytorch idle", script, pytorch_argv("idle", kPairSize))));
  const double load_after = load_average();

  print_table(config, ours, pytorch, floor, one_core, one_core_floor, {load_before, load_after});
  std::vector<std::string> problems;
  for (int round = 0; round < config.rounds; ++round) {
    for (auto& p : check_results("ours", ours_runs[round], config.sustained_calls)) {
      problems.push_back(std::move(p));
    }
    for (auto& p : check_results("pytorch", pytorch_runs[round], config.pytorch_sustained_calls)) {
      problems.push_back(std::move(p));
    }
    for (const auto& [name, description] : floors()) {
      const std::string key = "floor_" + name + "_mismatches";
      const int64_t wrong = floor_runs[round].at(key).get<int64_t>();
      const int64_t wrong_one_core = one_core_floor_runs[round].at(key).get<int64_t>();
      if (wrong != 0 || wrong_one_core != 0) {
        problems.push_back(fmt::format("floor: {} and {} on one core: replies of {} differ", wrong,
                                       wrong_one_core, description));
      }
    }
    if (const int64_t wrong = one_core_runs[round].at("latency_mismatches").get<int64_t>()) {
      problems.push_back(fmt::format("ours on one core: latency_mismatches = {}", wrong));
    }
  }
  for (auto& p : problems) p = "wrong or failed calls: " + p;
  return results_file.write_unless(to_json(ours, pytorch, floor, one_core, one_core_floor),
                                   problems);
}

}  // namespace
}  // namespace bench
}  // namespace distoptim

int main(int argc, char** argv) {
  return distoptim::bench::run_main("rpc_bench", distoptim::bench::run, argc, argv);
}
