// The RPC agent across real processes on loopback (tests/harness): calls of every value kind,
// remote errors, timeouts, nested calls, concurrency, large and strided tensors, a killed
// worker, shutdown. Every rank is its own process; every wait is bounded.

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <distoptim/rpc.h>
#include <distoptim/rpc/detail/calls.h>
#include <distoptim/rpc/detail/values.h>

#include "harness/multiprocess.h"
#include "harness/rpc_workers.h"
#include "support/sanitizers.h"

namespace distoptim {
namespace rpc {
namespace rpc_test {

using namespace std::chrono_literals;
using distoptim::testing::run_ranks;
using distoptim::testing::test_options;
using distoptim::testing::worker;

// The callables, registered in every process.
int64_t add(int64_t a, int64_t b) { return a + b; }
DISTOPTIM_RPC_FUNCTION("add", add);
DISTOPTIM_RPC_FUNCTION("echo", [](c10::IValue value) { return value; });
DISTOPTIM_RPC_FUNCTION("scale",
                       [](const at::Tensor& tensor, double factor) { return tensor * factor; });
DISTOPTIM_RPC_FUNCTION("describe", [](const std::map<std::string, std::vector<int64_t>>& lists,
                                      const std::string& prefix) {
  std::vector<std::string> names;
  int64_t total = 0;
  for (const auto& [name, values] : lists) {
    names.push_back(prefix + name);
    for (int64_t value : values) total += value;
  }
  return std::make_tuple(names, total, std::optional<double>());
});
DISTOPTIM_RPC_FUNCTION("fail", [](const std::string& why) -> int64_t {
  TORCH_CHECK_VALUE(false, "refusing: ", why);
});
// How many sleep_ms calls have started in this process.
std::atomic<int> g_sleeps_started{0};
DISTOPTIM_RPC_FUNCTION("sleep_ms", [](int64_t ms) {
  ++g_sleeps_started;
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
});
DISTOPTIM_RPC_FUNCTION("whoami", [] { return get_worker_info().name; });
DISTOPTIM_RPC_FUNCTION("pid", [] { return int64_t{::getpid()}; });
// Nested: calls `hop` on `next` and appends this worker's name.
DISTOPTIM_RPC_FUNCTION("relay", [](std::vector<std::string> path) {
  const std::string me = get_worker_info().name;
  path.push_back(me);
  if (path.size() == 1) {  // worker0 -> worker1: go on to worker2, then back to worker0.
    path = rpc_sync<std::vector<std::string>>("worker2", "relay", std::tuple{path});
    return rpc_sync<std::vector<std::string>>("worker0", "relay", std::tuple{path});
  }
  return path;
});
// Ends this process once a sleep_ms call is being handled here (or after 20 s).
DISTOPTIM_RPC_FUNCTION("exit_while_sleeping", [] {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (g_sleeps_started == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ::_exit(7);
});

// The pids other workers told this one (tell_pid), by rank.
std::mutex g_pids_mutex;
std::condition_variable g_pids_noted;
std::map<int64_t, int64_t> g_pids;  // guarded by g_pids_mutex
DISTOPTIM_RPC_FUNCTION("note_pid", [](int64_t rank, int64_t pid) {
  {
    std::lock_guard<std::mutex> lock(g_pids_mutex);
    g_pids[rank] = pid;
  }
  g_pids_noted.notify_all();
  return pid;
});

// Tells worker `to` the pid of this process, so that it can wait for this process's exit.
void tell_pid(const std::string& to) {
  rpc_sync<int64_t>(to, "note_pid",
                    std::tuple{int64_t{get_worker_info().id}, static_cast<int64_t>(::getpid())});
}

// For a test that waits for rank 0's process to exit: rank 0 in a process of its own.
distoptim::testing::RunRanksOptions rank0_exits() {
  distoptim::testing::RunRanksOptions options;
  options.rank0_in_test_process = false;
  return options;
}

// Waits (at most `limit` in all) until rank `rank` has told this worker its pid and its process
// has exited: a zombie until the harness reaps it, then gone. False when either never happened.
bool wait_for_exit_of_rank(int rank, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  int64_t pid = 0;
  {
    std::unique_lock<std::mutex> lock(g_pids_mutex);
    if (!g_pids_noted.wait_until(lock, until, [&] { return g_pids.count(rank) != 0; })) {
      return false;
    }
    pid = g_pids.at(rank);
  }
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      until - std::chrono::steady_clock::now());
  return distoptim::testing::wait_for_process_state(static_cast<int>(pid), "ZX?",
                                                    std::max(left, std::chrono::milliseconds(0)));
}

// Waits (at most `limit`) until the agents' rendezvous store, which rank 0 serves, holds `key`,
// one of the agent's own keys (src/rpc/agent.cpp); throws when it does not. Its client is gone
// when this returns, so that it holds no connection when rank 0 stops the store.
void wait_for_agent_key(const std::string& key, std::chrono::milliseconds limit) {
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(std::atoi(std::getenv("MASTER_PORT")));
  store_options.isServer = false;
  store_options.waitWorkers = false;
  store_options.timeout = limit;
  auto store = c10::make_intrusive<c10d::TCPStore>(std::getenv("MASTER_ADDR"), store_options);
  c10d::PrefixStore rendezvous("distoptim/rpc/rendezvous/", store);
  rendezvous.wait({key}, limit);
}

TEST(Rpc, CallsCarryEveryValueKind) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options());
    EXPECT_EQ(get_worker_info().name, worker(rank));
    EXPECT_EQ(get_worker_info("worker1").id, 1);
    EXPECT_EQ(get_worker_info(0).name, "worker0");
    EXPECT_EQ(get_worker_infos().size(), 2u);
    const std::string peer = worker(1 - rank);

    EXPECT_EQ(rpc_sync<int64_t>(peer, "add", std::tuple{40, 2}), 42);
    EXPECT_EQ(rpc_sync<std::string>(peer, "whoami"), peer);
    EXPECT_EQ(rpc_sync<std::string>(1 - rank, "whoami"), peer);              // by id
    EXPECT_EQ(rpc_sync<std::string>(worker(rank), "whoami"), worker(rank));  // to itself
    EXPECT_EQ(rpc_sync<std::string>(peer, "echo", std::tuple{std::string("héllo")}), "héllo");
    EXPECT_EQ(rpc_sync<std::string>(peer, "echo", std::tuple{"a literal"}), "a literal");
    EXPECT_EQ(rpc_sync<double>(peer, "echo", std::tuple{0.25}), 0.25);
    EXPECT_EQ(rpc_sync<bool>(peer, "echo", std::tuple{true}), true);
    EXPECT_TRUE(rpc_sync(peer, "echo", std::tuple{c10::IValue()}).isNone());

    at::Tensor t = at::arange(12, at::kFloat).view({3, 4});
    EXPECT_TRUE(at::equal(rpc_sync<at::Tensor>(peer, "scale", std::tuple{t, 2}), t * 2));

    std::map<std::string, std::vector<int64_t>> lists{{"a", {1, 2}}, {"b", {}}, {"c", {10}}};
    auto [names, total, nothing] =
        rpc_sync<std::tuple<std::vector<std::string>, int64_t, std::optional<double>>>(
            peer, "describe", std::tuple{lists, "k_"});
    EXPECT_EQ(names, (std::vector<std::string>{"k_a", "k_b", "k_c"}));
    EXPECT_EQ(total, 13);
    EXPECT_FALSE(nothing.has_value());

    auto future = rpc_async<int64_t>(peer, "add", std::tuple{1, 2});
    auto doubled = future.then([](int64_t sum) { return sum * 2; });
    EXPECT_EQ(future.wait(), 3);
    EXPECT_EQ(doubled.wait(), 6);
    shutdown();
  });
}

TEST(Rpc, RemoteErrorsNameTheWorker) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options());
    const std::string peer = worker(1 - rank);
    try {
      rpc_sync<int64_t>(peer, "fail", std::tuple{std::string("bad weather")});
      ADD_FAILURE() << "no error";
    } catch (const RemoteError& error) {
      EXPECT_EQ(error.worker_name(), peer);
      EXPECT_NE(error.remote_message().find("refusing: bad weather"), std::string::npos)
          << error.remote_message();
    }
    try {
      rpc_sync(peer, "no_such_function");
      ADD_FAILURE() << "no error";
    } catch (const RemoteError& error) {
      EXPECT_NE(
          error.remote_message().find("no function or class is registered as 'no_such_function'"),
          std::string::npos);
    }
    try {
      rpc_sync(peer, "add", std::tuple{std::string("x"), 1});
      ADD_FAILURE() << "no error";
    } catch (const RemoteError& error) {
      EXPECT_NE(error.remote_message().find("argument 0 of 'add': expected int, got String"),
                std::string::npos)
          << error.remote_message();
    }
    try {
      rpc_sync(peer, "add", std::tuple{1});
      ADD_FAILURE() << "no error";
    } catch (const RemoteError& error) {
      EXPECT_NE(error.remote_message().find("'add' takes 2 argument(s), got 1"), std::string::npos);
    }
    // Bad input on the caller's side is refused before anything is sent.
    EXPECT_THROW(rpc_sync("nobody", "add", std::tuple{1, 2}), c10::ValueError);
    EXPECT_THROW(rpc_sync(5, "add", std::tuple{1, 2}), c10::ValueError);
    EXPECT_THROW(rpc_sync(peer, "echo", std::tuple{at::ones({2, 2}).to_sparse_csr()}), c10::Error);
    // A sparse COO tensor travels (an embedding's gradient).
    const at::Tensor sparse = at::sparse_coo_tensor(at::tensor({2, 0, 2}, at::kLong).unsqueeze(0),
                                                    at::randn({3, 4}), {5, 4});
    const at::Tensor echoed = rpc_sync<at::Tensor>(peer, "echo", std::tuple{sparse});
    ASSERT_TRUE(echoed.is_sparse());
    EXPECT_TRUE(at::equal(echoed.to_dense(), sparse.to_dense()));
    EXPECT_THROW(rpc_sync(peer, "add", std::tuple{1, 2}, -5ms), c10::ValueError);
    // The worker still serves after all that.
    EXPECT_EQ(rpc_sync<int64_t>(peer, "add", std::tuple{2, 3}), 5);
    shutdown();
  });
}

// torch.futures' wait_all and collect_all: both wait for every call, also past a failure; wait_all
// throws the first failure in list order, of its class, saying which and how many more.
TEST(Rpc, WaitAllAndCollectAllWaitForEveryCall) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options());
    if (rank == 0) {
      const std::string peer = worker(1);
      std::vector<RpcFuture<int64_t>> fine = {rpc_async<int64_t>(peer, "add", std::tuple{1, 2}),
                                              rpc_async<int64_t>(peer, "sleep_ms", std::tuple{300}),
                                              rpc_async<int64_t>(peer, "add", std::tuple{3, 4})};
      EXPECT_EQ(wait_all(fine), (std::vector<int64_t>{3, 300, 7}));

      std::vector<RpcFuture<int64_t>> mixed = {
          rpc_async<int64_t>(peer, "sleep_ms", std::tuple{400}),
          rpc_async<int64_t>(peer, "fail", std::tuple{std::string("first")}),
          rpc_async<int64_t>(peer, "fail", std::tuple{std::string("second")}),
          rpc_async<int64_t>(peer, "add", std::tuple{1, 1})};
      try {
        wait_all(mixed);
        ADD_FAILURE() << "no error";
      } catch (const RemoteError& error) {
        EXPECT_EQ(error.worker_name(), peer);
        const std::string message = error.remote_message();
        EXPECT_EQ(message.rfind("wait_all: future 1 of 4 failed (and 1 more): ", 0), 0u) << message;
        EXPECT_NE(message.find("refusing: first"), std::string::npos) << message;
      }
      for (size_t i = 0; i < mixed.size(); ++i) {
        EXPECT_TRUE(mixed[i].completed()) << "wait_all returned before future " << i;
      }

      std::vector<RpcFuture<int64_t>> collected = {
          rpc_async<int64_t>(peer, "sleep_ms", std::tuple{300}),
          rpc_async<int64_t>(peer, "fail", std::tuple{std::string("x")})};
      collect_all(collected).wait();  // never throws: the failure stays in its future
      EXPECT_TRUE(collected[0].completed());
      EXPECT_EQ(collected[0].wait(), 300);
      EXPECT_TRUE(collected[1].has_error());

      std::vector<RpcFuture<int64_t>> late = {
          rpc_async<int64_t>(peer, "sleep_ms", std::tuple{2000}, 100ms)};
      try {
        wait_all(late);
        ADD_FAILURE() << "no error";
      } catch (const TimeoutError& error) {
        EXPECT_NE(std::string(error.what()).find("wait_all: future 0 of 1 failed: "),
                  std::string::npos)
            << error.what();
      }
      std::vector<RpcFuture<void>> discarded = {rpc_async<void>(peer, "add", std::tuple{1, 2})};
      wait_all(discarded);
      EXPECT_TRUE(discarded[0].completed());
    }
    shutdown();
  });
}

TEST(Rpc, TimeoutsFailTheCall) {
  run_ranks(2, [](int rank, int world_size) {
    // A default of 1 s: the calls that must succeed within it do so on a loaded machine too.
    init_rpc(worker(rank), rank, world_size, test_options().rpc_timeout(1000ms));
    if (rank == 0) {
      EXPECT_THROW(rpc_sync(worker(1), "sleep_ms", std::tuple{2000}, 100ms), TimeoutError);
      EXPECT_THROW(rpc_sync(worker(1), "sleep_ms", std::tuple{2000}), TimeoutError);  // default
      EXPECT_EQ(rpc_sync<int64_t>(worker(1), "sleep_ms", std::tuple{500}, kNoTimeout), 500);
      EXPECT_EQ(rpc_sync<int64_t>(worker(1), "sleep_ms", std::tuple{10}), 10);
    }
    shutdown();
  });
}

TEST(Rpc, NestedCallsDoNotDeadlock) {
  run_ranks(3, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options().num_worker_threads(4));
    if (rank == 0) {
      // worker0 -> worker1 -> worker2, then worker1 -> worker0 while worker0 waits on worker1.
      const auto path = rpc_sync<std::vector<std::string>>("worker1", "relay",
                                                           std::tuple{std::vector<std::string>{}});
      EXPECT_EQ(path, (std::vector<std::string>{"worker1", "worker2", "worker0"}));
    }
    shutdown();
  });
}

TEST(Rpc, ManyThreadsCallAtOnce) {
  run_ranks(3, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options());
    constexpr int kThreads = 8;
    constexpr int kCalls = 250;
    std::atomic<int> wrong{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::vector<std::pair<int64_t, RpcFuture<int64_t>>> futures;
        for (int i = 0; i < kCalls; ++i) {
          const int64_t a = rank * 1000000 + t * 1000 + i;
          futures.emplace_back(a, rpc_async<int64_t>(worker((rank + 1 + i % 2) % world_size), "add",
                                                     std::tuple{a, 7}));
        }
        for (auto& [a, future] : futures) {
          wrong += future.wait() != a + 7;
        }
      });
    }
    for (auto& thread : threads) thread.join();
    EXPECT_EQ(wrong.load(), 0);
    shutdown();
  });
}

// A flooding caller and a slow callee: past inbound_queue_bytes the callee stops reading (TCP
// then holds the caller back), so its memory stays bounded, and every call still completes.
DISTOPTIM_RPC_FUNCTION("slow_checksum", [](const at::Tensor& tensor) {
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  return tensor.sum().item<int64_t>();
});
int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0;
  int64_t resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
}
DISTOPTIM_RPC_FUNCTION("resident_bytes", resident_bytes);

TEST(Rpc, FloodingCallerIsHeldBackAndLosesNothing) {
  // Rank 0 waits in shutdown while rank 1's flood drains through its one worker thread (over
  // 30 s under ThreadSanitizer on a busy 2-core machine): give it the harness's whole bound.
  distoptim::testing::RunRanksOptions bound;
  bound.deadline = std::chrono::seconds(180);
  run_ranks(
      2,
      [](int rank, int world_size) {
        constexpr int64_t kQueueBytes = 8 << 20;
        init_rpc(worker(rank), rank, world_size,
                 test_options()
                     .num_worker_threads(1)
                     .inbound_queue_bytes(kQueueBytes)
                     .shutdown_timeout(std::chrono::seconds(170)));
        if (rank == 1) {
          constexpr int kCalls = 400;
          constexpr int64_t kElements = 1 << 18;  // 1 MiB of int32 per call: 400 MiB in all
          const int64_t resident_before = rpc_sync<int64_t>(worker(0), "resident_bytes");
          std::vector<std::pair<int64_t, RpcFuture<int64_t>>> futures;
          for (int i = 0; i < kCalls; ++i) {
            const at::Tensor tensor = at::full({kElements}, i, at::kInt);
            futures.emplace_back(
                int64_t{i} * kElements,
                rpc_async<int64_t>(worker(0), "slow_checksum", std::tuple{tensor}));
          }
          // Sampled while the flood drains: the callee holds about the queue bound, not the flood.
          int64_t resident_peak = 0;
          for (int i = 0; i < 20; ++i) {
            resident_peak = std::max(resident_peak, rpc_sync<int64_t>(worker(0), "resident_bytes"));
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
          }
          for (auto& [expected, future] : futures) {
            EXPECT_EQ(future.wait(), expected);
          }
#if DISTOPTIM_UNDER_ASAN || DISTOPTIM_UNDER_TSAN
          // Under ASan freed memory stays resident in its quarantine (256 MiB by default), under
          // TSan every byte has shadow memory: the resident size says nothing about the queue bound
          // there. The Release suite checks it.
          (void)resident_before;
          (void)resident_peak;
#else
          EXPECT_LT(resident_peak - resident_before, int64_t{96} << 20);
#endif
        }
        shutdown();
      },
      bound);
}

// A reply carries the values as they were when the handler returned, even when the handler
// returns memory that is updated in place right after, under an InPlaceUpdateGuard (a parameter
// server stepping its weights while a reply of them is still being written). 16 MiB: beyond what
// loopback sockets buffer, so writing a reply spans many steps.
constexpr int64_t kWeightCount = int64_t{4} << 20;
std::mutex g_weights_mutex;
at::Tensor g_weights;  // guarded by g_weights_mutex
DISTOPTIM_RPC_FUNCTION("weights", [] {
  std::lock_guard<std::mutex> lock(g_weights_mutex);
  if (!g_weights.defined()) g_weights = at::zeros({kWeightCount});
  return g_weights;
});
DISTOPTIM_RPC_FUNCTION("step_weights", [](double value) {
  std::lock_guard<std::mutex> lock(g_weights_mutex);
  if (!g_weights.defined()) g_weights = at::zeros({kWeightCount});
  InPlaceUpdateGuard updating;
  g_weights.fill_(value);
  return value;
});

TEST(Rpc, RepliesNeverCarryTornTensors) {
  run_ranks(3, [](int rank, int world_size) {
    // Rank 0 waits in shutdown while the others work: give it the harness's whole deadline.
    init_rpc(worker(rank), rank, world_size,
             test_options().num_worker_threads(4).shutdown_timeout(std::chrono::seconds(55)));
    if (rank == 1) {
      for (int i = 0; i < 12; ++i) {
        const at::Tensor weights = rpc_sync<at::Tensor>(worker(0), "weights");
        EXPECT_EQ(weights.min().item<float>(), weights.max().item<float>())
            << "a reply mixed two steps' values (fetch " << i << ")";
      }
    } else if (rank == 2) {
      for (int i = 0; i < 200; ++i) {
        rpc_sync<double>(worker(0), "step_weights", std::tuple{static_cast<double>(i)});
      }
    }
    shutdown();
  });
}

// get_rpc_timeout() is the agent's default timeout.
TEST(Rpc, GetRpcTimeoutIsTheDefault) {
  run_ranks(1, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options().rpc_timeout(1234ms));
    EXPECT_EQ(get_rpc_timeout(), 1234ms);
    shutdown();
    EXPECT_THROW(get_rpc_timeout(), DistributedError);
  });
}

// Minor page faults (pages the kernel mapped and zeroed) while this thread allocates, fills and
// frees three blocks of `bytes`, in the third round of three: the pattern of a training
// iteration's large activations and gradients.
long page_faults_of_third_round(size_t bytes) {
  long faults = 0;
  for (int round = 0; round < 3; ++round) {
    rusage before{}, after{};
    getrusage(RUSAGE_THREAD, &before);
    std::vector<void*> blocks;
    for (int i = 0; i < 3; ++i) {
      blocks.push_back(std::malloc(bytes));
      std::memset(blocks.back(), round + 1, bytes);
    }
    for (void* block : blocks) std::free(block);
    getrusage(RUSAGE_THREAD, &after);
    faults = after.ru_minflt - before.ru_minflt;
  }
  return faults;
}

// With keep_freed_memory (the default), blocks freed in one round are reused by the next; with
// it off, glibc's defaults trim the heap's freed top (past twice the largest block freed so far,
// 64 MiB at most: these three make 72) and each round maps and zeroes the pages afresh. Each
// setting in a process of its own: mallopt is global.
TEST(Rpc, KeepFreedMemoryReusesLargeBlocks) {
#if DISTOPTIM_UNDER_ASAN || DISTOPTIM_UNDER_TSAN
  GTEST_SKIP() << "the sanitizers' allocators replace glibc's malloc, which mallopt tunes";
#endif
  constexpr size_t kBytes = size_t{24} << 20;
  const long pages = 3 * static_cast<long>(kBytes / ::sysconf(_SC_PAGESIZE));
  for (const bool keep : {true, false}) {
    run_ranks(1, [&](int rank, int world_size) {
      init_rpc(worker(rank), rank, world_size, test_options().keep_freed_memory(keep));
      const long faults = page_faults_of_third_round(kBytes);
      shutdown();
      if (keep) {
        EXPECT_LT(faults, pages / 10) << "of " << pages << " pages";
      } else {
        EXPECT_GT(faults, pages / 2) << "of " << pages << " pages";
      }
    });
  }
}

// Graceful shutdown does not wait its whole timeout for a worker it already knows is dead: the
// barrier fails with PeerLostError naming it (shutdown_timeout is far beyond the test's deadline).
TEST(Rpc, GracefulShutdownFailsFastOnALostPeer) {
  distoptim::testing::RunRanksOptions options = rank0_exits();
  options.expected_exit_codes = {{2, 7}};
  options.deadline = std::chrono::seconds(60);
  run_ranks(
      3,
      [](int rank, int world_size) {
        init_rpc(worker(rank), rank, world_size,
                 test_options().shutdown_timeout(std::chrono::minutes(10)));
        if (rank == 2) {
          ::_exit(7);
        }
        // Rank 0 calls worker1, not the other way round: worker1 never has a connection of its
        // own to worker0 to lose when rank 0 exits.
        if (rank == 0) tell_pid(worker(1));
        // Learn of worker2's death through a call to it.
        EXPECT_THROW(rpc_sync(worker(2), "sleep_ms", std::tuple{int64_t{60000}}), PeerLostError);
        if (rank == 1) {
          // Rank 0, the store host, fails its barrier and exits first, and with it the store: the
          // store's loss must not hide the cause, worker2.
          ASSERT_TRUE(wait_for_exit_of_rank(0, 30s)) << "rank 0 did not exit";
        }
        try {
          shutdown();
          ADD_FAILURE() << "shutdown() passed its barrier without worker2";
        } catch (const PeerLostError& error) {
          EXPECT_NE(std::string(error.what()).find("'worker2' (rank 2) is lost"), std::string::npos)
              << error.what();
        }
      },
      options);
}

// A worker that never calls init_rpc: the others' init_rpc fails after init_timeout with
// TimeoutError naming its rank.
TEST(Rpc, InitWithAWorkerThatNeverArrivesNamesIt) {
  run_ranks(3, [](int rank, int world_size) {
    if (rank == 2) {
      std::this_thread::sleep_for(3s);  // and never calls init_rpc
      return;
    }
    try {
      // Long enough for ranks 0 and 1 to meet however far apart their processes start.
      init_rpc(worker(rank), rank, world_size, test_options().init_timeout(10s));
      ADD_FAILURE() << "init_rpc passed without rank 2";
      shutdown(/*graceful=*/false);
    } catch (const TimeoutError& error) {
      EXPECT_NE(std::string(error.what()).find("never arrived: rank 2"), std::string::npos)
          << error.what();
    }
  });
}

// A worker that never calls shutdown: the others' graceful shutdown fails after
// shutdown_timeout with TimeoutError naming it (rank 0, the store's host, tells the others
// before it stops the store), and stops their agents all the same.
TEST(Rpc, GracefulShutdownWithAWorkerThatNeverCallsItNamesIt) {
  run_ranks(
      3,
      [](int rank, int world_size) {
        // Rank 0, which serves the store, gives up first: rank 1 would wait far longer, so it
        // fails only by what rank 0 tells it, and it must still hear why (not just that the
        // store is gone).
        init_rpc(worker(rank), rank, world_size,
                 test_options().shutdown_timeout(rank == 1 ? 30000ms : 1500ms));
        EXPECT_EQ(rpc_sync<int64_t>(worker((rank + 1) % 3), "add", std::tuple{1, 2}), 3);
        if (rank == 2) {
          // Past the others' shutdown: until both processes have exited.
          EXPECT_TRUE(wait_for_exit_of_rank(0, 30s)) << "rank 0 did not exit";
          EXPECT_TRUE(wait_for_exit_of_rank(1, 30s)) << "rank 1 did not exit";
          shutdown(/*graceful=*/false);
          return;
        }
        tell_pid(worker(2));
        if (rank == 0) {
          // Rank 0 enters the barrier once worker1 waits in it (worker1's key, the first thing its
          // barrier sets), so that worker1 is there to be told when rank 0's 1.5 s have passed.
          wait_for_agent_key("distoptim/rpc/shutdown/entered/1", 30s);
        }
        try {
          shutdown();
          ADD_FAILURE() << "shutdown() passed its barrier without worker2";
        } catch (const TimeoutError& error) {
          // Rank 0's own timeout; rank 1 heard it from rank 0.
          EXPECT_NE(std::string(error.what()).find("worker 'worker0' waited 1500 ms"),
                    std::string::npos)
              << error.what();
          EXPECT_NE(std::string(error.what()).find("never arrived: 'worker2'"), std::string::npos)
              << error.what();
        }
        EXPECT_THROW(rpc_sync<int64_t>(worker(1 - rank), "add", std::tuple{1, 2}),
                     DistributedError);
      },
      rank0_exits());
}

// Without a shutdown_timeout (the default), graceful shutdown waits for a worker that is busy
// far longer than the liveness timeout: it answers the liveness checks while its user code runs.
// (1 s: a loaded machine may keep a live worker's answer from coming within a shorter one.)
TEST(Rpc, GracefulShutdownWaitsForAWorkerThatIsSlowButAlive) {
  EXPECT_EQ(RpcBackendOptions().shutdown_timeout().count(), 0);
  run_ranks(3, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size,
             test_options().shutdown_timeout(0ms).liveness_timeout(1000ms));
    if (rank == 2) {
      std::this_thread::sleep_for(4s);  // four liveness timeouts in user code
    }
    EXPECT_NO_THROW(shutdown());
  });
}

// A stopped (SIGSTOP) worker is told apart from a slow one: without a shutdown_timeout, the
// others' graceful shutdown fails with PeerLostError naming it once it has not answered a
// liveness check in time (the test's deadline is 60 s; the liveness timeout 1 s).
TEST(Rpc, GracefulShutdownNamesAStoppedWorkerAfterTheLivenessTimeout) {
  run_ranks(
      3,
      [](int rank, int world_size) {
        init_rpc(worker(rank), rank, world_size,
                 test_options().shutdown_timeout(0ms).liveness_timeout(1000ms));
        if (rank == 2) {
          // Stopped by rank 0 in here, and continued once rank 0's shutdown has failed.
          EXPECT_TRUE(wait_for_exit_of_rank(0, 50s)) << "rank 0 did not exit";
          EXPECT_TRUE(wait_for_exit_of_rank(1, 50s)) << "rank 1 did not exit";
          shutdown(/*graceful=*/false);
          return;
        }
        tell_pid(worker(2));
        pid_t stopped = 0;
        if (rank == 1) {
          tell_pid(worker(0));  // after worker2 knows its pid
        } else {
          {
            std::unique_lock<std::mutex> lock(g_pids_mutex);
            ASSERT_TRUE(g_pids_noted.wait_for(lock, 30s, [] { return g_pids.count(1) != 0; }));
          }
          stopped = static_cast<pid_t>(rpc_sync<int64_t>(worker(2), "pid"));
          ASSERT_TRUE(distoptim::testing::stop_process(stopped));
        }
        try {
          shutdown();
          ADD_FAILURE() << "shutdown() passed its barrier without worker2";
        } catch (const PeerLostError& error) {
          // Rank 1 either found it itself or heard it from rank 0, the store's host.
          EXPECT_NE(std::string(error.what()).find("'worker2' (rank 2) is lost"), std::string::npos)
              << error.what();
          EXPECT_NE(
              std::string(error.what()).find("did not answer a liveness check within 1000 ms"),
              std::string::npos)
              << error.what();
        }
        if (stopped != 0) ::kill(stopped, SIGCONT);
      },
      rank0_exits());
}

// A worker stopped (SIGSTOP) with calls to it pending: they fail with TimeoutError; once it is
// continued it answers again.
TEST(Rpc, StoppedWorkerTimesOutCallsAndServesOnceContinued) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options());
    if (rank == 0) {
      const int64_t pid = rpc_sync<int64_t>(worker(1), "pid");
      ASSERT_TRUE(distoptim::testing::stop_process(static_cast<int>(pid)));
      std::vector<RpcFuture<int64_t>> pending;
      for (int i = 0; i < 3; ++i) {
        pending.push_back(rpc_async<int64_t>(worker(1), "add", std::tuple{i, 1}, 500ms));
      }
      for (auto& future : pending) EXPECT_THROW(future.wait(), TimeoutError);
      ASSERT_EQ(::kill(static_cast<pid_t>(pid), SIGCONT), 0);
      EXPECT_EQ(rpc_sync<int64_t>(worker(1), "add", std::tuple{40, 2}), 42);
    }
    shutdown();
  });
}

TEST(Rpc, LargeAndStridedTensors) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options());
    if (rank == 0) {
      // 100 MB.
      at::Tensor big = at::arange(25 * 1024 * 1024, at::kInt);
      at::Tensor back = rpc_sync<at::Tensor>(worker(1), "echo", std::tuple{big});
      EXPECT_TRUE(at::equal(back, big));
      at::Tensor base = at::randn({64, 48}, at::kDouble);
      for (const at::Tensor& view :
           {base.t(), base.select(1, 5), base.narrow(0, 3, 10), base.slice(1, 0, 48, 3),
            base.view({8, 8, 48}).permute({2, 0, 1}), at::ones({3, 1}).expand({3, 5})}) {
        at::Tensor echoed = rpc_sync<at::Tensor>(worker(1), "echo", std::tuple{view});
        EXPECT_EQ(echoed.sizes(), view.sizes());
        EXPECT_TRUE(at::equal(echoed, view));
      }
      // The same tensor twice, and tensors inside containers.
      std::vector<at::Tensor> pair{base.t(), base.t()};
      auto echoed = rpc_sync<std::vector<at::Tensor>>(worker(1), "echo", std::tuple{pair});
      ASSERT_EQ(echoed.size(), 2u);
      EXPECT_TRUE(at::equal(echoed[0], base.t()));
      EXPECT_TRUE(at::equal(echoed[1], base.t()));
    }
    shutdown();
  });
}

DISTOPTIM_RPC_FUNCTION("debug_info", [] { return get_debug_info(); });

// Between workers on one host, a tensor of 256 KiB or more is read straight from the sender's
// memory, both ways (requests and replies), and arrives exact; smaller ones and workers where
// either side turns it off use the stream.
TEST(Rpc, LargeTensorsAreReadFromTheSendersMemoryOnOneHost) {
  for (const bool both_allow : {true, false}) {
    run_ranks(2, [both_allow](int rank, int world_size) {
      init_rpc(worker(rank), rank, world_size,
               test_options().same_host_memory_reads(both_allow || rank == 0));
      if (rank == 0) {
        const at::Tensor big = at::randn({1 << 20});  // 4 MiB
        const at::Tensor small = at::randn({1000});
        EXPECT_TRUE(at::equal(rpc_sync<at::Tensor>(worker(1), "echo", std::tuple{small}), small));
        const int64_t read_before = get_debug_info().at("peer_memory.bytes_read");
        EXPECT_EQ(read_before, 0) << "a 4 KB reply was read from the peer's memory";
        const std::vector<at::Tensor> back = rpc_sync<std::vector<at::Tensor>>(
            worker(1), "echo", std::tuple{std::vector<at::Tensor>{big, small, big.flip(0)}});
        ASSERT_EQ(back.size(), 3u);
        EXPECT_TRUE(at::equal(back[0], big));
        EXPECT_TRUE(at::equal(back[1], small));
        EXPECT_TRUE(at::equal(back[2], big.flip(0)));
        const auto ours = get_debug_info();
        const auto theirs = rpc_sync<std::map<std::string, int64_t>>(worker(1), "debug_info");
        const int64_t expected = both_allow ? 2 * big.nbytes() : 0;
        // The reply's two large tensors were read here, the request's there.
        EXPECT_EQ(ours.at("peer_memory.bytes_read"), expected);
        EXPECT_EQ(theirs.at("peer_memory.bytes_read"), expected);
        EXPECT_EQ(ours.at("peer_memory.connections"), both_allow ? ours.at("connections") : 0);
      }
      shutdown();
    });
  }
}

// Calls every other worker once; how many answered right.
int64_t call_every_peer() {
  const WorkerInfo self = get_worker_info();
  int64_t right = 0;
  for (const WorkerInfo& peer : get_worker_infos()) {
    if (peer.id == self.id) continue;
    right += rpc_sync<int64_t>(peer.name, "add", std::tuple{peer.id, 1}) == peer.id + 1;
  }
  return right;
}
DISTOPTIM_RPC_FUNCTION("call_every_peer", call_every_peer);

// Workers on one host talk over Unix-domain sockets, both ways, unless one of them turns that off:
// every connection to or from that one is TCP, and calls go every way all the same.
TEST(Rpc, SameHostWorkersTalkOverUnixSocketsUnlessOneTurnsThemOff) {
  run_ranks(3, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options().same_host_unix_sockets(rank != 2));
    if (rank == 0) {
      EXPECT_EQ(call_every_peer(), 2);
      EXPECT_EQ(rpc_sync<int64_t>(worker(1), "call_every_peer"), 2);
      EXPECT_EQ(rpc_sync<int64_t>(worker(2), "call_every_peer"), 2);
      // Each worker now has a connection to and from each other one.
      for (int id = 0; id < world_size; ++id) {
        SCOPED_TRACE("worker " + std::to_string(id));
        const auto counters =
            id == 0 ? get_debug_info()
                    : rpc_sync<std::map<std::string, int64_t>>(worker(id), "debug_info");
        EXPECT_EQ(counters.at("connections"), 4);
        // Workers 0 and 1 talk over Unix sockets both ways; worker 2 over TCP with both.
        EXPECT_EQ(counters.at("unix_socket.connections"), id == 2 ? 0 : 2);
      }
    }
    shutdown();
  });
}

TEST(Rpc, KilledWorkerFailsPendingAndNewCalls) {
  distoptim::testing::RunRanksOptions options;
  options.expected_exit_codes = {{1, 7}};
  run_ranks(
      2,
      [](int rank, int world_size) {
        init_rpc(worker(rank), rank, world_size, test_options());
        if (rank == 1) {
          std::this_thread::sleep_for(30s);  // Ends by exit_while_sleeping's _exit(7).
          return;
        }
        auto pending = rpc_async(worker(1), "sleep_ms", std::tuple{20000}, 30s);
        // Dies while it handles `pending`.
        auto dying = rpc_async(worker(1), "exit_while_sleeping", std::tuple{}, 30s);
        const auto start = std::chrono::steady_clock::now();
        EXPECT_THROW(pending.wait(), PeerLostError);
        EXPECT_THROW(dying.wait(), PeerLostError);
        EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
        // New calls to the dead worker fail at once.
        auto after = rpc_async(worker(1), "add", std::tuple{1, 2});
        EXPECT_TRUE(after.has_error());
        EXPECT_THROW(after.wait(), PeerLostError);
        shutdown(/*graceful=*/false);
      },
      options);
}

TEST(Rpc, GracefulShutdownWaitsForOutstandingWorkAndLeavesNoThread) {
  run_ranks(2, [](int rank, int world_size) {
    (void)at::ones({8}).sum();  // Start LibTorch's own pools before counting.
    const std::set<int> threads_before = distoptim::testing::thread_ids();
    init_rpc(worker(rank), rank, world_size, test_options());
    std::optional<RpcFuture<int64_t>> outstanding;
    if (rank == 1) {
      outstanding = rpc_async<int64_t>(worker(0), "sleep_ms", std::tuple{300});
    }
    shutdown();
    if (outstanding) {
      EXPECT_TRUE(outstanding->completed());
      EXPECT_EQ(outstanding->wait(), 300);
    }
    // The store's operations run on detached threads (comm::DeadlineStore) that may still be
    // exiting after they answered: they get a bounded moment (longer under sanitizers). The
    // threads are compared by id: one that was running before (a sanitizer's, an earlier test's)
    // may end meanwhile.
    const std::set<int> left = distoptim::testing::threads_started_since(threads_before);
    EXPECT_TRUE(left.empty()) << left.size() << " threads started by the agent are still running";
    EXPECT_THROW(rpc_sync(worker(0), "add", std::tuple{1, 2}), DistributedError);
    // And an agent can start again afterwards (fresh rendezvous keys by a new prefix).
  });
}

// Set when a rank's body returns without shutdown: its process is about to exit.
std::atomic<bool> g_leaving{false};
std::atomic<int> g_calls_waiting_for_exit{0};
// Once this process has begun to exit, calls worker `on`, which this worker has not called yet:
// the call connects, and the handshake uses OpenSSL, which exit cleans up.
DISTOPTIM_RPC_FUNCTION("call_once_exiting", [](int64_t on) {
  ++g_calls_waiting_for_exit;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!g_leaving && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // Likely into exit's clean-up: how far the exit has gone is not visible from a request.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  return rpc_sync<int64_t>(worker(static_cast<int>(on)), "add", std::tuple{1, 2});
});
// Among the last destructors at exit, made before main: holds a leaving process's exit up a
// while, as a program's own statics may, so that requests still running meet the clean-up.
struct SlowExit {
  ~SlowExit() {
    if (g_leaving) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
} g_slow_exit;

// A worker whose program ends without shutdown (an error out of main, say) while requests still
// run on its threads, one of them making its first call to the other worker as the process
// exits: every process ends with its own exit status, the agent stopped at exit before the
// library's and OpenSSL's clean-up, with no crash and no hang.
TEST(Rpc, ExitingWithoutShutdownWhileRequestsRunEndsTheProcess) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options());
    if (rank == 1) {
      ASSERT_EQ(rpc_sync<int64_t>(worker(0), "add", std::tuple{1, 2}), 3);
      for (int i = 0; i < 2; ++i) {
        (void)rpc_async<int64_t>(worker(0), "call_once_exiting", std::tuple{1});
        (void)rpc_async<int64_t>(worker(0), "sleep_ms", std::tuple{200});
      }
      // Serves worker0's connection meanwhile; leaves with its own calls in flight. Likely
      // long enough for worker0's calls made while exiting: those may fail in its clean-up and
      // never come, so there is no event to wait for.
      std::this_thread::sleep_for(1s);
    } else {
      const auto until = std::chrono::steady_clock::now() + 20s;
      while ((g_calls_waiting_for_exit < 2 || g_sleeps_started < 2) &&
             std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(1ms);
      }
      ASSERT_EQ(g_calls_waiting_for_exit.load(), 2);
      g_leaving = true;
    }
  });
}

// And one whose request is blocked for good in the program's own code: exit stops the rest and
// goes on after a bound (10 s), rather than waiting for the request as a shutdown would.
std::atomic<int> g_blocked_requests{0};
DISTOPTIM_RPC_FUNCTION("block_40s", [] {
  ++g_blocked_requests;
  std::this_thread::sleep_for(std::chrono::seconds(40));
  return int64_t{0};
});

TEST(Rpc, ExitingWithoutShutdownDoesNotWaitForABlockedRequest) {
#if DISTOPTIM_UNDER_TSAN
  GTEST_SKIP() << "ThreadSanitizer reports the agent's threads that the bounded stop leaves "
                  "unjoined at exit, as it is meant to";
#endif
  run_ranks(
      2,
      [](int rank, int world_size) {
        init_rpc(worker(rank), rank, world_size, test_options());
        if (rank == 0) {
          tell_pid(worker(1));
          const auto until = std::chrono::steady_clock::now() + 20s;
          while (g_blocked_requests == 0 && std::chrono::steady_clock::now() < until) {
            std::this_thread::sleep_for(1ms);
          }
          ASSERT_EQ(g_blocked_requests.load(), 1);
        } else {
          auto blocked = rpc_async<int64_t>(worker(0), "block_40s", std::tuple{}, 60s);
          // The bound and a margin for a slow machine, well short of the request's 40 s.
          EXPECT_TRUE(wait_for_exit_of_rank(0, 30s)) << "worker0's exit waited for its request";
          EXPECT_THROW(blocked.wait(), PeerLostError);
        }
      },
      rank0_exits());
}

TEST(RpcUnit, BadArgumentsAreRefused) {
  EXPECT_THROW(init_rpc("", 0, 1), c10::ValueError);
  EXPECT_THROW(init_rpc("has space", 0, 1), c10::ValueError);
  EXPECT_THROW(init_rpc("w", 1, 1), c10::ValueError);
  EXPECT_THROW(init_rpc("w", 0, 0), c10::ValueError);
  EXPECT_THROW(init_rpc("w", 0, 1, RpcBackendOptions().num_worker_threads(0)), c10::ValueError);
  try {
    init_rpc("w", 0, 1, RpcBackendOptions().frame_stall_timeout(-1ms));
    ADD_FAILURE() << "a negative frame_stall_timeout was accepted";
  } catch (const c10::ValueError& error) {
    EXPECT_NE(std::string(error.what_without_backtrace())
                  .find("init_rpc: frame_stall_timeout of -1 ms (use 0 for none) (worker 'w')"),
              std::string::npos)
        << error.what_without_backtrace();
  }
  EXPECT_THROW(rpc_sync("w", "add", std::tuple{1, 2}), DistributedError);
  EXPECT_THROW(shutdown(), DistributedError);
  EXPECT_THROW(get_worker_info(), DistributedError);
  EXPECT_THROW(register_function("add", add), c10::ValueError);  // taken
  EXPECT_THROW(register_function("", add), c10::ValueError);
  EXPECT_TRUE(is_function_registered("add"));
  EXPECT_FALSE(is_function_registered("no_such_function"));
}

TEST(RpcUnit, ValuesConvertWithClearErrors) {
  EXPECT_EQ(from_value<int32_t>(to_value(int64_t{5}), "x"), 5);
  EXPECT_THROW(from_value<int8_t>(to_value(300), "x"), c10::ValueError);
  EXPECT_THROW(from_value<uint32_t>(to_value(-1), "x"), c10::ValueError);
  EXPECT_EQ(from_value<float>(to_value(3), "x"), 3.0f);
  try {
    from_value<std::vector<int64_t>>(to_value(std::vector<c10::IValue>{1, std::string("b")}),
                                     "argument 1 of 'f'");
    ADD_FAILURE();
  } catch (const c10::TypeError& error) {
    EXPECT_NE(std::string(error.what()).find("argument 1 of 'f'[1]: expected int, got String"),
              std::string::npos)
        << error.what();
  }
  auto dict = from_value<std::unordered_map<int64_t, std::string>>(
      to_value(std::map<int64_t, std::string>{{1, "a"}}), "x");
  EXPECT_EQ(dict.at(1), "a");
  char buffer[] = "mutable";
  EXPECT_EQ(to_value(buffer).toStringRef(), "mutable");  // a char* is sent as a str too
  const char* missing = nullptr;
  EXPECT_THROW(to_value(missing), c10::ValueError);
  auto pair = from_value<std::pair<std::string, at::Tensor>>(
      to_value(std::make_pair(std::string("w"), at::ones({1}))), "x");
  EXPECT_EQ(pair.first, "w");
}

// A call's result names the call only in a conversion error: the name is built then, not per call.
TEST(RpcUnit, AResultNamesItsCallOnlyWhenItDoesNotConvert) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  const at::Tensor sent = at::arange(3);
  future->markCompleted(sent);
  int described = 0;
  const auto describe = [&described] {
    ++described;
    return std::string("'f'");
  };
  EXPECT_TRUE(detail::wait_for_result<at::Tensor>(*future, describe).equal(sent));
  EXPECT_TRUE(detail::wait_for_result<c10::IValue>(*future, describe).toTensor().equal(sent));
  detail::wait_for_result<void>(*future, describe);
  EXPECT_EQ(described, 0);
  try {
    detail::wait_for_result<std::string>(*future, describe);
    ADD_FAILURE() << "a tensor converted to a string";
  } catch (const c10::TypeError& error) {
    EXPECT_NE(std::string(error.what_without_backtrace()).find("the result of 'f': expected "),
              std::string::npos)
        << error.what_without_backtrace();
  }
  EXPECT_EQ(described, 1);
  // A typed function's arguments the same way: a list whose second item is no int.
  const c10::IValue list = to_value(std::vector<c10::IValue>{1, std::string("b")});
  const auto argument = [&described] {
    ++described;
    return std::string("argument 0 of 'g'");
  };
  try {
    detail::from_value_described<std::vector<int64_t>>(list, argument);
    ADD_FAILURE() << "a string converted to an int";
  } catch (const c10::TypeError& error) {
    EXPECT_NE(std::string(error.what_without_backtrace())
                  .find("argument 0 of 'g'[1]: expected int, got String"),
              std::string::npos)
        << error.what_without_backtrace();
  }
  EXPECT_EQ(described, 2);
  EXPECT_EQ(detail::from_value_described<int64_t>(to_value(7), argument), 7);
  EXPECT_EQ(described, 2);
}

}  // namespace rpc_test
}  // namespace rpc
}  // namespace distoptim
