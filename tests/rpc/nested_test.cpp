// Requests that wait on other requests, across real processes on loopback (tests/harness): chains
// of nested calls ping-ponging between two workers, many more of them than the request pool has
// threads, made by handlers that block (the pool compensates) and by async_execution handlers
// (that hold no thread); a method call on an object still being created; shutdown() called from a
// handler. And the request pool's compensation on its own. Every wait is bounded.

#include <dirent.h>

#include <atomic>
#include <future>
#include <thread>

#include <gtest/gtest.h>

#include <distoptim/rpc.h>

#include "executor.h"
#include "harness/multiprocess.h"
#include "harness/rpc_workers.h"

namespace distoptim {
namespace rpc {
namespace {

using namespace std::chrono_literals;
using distoptim::testing::run_ranks;
using distoptim::testing::test_options;
using distoptim::testing::worker;
using Path = std::vector<std::string>;

constexpr int kCallerThreads = 8;
constexpr int kChainsPerThread = 4;
constexpr int64_t kDepth = 8;

std::string other_worker() { return get_worker_info().name == "worker0" ? "worker1" : "worker0"; }

// One hop of a chain: records this worker on the way in, has the other worker run the rest of the
// chain, and records this worker again on the way back. The blocking form holds its pool thread
// in rpc_sync meanwhile.
DISTOPTIM_RPC_FUNCTION("hop_sync", [](int64_t remaining, Path path) {
  const std::string me = get_worker_info().name;
  path.push_back(me);
  if (remaining > 1) {
    path = rpc_sync<Path>(other_worker(), "hop_sync", std::tuple{remaining - 1, path});
  }
  path.push_back(me);
  return path;
});

// The async_execution form: returns the future of the rest of the chain, and holds no thread.
RpcFuture<Path> ready(Path path) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  future->markCompleted(to_value(std::move(path)));
  return RpcFuture<Path>(std::move(future), "a finished chain");
}
DISTOPTIM_RPC_FUNCTION("hop_async", [](int64_t remaining, Path path) {
  const std::string me = get_worker_info().name;
  path.push_back(me);
  if (remaining == 1) {
    path.push_back(me);
    return ready(std::move(path));
  }
  return rpc_async<Path>(other_worker(), "hop_async", std::tuple{remaining - 1, path})
      .then([me](Path rest) {
        rest.push_back(me);
        return rest;
      });
});

DISTOPTIM_RPC_FUNCTION("fail", [](const std::string& why) -> int64_t {
  TORCH_CHECK_VALUE(false, "refusing: ", why);
});
// An async_execution function whose future fails.
DISTOPTIM_RPC_FUNCTION("fail_async", [](const std::string& why) {
  return rpc_async<int64_t>(other_worker(), "fail", std::tuple{why});
});
DISTOPTIM_RPC_FUNCTION("add_async", [](int64_t a, int64_t b) {
  return rpc_async<int64_t>(other_worker(), "add_one", std::tuple{a}).then([b](int64_t a_plus_one) {
    return a_plus_one + b;
  });
});
DISTOPTIM_RPC_FUNCTION("add_one", [](int64_t a) { return a + 1; });

// What chain `id` of depth kDepth started on worker0 returns.
Path expected_path(int id) {
  Path in{"chain" + std::to_string(id)};
  for (int64_t hop = 0; hop < kDepth; ++hop) in.push_back(worker(hop % 2 == 0 ? 1 : 0));
  Path path = in;
  path.insert(path.end(), in.rbegin(), in.rend() - 1);
  return path;
}

// Starts kCallerThreads x kChainsPerThread chains of `function` at once from worker0 and checks
// every result.
void run_chains(const std::string& function) {
  std::atomic<int> wrong{0};
  std::atomic<int> failed{0};
  std::mutex mutex;
  std::string first_error;
  std::vector<std::thread> threads;
  for (int t = 0; t < kCallerThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::pair<int, RpcFuture<Path>>> chains;
      for (int c = 0; c < kChainsPerThread; ++c) {
        const int id = t * kChainsPerThread + c;
        chains.emplace_back(
            id, rpc_async<Path>("worker1", function,
                                std::tuple{kDepth, Path{"chain" + std::to_string(id)}}));
      }
      for (auto& [id, chain] : chains) {
        try {
          wrong += chain.wait() != expected_path(id);
        } catch (const std::exception& error) {
          ++failed;
          std::lock_guard<std::mutex> lock(mutex);
          if (first_error.empty()) first_error = error.what();
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(failed.load(), 0) << first_error;
}

distoptim::testing::RunRanksOptions generous_deadline() {
  distoptim::testing::RunRanksOptions options;
  options.deadline = 120s;
  return options;
}

int thread_count() {
  int count = 0;
  if (DIR* dir = ::opendir("/proc/self/task")) {
    while (dirent* entry = ::readdir(dir)) count += entry->d_name[0] != '.';
    ::closedir(dir);
  }
  return count;
}
DISTOPTIM_RPC_FUNCTION("thread_count", [] { return static_cast<int64_t>(thread_count()); });

TEST(NestedCalls, BlockingChainsOutnumberingThePool) {
  run_ranks(
      2,
      [](int rank, int world_size) {
        init_rpc(worker(rank), rank, world_size,
                 test_options().num_worker_threads(4).rpc_timeout(30s));
        if (rank == 0) {
          // One chain first, so that both connections (and their I/O threads) exist before
          // counting.
          rpc_sync<Path>("worker1", "hop_sync", std::tuple{int64_t{2}, Path{}});
          const int64_t before = rpc_sync<int64_t>("worker1", "thread_count");
          run_chains("hop_sync");
          // The compensating threads exit once the chains are done.
          int64_t after = rpc_sync<int64_t>("worker1", "thread_count");
          for (int i = 0; i < 1000 && after > before; ++i) {
            std::this_thread::sleep_for(10ms);
            after = rpc_sync<int64_t>("worker1", "thread_count");
          }
          EXPECT_LE(after, before);
        }
        shutdown();
      },
      generous_deadline());
}

TEST(NestedCalls, AsyncExecutionChainsHoldNoThread) {
  run_ranks(
      2,
      [](int rank, int world_size) {
        // No compensating thread: four threads serve every chain, since none waits.
        init_rpc(worker(rank), rank, world_size,
                 test_options().num_worker_threads(4).max_extra_worker_threads(0).rpc_timeout(30s));
        if (rank == 0) {
          run_chains("hop_async");
          EXPECT_EQ(rpc_sync<int64_t>("worker1", "add_async", std::tuple{40, 1}), 42);
          EXPECT_EQ(remote<int64_t>("worker1", "add_async", std::tuple{10, 1}).to_here(), 12);
          EXPECT_EQ(remote<int64_t>("worker0", "add_async", std::tuple{20, 1}).to_here(), 22);
          try {
            rpc_sync<int64_t>("worker1", "fail_async", std::tuple{std::string("later")});
            ADD_FAILURE() << "no error";
          } catch (const RemoteError& error) {
            EXPECT_EQ(error.worker_name(), "worker1");
            EXPECT_NE(error.remote_message().find("refusing: later"), std::string::npos)
                << error.remote_message();
          }
          EXPECT_THROW(
              remote<int64_t>("worker1", "fail_async", std::tuple{std::string("x")}).to_here(),
              RemoteError);
        }
        shutdown();
      },
      generous_deadline());
}

// A remote object whose creation is slow to reach the request pool: its constructor's argument is
// large, so the owner's ordered thread is still decoding the create message when the method call
// that follows it reaches the pool and waits for the object.
struct Tally {
  explicit Tally(std::vector<int64_t> values) {
    for (int64_t value : values) sum += value;
  }
  int64_t total() const { return sum; }
  int64_t sum = 0;
};
DISTOPTIM_RPC_CLASS(Tally, std::vector<int64_t>);
DISTOPTIM_RPC_METHOD(Tally, total);

// On the owner itself: remote() to this worker queues the creation behind this very request.
DISTOPTIM_RPC_FUNCTION("tally_here", [](std::vector<int64_t> values) {
  RRef<Tally> tally = remote<Tally>(get_worker_info().name, "Tally", std::tuple{values});
  return tally.local_value()->total() + tally.rpc_sync().method<int64_t>("total");
});

TEST(NestedCalls, MethodCallOnAnObjectStillBeingCreatedWithOneThread) {
  run_ranks(
      2,
      [](int rank, int world_size) {
        // Worker 1 waits in shutdown while worker 0 sends its large objects: under the
        // sanitizers that takes about as long as the usual shutdown_timeout.
        init_rpc(worker(rank), rank, world_size,
                 test_options()
                     .num_worker_threads(1)
                     .rpc_timeout(kNoTimeout)
                     .shutdown_timeout(std::chrono::seconds(100)));
        if (rank == 0) {
          std::vector<int64_t> values(1 << 20);
          for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<int64_t>(i % 1000);
          int64_t sum = 0;
          for (int64_t value : values) sum += value;
          for (int round = 0; round < 3; ++round) {
            RRef<Tally> tally = remote<Tally>("worker1", "Tally", std::tuple{values});
            EXPECT_EQ(tally.rpc_sync().method<int64_t>("total"), sum);
          }
          EXPECT_EQ(
              rpc_sync<int64_t>("worker1", "tally_here", std::tuple{std::vector<int64_t>{1, 2, 3}}),
              12);
        }
        shutdown();
      },
      generous_deadline());
}

DISTOPTIM_RPC_FUNCTION("shut_down_here", [] {
  shutdown();
  return true;
});

TEST(NestedCalls, ShutdownFromAHandlerIsAnError) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options().rpc_timeout(20s));
    if (rank == 0) {
      try {
        rpc_sync<bool>("worker1", "shut_down_here");
        ADD_FAILURE() << "no error";
      } catch (const RemoteError& error) {
        EXPECT_EQ(error.worker_name(), "worker1");
        EXPECT_NE(error.remote_message().find("shutdown() called from a request running on "
                                              "worker 'worker1'"),
                  std::string::npos)
            << error.remote_message();
      }
      // The worker still serves.
      EXPECT_EQ(rpc_sync<int64_t>("worker1", "add_one", std::tuple{1}), 2);
    }
    shutdown();
  });
}

// The request pool on its own: a job blocked (in a BlockingScope) on a job queued behind it.
TEST(ExecutorUnit, BlockedJobGetsACompensatingThreadAndThePoolShrinksBack) {
  detail::Executor pool(1, /*max_extra_threads=*/4);
  std::promise<void> second_ran;
  std::shared_future<void> second = second_ran.get_future().share();
  std::promise<bool> first_result;
  pool.post([&] {
    detail::Executor::BlockingScope blocking;
    first_result.set_value(second.wait_for(30s) == std::future_status::ready);
  });
  pool.post([&] { second_ran.set_value(); });
  auto first = first_result.get_future();
  ASSERT_EQ(first.wait_for(60s), std::future_status::ready);
  EXPECT_TRUE(first.get());
  // The compensating thread exits once idle.
  for (int i = 0; i < 6000 && pool.thread_count() != 1; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(pool.thread_count(), 1);
  pool.stop();
  bool inline_ran = false;
  pool.post([&] { inline_ran = true; });  // After stop: runs here.
  EXPECT_TRUE(inline_ran);
}

TEST(ExecutorUnit, PastTheBoundABlockedJobWaitsWithoutCompensation) {
  detail::Executor pool(1, /*max_extra_threads=*/0);
  std::atomic<bool> second_ran{false};
  std::promise<bool> first_saw_second;
  pool.post([&] {
    detail::Executor::BlockingScope blocking;
    std::this_thread::sleep_for(200ms);
    first_saw_second.set_value(second_ran.load());
  });
  pool.post([&] { second_ran = true; });
  auto first = first_saw_second.get_future();
  ASSERT_EQ(first.wait_for(60s), std::future_status::ready);
  EXPECT_FALSE(first.get());  // One thread, no compensation: the second job waited.
  pool.stop();                // Runs the queued job, then joins.
  EXPECT_TRUE(second_ran.load());
  EXPECT_EQ(pool.thread_count(), 0);
}

}  // namespace
}  // namespace rpc
}  // namespace distoptim
