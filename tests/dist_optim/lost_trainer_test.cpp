// A parameter server that outlives its trainers: one trainer of three is SIGKILLed at a chosen
// point of an iteration (its forward call, its backward pass or its optimizer step in flight on
// the server, with its requests queued behind others there, or between two iterations). The
// other two train on through the death and finish without an error; the server holds none of
// the dead trainer's distributed autograd contexts or RRefs afterwards, ran none of its queued
// requests, is back within a bound of the memory it had before, and holds the dead trainer's
// parameters exactly as a one-process replay of the steps the trainer's DistributedOptimizer
// applied: all at the state before the step in flight or all after it, and every step that
// returned applied once. Every wait is bounded.
//
// Ranks: 0 is the parameter server, 1 and 2 the trainers that live, 3 the one that dies. Each
// trainer's model (w: 1024 x 4, b: 4) lives on the server; the dying trainer's batches are 16 MB,
// so that anything of it the server kept would show in its resident memory. In a static group a
// worker that died cannot come back: kill_restart_loop_test.cpp kills a trainer 50 times in a
// dynamic group, starting it again under a new name each time.

#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/optim/registry.h>
#include <distoptim/optim/sgd.h>
#include <distoptim/rpc.h>

#include "harness/multiprocess.h"
#include "harness/rpc_workers.h"
#include "support/process_memory.h"

namespace distoptim {
namespace dist_optim {
namespace lost_trainer_test {

using namespace std::chrono_literals;
using dist_autograd::ContextGuard;
using optim::OptionBag;
using rpc::rpc_sync;
using rpc::RRef;
using testing::allocated_bytes;
using testing::kChecksMemory;
using testing::resident_bytes;
using testing::wait_until;
using testing::worker;

constexpr int kServer = 0;
constexpr int kVictim = 3;
constexpr int kWorld = 4;
constexpr int64_t kFeatures = 1024;
constexpr int64_t kVictimRows = 2048;  // 16 MB of doubles per batch
constexpr int64_t kSurvivorRows = 16;
constexpr int kWarmUpIterations = 2;  // before the server takes its baseline
constexpr int kKillIteration = 3;     // the victim's iteration it dies in (or after)
constexpr int kSurvivorIterations = 8;
constexpr double kLr = 1e-4;
constexpr int kHolds = 3;  // KillPoint::kQueued: requests that keep the server's threads busy
// What the server may hold above its baseline at the end: the dying trainer's batch alone is
// 16 MB, its queued requests 48 MB. Allocated: bytes malloc has handed out and not had back (all
// of LibTorch's tensors, and our objects). Resident: the process's resident memory, malloc
// trimmed first. Neither is checked under AddressSanitizer, whose allocator keeps freed memory
// in quarantine and does not answer mallinfo2; the counts of contexts and RRefs still are.
constexpr int64_t kAllocatedBoundBytes = 1 << 20;
constexpr int64_t kResidentBoundBytes = 4 << 20;

enum class KillPoint { kForward, kBackward, kStep, kQueued, kBetweenIterations };

std::string name_of(KillPoint point) {
  switch (point) {
    case KillPoint::kForward:
      return "Forward";
    case KillPoint::kBackward:
      return "Backward";
    case KillPoint::kStep:
      return "Step";
    case KillPoint::kQueued:
      return "Queued";
    case KillPoint::kBetweenIterations:
      return "BetweenIterations";
  }
  return "?";
}

// Trainer `trainer`'s model, the same in every process and run.
std::vector<at::Tensor> make_params(int trainer) {
  auto generator = at::detail::createCPUGenerator(700 + trainer);
  auto options = at::TensorOptions().dtype(at::kDouble);
  return {(at::randn({kFeatures, 4}, generator, options) * 0.03).requires_grad_(),
          (at::randn({4}, generator, options) * 0.1).requires_grad_()};
}

at::Tensor input(int trainer, int iteration) {
  auto generator = at::detail::createCPUGenerator(1000 * trainer + iteration);
  const int64_t rows = trainer == kVictim ? kVictimRows : kSurvivorRows;
  return at::randn({rows, kFeatures}, generator, at::TensorOptions().dtype(at::kDouble));
}

at::Tensor layer(const std::vector<at::Tensor>& p, const at::Tensor& x) {
  return at::tanh(at::matmul(x, p[0]) + p[1]);
}

// The server's side.
std::mutex g_models_mutex;
std::map<int, std::vector<at::Tensor>> g_models;  // by trainer; guarded by g_models_mutex
std::atomic<int> g_arrived{0};
std::atomic<int> g_done{0};
std::atomic<int> g_phase{0};  // 1: the baseline is taken; 2: the server's checks are done
std::atomic<bool> g_victim_gone{false};
std::atomic<int> g_touched{0};
std::atomic<bool> g_hold_steps{false};

std::vector<at::Tensor> model_of(int trainer) {
  std::lock_guard<std::mutex> lock(g_models_mutex);
  auto it = g_models.find(trainer);
  if (it == g_models.end()) it = g_models.emplace(trainer, make_params(trainer)).first;
  return it->second;
}

DISTOPTIM_RPC_FUNCTION("lost.params", [](int64_t trainer) {
  std::vector<RRef<at::Tensor>> rrefs;
  for (const at::Tensor& p : model_of(static_cast<int>(trainer))) rrefs.emplace_back(p);
  return rrefs;
});
// A file of this run's, which the server writes once it holds the dying trainer's work: asking
// the server instead would need a request thread, which the held work may keep from answering.
std::string held_work_file() {
  return "/tmp/distoptim-lost-trainer-held-" + std::string(std::getenv("MASTER_PORT"));
}
// The dying trainer's work in flight on the server (KillPoint::kForward, kBackward, kStep): it
// says it has started, then holds until the server has seen the trainer go (bounded), so that
// the trainer dies while it runs.
void hold_until_the_victim_is_gone() {
  std::ofstream(held_work_file()).put('1');
  (void)wait_until([] { return g_victim_gone.load(); }, 30s);
}
// The forward pass of `trainer`'s model, held first if `hold`; its backward on the server is held
// first if `hold_backward`.
at::Tensor forward_of(int64_t trainer, const at::Tensor& x, bool hold, bool hold_backward) {
  if (hold) hold_until_the_victim_is_gone();
  at::Tensor y = layer(model_of(static_cast<int>(trainer)), x);
  if (hold_backward) {
    y.register_hook([](const at::Tensor& grad) {
      hold_until_the_victim_is_gone();
      return grad;
    });
  }
  return y;
}
DISTOPTIM_RPC_FUNCTION("lost.forward", forward_of);
// Holds a request thread until the server has seen the dying trainer go (PeerLostError), so
// that the requests queued behind it start only after the trainer counts as lost, however long
// noticing its death takes.
std::atomic<int> g_holds_started{0};
DISTOPTIM_RPC_FUNCTION("lost.hold", [](const at::Tensor& ballast) {
  ++g_holds_started;
  (void)wait_until([] { return g_victim_gone.load(); }, 30s);
  return ballast.numel();
});
DISTOPTIM_RPC_FUNCTION("lost.touch", [] { return ++g_touched; });
DISTOPTIM_RPC_FUNCTION("lost.hold_steps", [] { g_hold_steps = true; });
DISTOPTIM_RPC_FUNCTION("lost.arrive", [] { return ++g_arrived; });
DISTOPTIM_RPC_FUNCTION("lost.done", [] { return ++g_done; });
std::atomic<int> g_left{0};
DISTOPTIM_RPC_FUNCTION("lost.leaving", [] { return ++g_left; });
DISTOPTIM_RPC_FUNCTION("lost.phase", [] { return static_cast<int64_t>(g_phase.load()); });
DISTOPTIM_RPC_FUNCTION("lost.victim_gone", [] { return g_victim_gone.load(); });
DISTOPTIM_RPC_FUNCTION("lost.noop", [] { return true; });

// SGD whose every step on the server is held first once g_hold_steps is set (the dying
// trainer's optimizer, which sets it for the step it dies in).
struct HeldSGD : optim::SGD {
  using optim::SGD::SGD;

 protected:
  void update(size_t group, const std::vector<ParamUpdate>& updates) override {
    if (g_hold_steps) hold_until_the_victim_is_gone();
    optim::SGD::update(group, updates);
  }
};
const optim::OptimizerRegistration kHeldSGD(
    "lost_held_sgd", optim::typed_factory<HeldSGD, optim::SGDOptions>(optim::SGDOptions(kLr)));

rpc::RpcBackendOptions options_for(int rank) {
  // The server runs requests on one pool thread besides the I/O loop's, so that a few slow
  // requests keep the ones behind them queued (KillPoint::kQueued).
  rpc::RpcBackendOptions options = testing::test_options(20s);
  if (rank == kServer) options.num_worker_threads(1);
  return options;
}

// Dies once the server holds the work of this trainer (bounded), watching for it from a thread of
// its own while the trainer waits for that work.
void die_once_the_server_holds_my_work() {
  std::thread([] {
    (void)wait_until([] { return std::filesystem::exists(held_work_file()); }, 30s);
    ::kill(::getpid(), SIGKILL);
  }).detach();
}

// Dies once every frame this process sent is in its peers' hands: written to the socket, and
// any tensor it lent read by the peer (so that what it sent arrives whole whatever the speed).
void die_once_sent() {
  std::thread([] {
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (std::chrono::steady_clock::now() < deadline) {
      std::map<std::string, int64_t> info = rpc::get_debug_info();
      if (info["connections.writing"] == 0 && info["peer_memory.lent_frames"] == 0) break;
      std::this_thread::sleep_for(1ms);
    }
    ::kill(::getpid(), SIGKILL);
  }).detach();
}

[[noreturn]] void wait_to_be_killed() {
  for (;;) std::this_thread::sleep_for(1s);
}

// One iteration of `trainer`; the victim's at kKillIteration dies at `point`.
void iteration(int trainer, int it, DistributedOptimizer& optimizer, KillPoint point) {
  const bool dies = trainer == kVictim && it == kKillIteration;
  ContextGuard context;
  const at::Tensor x = input(trainer, it);
  const bool hold = dies && point == KillPoint::kForward;
  const bool hold_backward = dies && point == KillPoint::kBackward;
  if (hold || hold_backward) die_once_the_server_holds_my_work();
  const at::Tensor y = rpc_sync<at::Tensor>(worker(kServer), "lost.forward",
                                            std::tuple{int64_t{trainer}, x, hold, hold_backward});
  dist_autograd::backward(context.id(), {y.pow(2).sum()});
  if (dies && point == KillPoint::kStep) {
    rpc_sync(worker(kServer), "lost.hold_steps");
    die_once_the_server_holds_my_work();
  }
  if (dies && point == KillPoint::kQueued) {
    // Requests that keep the server's request threads busy until it has seen the death, then
    // the touch and the step queued behind them: neither may run once the trainer is gone. The
    // trainer dies once the holds and the touch have arrived; whether the step's request also
    // left before the death depends on the machine's speed.
    const at::Tensor ballast = at::ones({kVictimRows * kFeatures}, at::kDouble);
    for (int i = 0; i < kHolds; ++i) {
      (void)rpc::rpc_async<int64_t>(worker(kServer), "lost.hold", std::tuple{ballast});
    }
    (void)rpc::rpc_async<int64_t>(worker(kServer), "lost.touch");
    die_once_sent();
  }
  optimizer.step(context.id());
  if (dies && point != KillPoint::kBetweenIterations) wait_to_be_killed();
}

void train(int trainer, KillPoint point) {
  {
    std::vector<RRef<at::Tensor>> params = rpc_sync<std::vector<RRef<at::Tensor>>>(
        worker(kServer), "lost.params", std::tuple{int64_t{trainer}});
    DistributedOptimizer optimizer(trainer == kVictim ? "lost_held_sgd" : "sgd", params,
                                   OptionBag().set("lr", kLr));
    int it = 0;
    for (; it < kWarmUpIterations; ++it) iteration(trainer, it, optimizer, point);
    rpc_sync<int64_t>(worker(kServer), "lost.arrive");
    ASSERT_TRUE(
        wait_until([] { return rpc_sync<int64_t>(worker(kServer), "lost.phase") >= 1; }, 30s));
    if (trainer == kVictim) {
      for (; it <= kKillIteration; ++it) iteration(trainer, it, optimizer, point);
      ::kill(::getpid(), SIGKILL);  // KillPoint::kBetweenIterations
      wait_to_be_killed();
    }
    // The others train on through the death, and a few iterations past it.
    bool gone = false;
    for (int after = 0; it < kSurvivorIterations || after < 3; ++it) {
      ASSERT_LT(it, 10000) << "the server never saw the victim go";
      iteration(trainer, it, optimizer, point);
      if (gone) ++after;
      gone = gone || rpc_sync<bool>(worker(kServer), "lost.victim_gone");
    }
  }  // the optimizer and the parameters' RRefs are dropped: the server hears
  rpc_sync<int64_t>(worker(kServer), "lost.done");
  ASSERT_TRUE(
      wait_until([] { return rpc_sync<int64_t>(worker(kServer), "lost.phase") >= 2; }, 60s));
  rpc_sync<int64_t>(worker(kServer), "lost.leaving");
}

// The victim's parameters after `steps` SGD steps, computed in this one process.
std::vector<at::Tensor> replay(int steps) {
  std::vector<at::Tensor> p = make_params(kVictim);
  for (int it = 0; it < steps; ++it) {
    const at::Tensor loss = layer(p, input(kVictim, it)).pow(2).sum();
    const std::vector<at::Tensor> grads = torch::autograd::grad({loss}, p);
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] = (p[i].detach() - kLr * grads[i]).requires_grad_();
    }
  }
  return p;
}

bool all_close(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (!at::allclose(a[i].detach(), b[i].detach(), 1e-10, 1e-13)) return false;
  }
  return true;
}

int64_t info(const std::map<std::string, int64_t>& map, const std::string& key) {
  auto it = map.find(key);
  return it == map.end() ? -1 : it->second;
}

void serve(KillPoint point) {
  ASSERT_TRUE(wait_until([] { return g_arrived.load() == kWorld - 1; }, 30s));
  ASSERT_TRUE(wait_until(
      [] { return dist_autograd::get_debug_info()["num_autograd_contexts"] == 0; }, 20s));
  const int64_t baseline = resident_bytes();
  const int64_t baseline_allocated = allocated_bytes();
  ASSERT_GT(baseline, 0);
  std::filesystem::remove(held_work_file());  // a file left by a failed run on the same port
  g_phase = 1;
  // Learns of the victim's death as any caller of it would.
  ASSERT_TRUE(wait_until(
      [] {
        try {
          rpc_sync<bool>(worker(kVictim), "lost.noop");
        } catch (const PeerLostError&) {
          g_victim_gone = true;
        }
        return g_victim_gone.load();
      },
      30s))
      << "the victim never died";
  ASSERT_TRUE(wait_until([] { return g_done.load() == 2; }, 30s)) << "the survivors never finished";
  // Back to what the server held before any trainer came: no context, no backward pass, no RRef
  // any user holds (the victim's forks and optimizer included), nothing of it left queued, and its
  // memory (a request or a backward pass of the victim still running when it died ends first;
  // seconds at most, but bounded generously: the test asserts no speed).
  std::map<std::string, int64_t> rpc_info, autograd_info;
  int64_t resident = 0, allocated = 0;
  const bool settled = wait_until(
      [&] {
        rpc_info = rpc::get_debug_info();
        autograd_info = dist_autograd::get_debug_info();
        resident = resident_bytes();
        allocated = allocated_bytes();
        return info(autograd_info, "num_autograd_contexts") == 0 &&
               info(autograd_info, "num_current_backward_passes") == 0 &&
               info(rpc_info, "num_owner_rrefs") == 0 && info(rpc_info, "num_forks") == 0 &&
               info(rpc_info, "num_pending_children") == 0 &&
               info(rpc_info, "agent.num_requests_in_flight") <= 2 &&  // the survivors' polls
               (!kChecksMemory || (allocated - baseline_allocated <= kAllocatedBoundBytes &&
                                   resident - baseline <= kResidentBoundBytes));
      },
      40s);
  std::printf(
      "server memory: resident %.1f MB at the baseline, %.1f MB at the end (bound +%.0f MB); "
      "allocated %.1f MB, %.1f MB (bound +%.0f MB)\n",
      baseline / 1048576.0, resident / 1048576.0, kResidentBoundBytes / 1048576.0,
      baseline_allocated / 1048576.0, allocated / 1048576.0, kAllocatedBoundBytes / 1048576.0);
  EXPECT_TRUE(settled) << "contexts " << info(autograd_info, "num_autograd_contexts")
                       << ", backward passes " << info(autograd_info, "num_current_backward_passes")
                       << ", owner rrefs " << info(rpc_info, "num_owner_rrefs") << ", forks "
                       << info(rpc_info, "num_forks") << ", pending children "
                       << info(rpc_info, "num_pending_children") << ", requests in flight "
                       << info(rpc_info, "agent.num_requests_in_flight") << ", resident +"
                       << (resident - baseline) << " bytes, allocated +"
                       << (allocated - baseline_allocated) << " bytes";
  EXPECT_EQ(g_touched.load(), 0) << "a request of the dead trainer ran after it died";
  if (point == KillPoint::kQueued) {
    // Every request the dead trainer sent either ran before its death (holds only) or was
    // dropped unrun: the holds and the touch, and the step's request if it had left too.
    const int64_t dropped = info(rpc_info, "agent.num_dropped_requests");
    std::printf("the dead trainer's requests: %d holds ran, %lld dropped unrun\n",
                g_holds_started.load(), static_cast<long long>(dropped));
    EXPECT_GE(g_holds_started.load() + dropped, kHolds + 1);
    EXPECT_LE(g_holds_started.load() + dropped, kHolds + 2);
  }

  // The victim's parameters: every step that returned applied once, the one in flight applied
  // whole or not at all.
  const std::vector<at::Tensor> now = model_of(kVictim);
  const std::vector<at::Tensor> before = replay(kKillIteration);
  const std::vector<at::Tensor> after = replay(kKillIteration + 1);
  ASSERT_FALSE(all_close(before, after));
  std::printf("the dead trainer's parameters: %s the step of iteration %d\n",
              all_close(now, before)  ? "before"
              : all_close(now, after) ? "after"
                                      : "neither before nor after",
              kKillIteration);
  switch (point) {
    case KillPoint::kForward:
    case KillPoint::kBackward:
    case KillPoint::kQueued:
      EXPECT_TRUE(all_close(now, before)) << "the step of the iteration the trainer died in ran";
      break;
    case KillPoint::kStep:
      EXPECT_TRUE(all_close(now, before) || all_close(now, after))
          << "the parameters are neither all before nor all after the step in flight";
      break;
    case KillPoint::kBetweenIterations:
      EXPECT_TRUE(all_close(now, after)) << "the steps that returned were not applied once each";
      break;
  }
  std::filesystem::remove(held_work_file());
  g_phase = 2;
  // The survivors' last calls are answered before the server leaves.
  EXPECT_TRUE(wait_until([] { return g_left.load() == 2; }, 30s));
}

class LostTrainer : public ::testing::TestWithParam<KillPoint> {};

TEST_P(LostTrainer, OthersFinishAndTheServerReturnsToBaseline) {
  const KillPoint point = GetParam();
  testing::RunRanksOptions options;
  options.expected_signals = {{kVictim, SIGKILL}};
  options.deadline = std::chrono::seconds(100);
  // The server (rank 0) measures its own resident memory against a baseline, with its own malloc
  // settings: a process of its own.
  options.rank0_in_test_process = false;
  testing::run_ranks(
      kWorld,
      [point](int rank, int size) {
        // Large buffers go back to the system when freed, and every thread allocates from the
        // main arena, which malloc_trim empties whole: resident memory then shows what is held.
        mallopt(M_MMAP_THRESHOLD, 256 << 10);
        mallopt(M_ARENA_MAX, 1);
        rpc::init_rpc(worker(rank), rank, size, options_for(rank));
        if (rank == kServer) {
          serve(point);
        } else {
          train(rank, point);
        }
        // The dead trainer never reaches the barrier of a graceful shutdown, which fails: on the
        // server naming it; on the others, which never called it, naming the server that left.
        try {
          rpc::shutdown();
          ADD_FAILURE() << "a graceful shutdown passed without " << worker(kVictim);
        } catch (const PeerLostError& error) {
          if (rank == kServer) {
            EXPECT_NE(std::string(error.what()).find("'" + worker(kVictim) + "' (rank 3) is lost"),
                      std::string::npos)
                << error.what();
          }
        }
      },
      options);
}

INSTANTIATE_TEST_SUITE_P(KillPoints, LostTrainer,
                         ::testing::Values(KillPoint::kForward, KillPoint::kBackward,
                                           KillPoint::kStep, KillPoint::kQueued,
                                           KillPoint::kBetweenIterations),
                         [](const ::testing::TestParamInfo<KillPoint>& param) {
                           return name_of(param.param);
                         });

}  // namespace lost_trainer_test
}  // namespace dist_optim
}  // namespace distoptim
