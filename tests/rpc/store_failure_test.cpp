// A graceful shutdown whose store host (rank 0) is stopped or dead fails with one of our errors
// naming the store, within a bound, instead of hanging or throwing a bare std::exception.

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include <distoptim/rpc.h>

#include "harness/multiprocess.h"
#include "harness/rpc_workers.h"

namespace distoptim {
namespace rpc {
namespace store_failure_test {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using distoptim::testing::run_ranks;
using distoptim::testing::worker;

// The pid of the caller of swap_pids (0: none yet).
std::atomic<int64_t> g_caller_pid{0};
// Notes the caller's pid and replies with this process's.
DISTOPTIM_RPC_FUNCTION("swap_pids", [](int64_t caller_pid) {
  g_caller_pid = caller_pid;
  return static_cast<int64_t>(::getpid());
});
// Dies as SIGKILL would (no cleanup, the kernel closes the sockets), without replying.
DISTOPTIM_RPC_FUNCTION("die", [] { ::_exit(9); });

// Rank 0 serves the store on MASTER_PORT: errors about it name it so.
void expect_names_the_store(const c10::Error& error) {
  const std::string store = "the store at 127.0.0.1:" + std::string(std::getenv("MASTER_PORT"));
  EXPECT_NE(std::string(error.what()).find(store), std::string::npos) << error.what();
}

RpcBackendOptions options() {
  return RpcBackendOptions("env://").init_timeout(30s).shutdown_timeout(3s);
}

// Rank 1's graceful shutdown with the store host (rank 0) stopped, under `rpc_options`.
void shutdown_with_stopped_store_host(const RpcBackendOptions& rpc_options) {
  distoptim::testing::RunRanksOptions run_options;
  run_options.deadline = 60s;
  // Rank 1 stops rank 0's whole process: a process of its own.
  run_options.rank0_in_test_process = false;
  run_ranks(
      2,
      [&](int rank, int world_size) {
        init_rpc(worker(rank), rank, world_size, rpc_options);
        if (rank == 0) {
          // Stopped by rank 1, and continued once its shutdown has failed: serves until rank 1
          // has exited (a zombie until the harness reaps it, then gone).
          const auto until = Clock::now() + 20s;
          while (g_caller_pid.load() == 0 && Clock::now() < until)
            std::this_thread::sleep_for(10ms);
          ASSERT_NE(g_caller_pid.load(), 0) << "rank 1 never called";
          EXPECT_TRUE(distoptim::testing::wait_for_process_state(
              static_cast<int>(g_caller_pid.load()), "ZX?", 40s));
          shutdown(/*graceful=*/false);
          return;
        }
        const auto pid = static_cast<pid_t>(rpc_sync<int64_t>(
            worker(0), "swap_pids", std::tuple{static_cast<int64_t>(::getpid())}));
        // Every thread of it stopped: it answers nothing from here on.
        ASSERT_TRUE(distoptim::testing::stop_process(pid));
        const auto start = Clock::now();
        try {
          shutdown();
          ADD_FAILURE() << "expected a TimeoutError";
        } catch (const TimeoutError& e) {
          expect_names_the_store(e);
        }
        // The bound only proves that it did not hang.
        EXPECT_LT(Clock::now() - start, 20s);
        ::kill(pid, SIGCONT);
      },
      run_options);
}

TEST(RpcStoreFailure, GracefulShutdownWithStoppedStoreHostTimesOut) {
  shutdown_with_stopped_store_host(options());
}

// Without a shutdown_timeout, each store operation is bounded by the liveness timeout.
TEST(RpcStoreFailure, UnboundedGracefulShutdownWithStoppedStoreHostTimesOutPerOperation) {
  shutdown_with_stopped_store_host(options().shutdown_timeout(0s).liveness_timeout(2s));
}

TEST(RpcStoreFailure, GracefulShutdownWithDeadStoreHostNamesTheStore) {
  distoptim::testing::RunRanksOptions run_options;
  run_options.deadline = 60s;
  run_options.expected_exit_codes = {{0, 9}};
  run_ranks(
      2,
      [](int rank, int world_size) {
        init_rpc(worker(rank), rank, world_size, options());
        if (rank == 0) {
          std::this_thread::sleep_for(40s);  // Ends by die's _exit(9).
          return;
        }
        const auto pid = static_cast<pid_t>(rpc_sync<int64_t>(
            worker(0), "swap_pids", std::tuple{static_cast<int64_t>(::getpid())}));
        EXPECT_THROW(rpc_sync(worker(0), "die"), PeerLostError);
        // Dead: a zombie until the harness reaps it, then gone.
        ASSERT_TRUE(distoptim::testing::wait_for_process_state(pid, "Z?", 20s));
        const auto start = Clock::now();
        try {
          shutdown();
          ADD_FAILURE() << "expected a PeerLostError";
        } catch (const PeerLostError& e) {
          expect_names_the_store(e);
          EXPECT_NE(std::string(e.what()).find("'worker0' (rank 0) is lost"), std::string::npos)
              << e.what();
        }
        EXPECT_LT(Clock::now() - start, 20s);
      },
      run_options);
}

// A survivor that never called the dead store host (it only answered it) is told at shutdown
// which worker died, not only that the store is lost.
TEST(RpcStoreFailure, GracefulShutdownNamesADeadStoreHostItNeverCalled) {
  distoptim::testing::RunRanksOptions run_options;
  run_options.deadline = 60s;
  run_options.expected_exit_codes = {{0, 9}};
  run_ranks(
      2,
      [](int rank, int world_size) {
        init_rpc(worker(rank), rank, world_size, options().shutdown_timeout(0s));
        if (rank == 0) {
          rpc_sync<int64_t>(worker(1), "swap_pids", std::tuple{static_cast<int64_t>(::getpid())});
          ::_exit(9);
        }
        const auto until = Clock::now() + 20s;
        while (g_caller_pid.load() == 0 && Clock::now() < until) std::this_thread::sleep_for(10ms);
        ASSERT_NE(g_caller_pid.load(), 0) << "rank 0 never called";
        ASSERT_TRUE(distoptim::testing::wait_for_process_state(
            static_cast<int>(g_caller_pid.load()), "Z?", 20s));
        try {
          shutdown();
          ADD_FAILURE() << "expected a PeerLostError";
        } catch (const PeerLostError& e) {
          EXPECT_NE(std::string(e.what()).find("'worker0' (rank 0) is lost"), std::string::npos)
              << e.what();
        }
      },
      run_options);
}

}  // namespace store_failure_test
}  // namespace rpc
}  // namespace distoptim
