// RRefs and remote() across real processes on loopback (tests/harness): values, owners and users,
// forks to a third worker, distributed reference counting (the owner's table empties), creation
// errors, graceful shutdown with deletes in flight, and a user that dies. Every wait is bounded.

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/rnn.h>
#include <torch/utils.h>

#include <distoptim/rpc.h>

#include "harness/multiprocess.h"
#include "harness/rpc_workers.h"
#include "support/wait_until.h"

namespace distoptim {
namespace rpc {
namespace rref_test {

using namespace std::chrono_literals;
using distoptim::testing::run_ranks;
using distoptim::testing::test_options;
using distoptim::testing::wait_until;
using distoptim::testing::worker;

// The callables, registered in every process.
DISTOPTIM_RPC_FUNCTION("rref_add", [](int64_t a, int64_t b) { return a + b; });
DISTOPTIM_RPC_FUNCTION("rref_scale",
                       [](const at::Tensor& tensor, double factor) { return tensor * factor; });
DISTOPTIM_RPC_FUNCTION("rref_fail", [](const std::string& why) -> int64_t {
  TORCH_CHECK_VALUE(false, "refusing: ", why);
});
DISTOPTIM_RPC_FUNCTION("rref_sleep_ms", [](int64_t ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
});
DISTOPTIM_RPC_FUNCTION("owned_count",
                       [] { return static_cast<int64_t>(detail::owned_rref_count()); });
// On the owner an RRef argument arrives as a reference to the local value.
DISTOPTIM_RPC_FUNCTION("plus_one_on_owner", [](RRef<int64_t> rref) {
  TORCH_CHECK(rref.is_owner(), "expected to run on the owner");
  return rref.local_value() + 1;
});
// An RRef as a result: owned by the worker that made it.
DISTOPTIM_RPC_FUNCTION("make_rref", [](int64_t value) { return RRef<int64_t>(value); });
// On a third worker: a user of its own, which fetches the value (after a while, so that the
// sender may have dropped its reference meanwhile).
DISTOPTIM_RPC_FUNCTION("fetch_later", [](RRef<at::Tensor> rref, std::string owner,
                                         int64_t delay_ms) {
  TORCH_CHECK(!rref.is_owner(), "expected a user");
  TORCH_CHECK(rref.owner().name == owner, "owner ", rref.owner().name, ", expected ", owner);
  std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
  return rref.to_here();
});
// Passes the RRef on once more, to the owner's neighbour, returning what it fetched.
DISTOPTIM_RPC_FUNCTION("pass_on", [](RRef<at::Tensor> rref, std::string next) {
  return rpc_sync<at::Tensor>(next, "fetch_later", std::tuple{rref, rref.owner().name, 0});
});

// The parameter server of PyTorch's RNN tutorial (the seed's example): an embedding table and a
// decoder live on "ps"; the trainer creates them remotely and calls their forward.
struct EmbeddingTable : torch::nn::Module {
  EmbeddingTable(int64_t ntoken, int64_t ninp, double dropout)
      : encoder(register_module("encoder", torch::nn::Embedding(ntoken, ninp))),
        drop(register_module("drop", torch::nn::Dropout(dropout))) {
    torch::NoGradGuard no_grad;
    encoder->weight.uniform_(-0.1, 0.1);
  }
  at::Tensor forward(const at::Tensor& input) { return drop(encoder(input)); }
  // PyTorch's _parameter_rrefs: an RRef (owned here) to each parameter.
  std::vector<RRef<at::Tensor>> parameter_rrefs() {
    std::vector<RRef<at::Tensor>> rrefs;
    for (const at::Tensor& parameter : parameters()) rrefs.emplace_back(parameter);
    return rrefs;
  }
  std::vector<at::Tensor> parameter_values() { return parameters(); }

  torch::nn::Embedding encoder;
  torch::nn::Dropout drop;
};
DISTOPTIM_RPC_CLASS(EmbeddingTable, int64_t, int64_t, double);
DISTOPTIM_RPC_METHOD(EmbeddingTable, forward);
DISTOPTIM_RPC_METHOD(EmbeddingTable, parameter_rrefs);
DISTOPTIM_RPC_METHOD(EmbeddingTable, parameter_values);

struct Decoder : torch::nn::Module {
  Decoder(int64_t ntoken, int64_t nhid, double dropout)
      : decoder(register_module("decoder", torch::nn::Linear(nhid, ntoken))),
        drop(register_module("drop", torch::nn::Dropout(dropout))) {
    torch::NoGradGuard no_grad;
    decoder->bias.zero_();
    decoder->weight.uniform_(-0.1, 0.1);
  }
  at::Tensor forward(const at::Tensor& output) { return decoder(drop(output)); }
  std::vector<RRef<at::Tensor>> parameter_rrefs() {
    std::vector<RRef<at::Tensor>> rrefs;
    for (const at::Tensor& parameter : parameters()) rrefs.emplace_back(parameter);
    return rrefs;
  }
  std::vector<at::Tensor> parameter_values() { return parameters(); }

  torch::nn::Linear decoder;
  torch::nn::Dropout drop;
};
DISTOPTIM_RPC_CLASS(Decoder, int64_t, int64_t, double);
DISTOPTIM_RPC_METHOD(Decoder, forward);
DISTOPTIM_RPC_METHOD(Decoder, parameter_rrefs);
DISTOPTIM_RPC_METHOD(Decoder, parameter_values);

// On the owner, an RRef to an object gives the object itself.
DISTOPTIM_RPC_FUNCTION("embedding_rows", [](RRef<EmbeddingTable> table) {
  TORCH_CHECK(table.is_owner(), "expected to run on the owner");
  std::shared_ptr<EmbeddingTable> object = table.local_value();
  return object->encoder->weight.size(0);
});

// Polls `worker`'s owner table until it is empty; whether it emptied within `limit`.
bool owner_table_empties(const std::string& owner, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (rpc_sync<int64_t>(owner, "owned_count") == 0) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

TEST(RRef, RemoteValuesOwnersAndUsers) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options());
    if (rank == 0) {
      RRef<int64_t> sum = remote<int64_t>("worker1", "rref_add", std::tuple{40, 2});
      EXPECT_EQ(sum.owner(), get_worker_info("worker1"));
      EXPECT_FALSE(sum.is_owner());
      EXPECT_EQ(sum.to_here(), 42);
      EXPECT_EQ(sum.to_here(5s), 42);  // fetched again, the value is still there
      EXPECT_THROW(sum.local_value(), c10::ValueError);

      at::Tensor t = at::arange(6, at::kFloat).view({2, 3});
      auto scaled = remote<at::Tensor>(1, "rref_scale", std::tuple{t, 3.0});  // by id
      EXPECT_TRUE(at::equal(scaled.to_here(), t * 3));

      // Owned here: remote() to itself, and RRef(value).
      auto mine = remote<int64_t>("worker0", "rref_add", std::tuple{1, 2});
      EXPECT_TRUE(mine.is_owner());
      EXPECT_EQ(mine.local_value(), 3);
      EXPECT_EQ(mine.to_here(), 3);
      RRef<at::Tensor> local(t);
      EXPECT_TRUE(local.is_owner());
      EXPECT_EQ(local.owner().name, "worker0");
      EXPECT_EQ(local.local_value().data_ptr(), t.data_ptr());  // the value itself, not a copy

      // To the owner an RRef arrives as the local value; as a result it arrives as a user.
      EXPECT_EQ(rpc_sync<int64_t>("worker1", "plus_one_on_owner", std::tuple{sum}), 43);
      auto made = rpc_sync<RRef<int64_t>>("worker1", "make_rref", std::tuple{7});
      EXPECT_EQ(made.owner().name, "worker1");
      EXPECT_FALSE(made.is_owner());
      EXPECT_EQ(made.to_here(), 7);
      // Copies share one reference; the value is still there after the first copy goes.
      {
        RRef<int64_t> copy = made;
        EXPECT_EQ(copy.to_here(), 7);
      }
      EXPECT_EQ(made.to_here(), 7);
      // An RRef to oneself through the owner of another: worker1 gets a user of worker0's value.
      EXPECT_EQ(rpc_sync<int64_t>("worker0", "plus_one_on_owner", std::tuple{mine}), 4);
    }
    shutdown();
    EXPECT_EQ(detail::owned_rref_count(), 0u);
  });
}

TEST(RRef, ForksToAThirdWorkerAndOnward) {
  run_ranks(3, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options());
    if (rank == 0) {
      at::Tensor t = at::randn({4, 5});
      auto rref = remote<at::Tensor>("worker1", "rref_scale", std::tuple{t, 2.0});
      // A fork to worker2, which fetches from worker1 itself.
      EXPECT_TRUE(at::equal(rpc_sync<at::Tensor>("worker2", "fetch_later",
                                                 std::tuple{rref, std::string("worker1"), 0}),
                            t * 2));
      // Forks of forks: worker2 passes it on to worker0 (ourselves, a second user here).
      EXPECT_TRUE(at::equal(
          rpc_sync<at::Tensor>("worker2", "pass_on", std::tuple{rref, std::string("worker0")}),
          t * 2));
      // The sender drops its reference while the fork is still on its way and worker2 fetches
      // later: the value must survive until worker2 is done with it. fetch_later's 300 ms make
      // it likely, not certain, that the owner handles the sender's delete before worker2's
      // fetch: nothing a test can wait on says the owner has handled a delete. Either order must
      // keep the value.
      RpcFuture<at::Tensor> later = [&] {
        auto dropped = remote<at::Tensor>("worker1", "rref_scale", std::tuple{t, 5.0});
        return rpc_async<at::Tensor>("worker2", "fetch_later",
                                     std::tuple{dropped, std::string("worker1"), 300});
      }();
      EXPECT_TRUE(at::equal(later.wait(), t * 5));
      rref = RRef<at::Tensor>();
      EXPECT_TRUE(owner_table_empties("worker1", 20s));
    }
    shutdown();
  });
}

TEST(RRef, CreatingAndDropping10000ValuesLeavesTheOwnerTableEmpty) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options());
    if (rank == 0) {
      std::vector<RRef<int64_t>> kept;
      for (int64_t i = 0; i < 10000; ++i) {
        auto rref = remote<int64_t>("worker1", "rref_add", std::tuple{i, 1});
        if (i % 1000 == 0) kept.push_back(rref);
      }
      for (size_t k = 0; k < kept.size(); ++k) {
        EXPECT_EQ(kept[k].to_here(), static_cast<int64_t>(k) * 1000 + 1);
      }
      // The fetches above followed the creations in order, so the kept ones are registered.
      EXPECT_GE(rpc_sync<int64_t>("worker1", "owned_count"), static_cast<int64_t>(kept.size()));
      kept.clear();
      EXPECT_TRUE(owner_table_empties("worker1", 60s));
    }
    shutdown();
  });
}

TEST(RRef, CreationErrorsArriveAtToHere) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options());
    if (rank == 0) {
      auto failing = remote<int64_t>("worker1", "rref_fail", std::tuple{std::string("no value")});
      try {
        failing.to_here();
        ADD_FAILURE() << "no error";
      } catch (const RemoteError& error) {
        EXPECT_EQ(error.worker_name(), "worker1");
        EXPECT_NE(error.remote_message().find("refusing: no value"), std::string::npos)
            << error.remote_message();
      }
      auto unknown = remote<int64_t>("worker1", "no_such_function");
      try {
        unknown.to_here();
        ADD_FAILURE() << "no error";
      } catch (const RemoteError& error) {
        EXPECT_NE(
            error.remote_message().find("no function or class is registered as 'no_such_function'"),
            std::string::npos)
            << error.remote_message();
      }
      auto failing_here = remote<int64_t>("worker0", "rref_fail", std::tuple{std::string("here")});
      EXPECT_THROW(failing_here.local_value(), RemoteError);
      auto wrong_type = remote<std::string>("worker1", "rref_add", std::tuple{1, 2});
      EXPECT_THROW(wrong_type.to_here(), c10::TypeError);
      // remote() past its timeout: confirm() waits until the creation has failed (its own 100 ms
      // timeout ends it, long before confirm's 10 s bound) and throws that error; to_here then
      // reports it too, without asking the owner.
      auto slow = remote<int64_t>("worker1", "rref_sleep_ms", std::tuple{1500}, 100ms);
      EXPECT_THROW(slow.confirm(10s), TimeoutError);
      EXPECT_FALSE(slow.confirmed_by_owner());
      EXPECT_THROW(slow.to_here(), TimeoutError);
      // to_here past its own timeout.
      auto slower = remote<int64_t>("worker1", "rref_sleep_ms", std::tuple{1500}, kNoTimeout);
      EXPECT_THROW(slower.to_here(100ms), TimeoutError);
      EXPECT_EQ(slower.to_here(10s), 1500);
      // Bad input, refused at once.
      EXPECT_THROW(remote<int64_t>("nobody", "rref_add", std::tuple{1, 2}), c10::ValueError);
      EXPECT_THROW(remote<int64_t>("worker1", "rref_add", std::tuple{1, 2}, -3ms), c10::ValueError);
      EXPECT_THROW(remote<int64_t>("worker1", "__distoptim.rref.fetch"), c10::ValueError);
      EXPECT_THROW(RRef<int64_t>().to_here(), c10::ValueError);
      EXPECT_THROW(rpc_sync("worker1", "rref_add", std::tuple{RRef<int64_t>(), 1}),
                   c10::ValueError);
      EXPECT_THROW(rpc_sync("worker1", "__distoptim.rref.fetch", std::tuple{0, 0}), RemoteError);
      EXPECT_THROW(register_function("__distoptim.mine", [] { return 1; }), c10::ValueError);
      // The worker still serves.
      EXPECT_EQ(remote<int64_t>("worker1", "rref_add", std::tuple{2, 3}).to_here(), 5);
    }
    shutdown();
    EXPECT_EQ(detail::owned_rref_count(), 0u);
  });
}

TEST(RRef, GracefulShutdownWaitsForPendingDeletes) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options());
    std::vector<RRef<int64_t>> kept;
    if (rank == 0) {
      for (int64_t i = 0; i < 200; ++i) {
        auto rref = remote<int64_t>("worker1", "rref_add", std::tuple{i, i});
        if (i % 2 == 0) kept.push_back(rref);  // the others are dropped at once
      }
    }
    // Deletes of the dropped ones are still in flight, and `kept` outlives the agent: graceful
    // shutdown deletes those too before the owner stops.
    shutdown();
    EXPECT_EQ(detail::owned_rref_count(), 0u);
    kept.clear();  // inert now
  });
}

TEST(RRef, TheOwnerForgetsTheForksOfADeadUser) {
  distoptim::testing::RunRanksOptions options;
  options.expected_exit_codes = {{1, 7}};
  run_ranks(
      2,
      [](int rank, int world_size) {
        init_rpc(worker(rank), rank, world_size, test_options());
        if (rank == 1) {
          std::vector<RRef<int64_t>> held;
          for (int64_t i = 0; i < 10; ++i) {
            held.push_back(remote<int64_t>("worker0", "rref_add", std::tuple{i, 1}));
          }
          EXPECT_EQ(held.back().to_here(), 10);
          ::_exit(7);  // Dies holding every reference.
        }
        const auto deadline = std::chrono::steady_clock::now() + 20s;
        while (detail::owned_rref_count() == 0 && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(10ms);
        }
        while (detail::owned_rref_count() != 0 && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(10ms);
        }
        EXPECT_EQ(detail::owned_rref_count(), 0u);
        shutdown(/*graceful=*/false);
      },
      options);
}

// Requests worker 1 sends to worker 0 when worker 0 asks: `hold` keeps its thread until its
// id's bit is released (bounded), `note` returns at once; both record their id as they start.
// `touch` must never run; worker 1's RRef goes back to worker 0 with it.
std::atomic<int> g_holding{0};
std::atomic<uint64_t> g_released{0};
std::mutex g_started_mutex;
std::vector<int64_t> g_started;
std::atomic<int> g_touched{0};
std::atomic<bool> g_user_ready{false};
std::optional<RRef<int64_t>> g_user_rref;
void note_start(int64_t id) {
  std::lock_guard<std::mutex> lock(g_started_mutex);
  g_started.push_back(id);
}
DISTOPTIM_RPC_FUNCTION("hold", [](int64_t id) {
  note_start(id);
  ++g_holding;
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while ((g_released.load() & (uint64_t{1} << id)) == 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(5ms);
  }
  --g_holding;
  return id;
});
DISTOPTIM_RPC_FUNCTION("note", [](int64_t id) {
  note_start(id);
  return id;
});
DISTOPTIM_RPC_FUNCTION("touch", [](RRef<int64_t> rref) {
  ++g_touched;
  return rref.local_value();
});
DISTOPTIM_RPC_FUNCTION("user_ready", [] {
  g_user_ready = true;
  return int64_t{0};
});
DISTOPTIM_RPC_FUNCTION("send_call", [](const std::string& callable, int64_t id) {
  (void)rpc_async<int64_t>("worker0", callable, std::tuple{id});
  return static_cast<int64_t>(::getpid());
});
DISTOPTIM_RPC_FUNCTION("send_hold_and_touch", [] {
  (void)rpc_async<int64_t>("worker0", "hold", std::tuple{int64_t{0}});
  (void)rpc_async<int64_t>("worker0", "touch", std::tuple{*g_user_rref});
  return int64_t{0};
});

TEST(RRef, QueuedRequestsOfADeadUserNeverRun) {
  // Worker 0 runs requests on one pool thread besides the I/O loop's. Worker 0 has worker 1
  // send held calls one at a time until both threads that run requests are busy or one waits in
  // the pool (requests start in the order they arrived: none read later can start before it);
  // then one more and a call passing back an RRef worker 0 owns. Once all arrived it SIGKILLs
  // worker 1, and releases the held calls after worker 1's connections ended: no queued call
  // may run. Run late, the RRef would be owned again with no fork left to free it.
  distoptim::testing::RunRanksOptions options;
  options.expected_signals = {{1, SIGKILL}};
  run_ranks(
      2,
      [](int rank, int world_size) {
        rpc::RpcBackendOptions rpc_options = test_options();
        if (rank == 0) rpc_options.num_worker_threads(1);
        init_rpc(worker(rank), rank, world_size, rpc_options);
        if (rank == 1) {
          g_user_rref = rpc_sync<RRef<int64_t>>("worker0", "make_rref", std::tuple{int64_t{5}});
          (void)rpc_sync<int64_t>("worker0", "user_ready", std::tuple{});
          std::this_thread::sleep_for(60s);  // killed by worker 0 before this ends
          ::_exit(4);
        }
        std::map<std::string, int64_t> info;
        auto in_flight = [&](int64_t count) {
          return [&, count] {
            info = get_debug_info();
            return info["agent.num_requests_in_flight"] == count;
          };
        };
        ASSERT_TRUE(wait_until([] { return g_user_ready.load(); }, 20s));
        ASSERT_TRUE(wait_until(in_flight(0), 20s));
        pid_t user = 0;
        int64_t sent = 0;
        while (sent < 20) {
          user = static_cast<pid_t>(rpc_sync<int64_t>("worker1", "send_call",
                                                      std::tuple{std::string("hold"), int64_t{0}}));
          ++sent;
          ASSERT_TRUE(wait_until(in_flight(sent), 20s)) << info["agent.num_requests_in_flight"];
          (void)wait_until([&] { return g_holding.load() == sent; }, 200ms);
          if (g_holding.load() == 2 || g_holding.load() < sent) break;
        }
        ASSERT_TRUE(g_holding.load() == 2 || g_holding.load() < sent) << sent << " sent";
        (void)rpc_sync<int64_t>("worker1", "send_hold_and_touch", std::tuple{});
        ASSERT_TRUE(wait_until(in_flight(sent + 2), 20s)) << info["agent.num_requests_in_flight"];
        ASSERT_EQ(::kill(user, SIGKILL), 0);
        EXPECT_TRUE(wait_until([&] { return get_debug_info()["connections"] == 0; }, 20s))
            << "worker 0 never saw worker 1's connections end";
        // Every call that had not started is dropped.
        const int64_t started = g_holding.load();
        g_released = ~uint64_t{0};
        (void)wait_until(
            [&] {
              info = get_debug_info();
              return info["num_owner_rrefs"] == 0 && info["num_forks"] == 0 &&
                     info["agent.num_requests_in_flight"] == 0 &&
                     info["agent.num_dropped_requests"] == sent + 2 - started;
            },
            20s);
        EXPECT_EQ(info["num_owner_rrefs"], 0);
        EXPECT_EQ(info["num_forks"], 0);
        EXPECT_EQ(info["agent.num_requests_in_flight"], 0);
        EXPECT_EQ(info["agent.num_dropped_requests"], sent + 2 - started);
        EXPECT_EQ(static_cast<int64_t>(g_started.size()), started);
        EXPECT_EQ(g_touched.load(), 0);
        shutdown(/*graceful=*/false);
      },
      options);
}

TEST(RequestOrder, RequestsStartInTheOrderTheyArrived) {
  // Worker 0 runs requests on one pool thread and one I/O thread at a time. Both hold a call;
  // a third waits in the pool. When the I/O thread's call returns, that thread waits to lead
  // again and could run the next request read at once: it must not start before the one queued.
  run_ranks(2, [](int rank, int world_size) {
    rpc::RpcBackendOptions rpc_options = test_options();
    if (rank == 0) rpc_options.num_worker_threads(1);
    init_rpc(worker(rank), rank, world_size, rpc_options);
    if (rank == 0) {
      auto send = [](const std::string& callable, int64_t id) {
        (void)rpc_sync<int64_t>("worker1", "send_call", std::tuple{callable, id});
      };
      auto in_flight = [](int64_t count) {
        return [count] { return get_debug_info()["agent.num_requests_in_flight"] == count; };
      };
      ASSERT_TRUE(wait_until(in_flight(0), 20s));
      send("hold", 1);
      ASSERT_TRUE(wait_until([] { return g_holding.load() == 1; }, 20s));
      send("hold", 2);  // on whichever of the two threads is free
      ASSERT_TRUE(wait_until([] { return g_holding.load() == 2; }, 20s));
      send("note", 3);  // queued: both threads are busy
      ASSERT_TRUE(wait_until(in_flight(3), 20s));
      g_released |= uint64_t{1} << 1;
      ASSERT_TRUE(wait_until([] { return g_holding.load() == 1; }, 20s));
      // Makes it likely that the freed thread is back waiting for work before 4 arrives: that wait
      // is inside the library's pool and I/O loop, which report no idle thread to wait for.
      std::this_thread::sleep_for(50ms);
      send("note", 4);
      // Time for 4 to arrive (if the freed thread was the pool's, 3 ran already and this waits
      // in vain: the order holds either way).
      (void)wait_until(in_flight(3), 1s);
      g_released |= uint64_t{1} << 2;
      ASSERT_TRUE(wait_until(
          [&] {
            std::lock_guard<std::mutex> lock(g_started_mutex);
            return g_started.size() == 4;
          },
          20s));
      std::lock_guard<std::mutex> lock(g_started_mutex);
      EXPECT_EQ(g_started, (std::vector<int64_t>{1, 2, 3, 4}));
    }
    shutdown();
  });
}

TEST(RemoteClasses, ParameterServerModulesCreatedAndCalledThroughRRefs) {
  run_ranks(2, [](int rank, int world_size) {
    const std::string name = rank == 0 ? "ps" : "trainer";
    init_rpc(name, rank, world_size, test_options());
    if (rank == 1) {
      constexpr int64_t kTokens = 10, kInputs = 4, kHidden = 6;
      auto table =
          remote<EmbeddingTable>("ps", "EmbeddingTable", std::tuple{kTokens, kInputs, 0.0});
      auto decoder = remote<Decoder>("ps", "Decoder", std::tuple{kTokens, kHidden, 0.0});
      EXPECT_EQ(table.owner().name, "ps");
      EXPECT_FALSE(table.is_owner());

      // The trainer's forward: remote embedding, local LSTM, remote decoder.
      const at::Tensor input = at::randint(kTokens, {5, 3}, at::kLong);
      const at::Tensor emb = table.rpc_sync().method<at::Tensor>("forward", input);
      torch::nn::LSTM lstm(torch::nn::LSTMOptions(kInputs, kHidden));
      const at::Tensor output = std::get<0>(lstm(emb));
      const at::Tensor decoded = decoder.rpc_sync().method<at::Tensor>("forward", output);
      EXPECT_EQ(decoded.sizes(), (at::IntArrayRef{5, 3, kTokens}));

      // Against the parameters the modules hold on ps.
      const auto table_params =
          table.rpc_sync().method<std::vector<at::Tensor>>("parameter_values");
      const auto decoder_params =
          decoder.rpc_async().method<std::vector<at::Tensor>>("parameter_values").wait();
      ASSERT_EQ(table_params.size(), 1u);
      ASSERT_EQ(decoder_params.size(), 2u);
      EXPECT_TRUE(at::allclose(emb, at::embedding(table_params[0], input)));
      EXPECT_TRUE(at::allclose(decoded, at::linear(output, decoder_params[0], decoder_params[1])));

      // parameter_rrefs: RRefs owned by ps whose values are the modules' parameters.
      auto param_rrefs = table.rpc_sync().method<std::vector<RRef<at::Tensor>>>("parameter_rrefs");
      param_rrefs.push_back(
          decoder.rpc_sync().method<std::vector<RRef<at::Tensor>>>("parameter_rrefs")[0]);
      param_rrefs.push_back(
          decoder.rpc_sync().method<std::vector<RRef<at::Tensor>>>("parameter_rrefs")[1]);
      std::vector<at::Tensor> expected = table_params;
      expected.insert(expected.end(), decoder_params.begin(), decoder_params.end());
      ASSERT_EQ(param_rrefs.size(), 3u);
      for (size_t i = 0; i < param_rrefs.size(); ++i) {
        EXPECT_EQ(param_rrefs[i].owner().name, "ps");
        EXPECT_FALSE(param_rrefs[i].is_owner());
        EXPECT_TRUE(at::equal(param_rrefs[i].to_here(), expected[i])) << "parameter " << i;
      }

      // remote() through the proxy, and an RRef to an object passed back to its owner.
      auto remote_emb = table.remote().method<at::Tensor>("forward", input);
      EXPECT_TRUE(at::equal(remote_emb.to_here(), emb));
      EXPECT_EQ(remote_emb.owner().name, "ps");
      EXPECT_EQ(rpc_sync<int64_t>("ps", "embedding_rows", std::tuple{table}), kTokens);

      // Clear remote errors naming what is unknown.
      try {
        table.rpc_sync().method<at::Tensor>("backward", input);
        ADD_FAILURE() << "no error";
      } catch (const RemoteError& error) {
        EXPECT_EQ(error.worker_name(), "ps");
        EXPECT_NE(error.remote_message().find("class 'EmbeddingTable' has no method 'backward'"),
                  std::string::npos)
            << error.remote_message();
      }
      auto unknown = remote<EmbeddingTable>("ps", "NoSuchModule", std::tuple{1, 2});
      try {
        unknown.rpc_sync().method<at::Tensor>("forward", input);
        ADD_FAILURE() << "no error";
      } catch (const RemoteError& error) {
        EXPECT_NE(error.remote_message().find("no function or class is registered as "
                                              "'NoSuchModule'"),
                  std::string::npos)
            << error.remote_message();
      }
      try {
        table.rpc_sync().method<at::Tensor>("forward", std::string("not a tensor"));
        ADD_FAILURE() << "no error";
      } catch (const RemoteError& error) {
        EXPECT_NE(error.remote_message().find(
                      "argument 0 of 'EmbeddingTable.forward': expected Tensor, got String"),
                  std::string::npos)
            << error.remote_message();
      }
      auto not_an_object = remote<int64_t>("ps", "rref_add", std::tuple{1, 2});
      EXPECT_THROW(RRef<EmbeddingTable>(not_an_object.handle()).rpc_sync().method("forward", input),
                   RemoteError);
      // Objects never travel: fetching one is refused by the owner.
      EXPECT_THROW(RRef<c10::IValue>(table.handle()).to_here(), RemoteError);

      table = RRef<EmbeddingTable>();
      decoder = RRef<Decoder>();
      param_rrefs.clear();
      remote_emb = RRef<at::Tensor>();
      unknown = RRef<EmbeddingTable>();
      not_an_object = RRef<int64_t>();
      EXPECT_TRUE(owner_table_empties("ps", 20s));
    }
    shutdown();
  });
}

// 48 remote() creations on one worker, then at once 48 method calls on them,
// with 4 pool threads, used to lose the live connection ("eof") in some runs. Repeated, the
// connection holds and every call returns its own object's result.
TEST(RemoteClasses, BurstOfCreationsThenCallsKeepsTheConnection) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(rank == 0 ? "ps" : "trainer", rank, world_size, test_options().num_worker_threads(4));
    if (rank == 1) {
      constexpr int kObjects = 48;
      for (int round = 0; round < 5; ++round) {
        std::vector<RRef<EmbeddingTable>> tables;
        for (int i = 0; i < kObjects; ++i) {
          tables.push_back(remote<EmbeddingTable>("ps", "EmbeddingTable",
                                                  std::tuple{int64_t{8 + i}, int64_t{4}, 0.0}));
        }
        std::vector<RpcFuture<int64_t>> rows;
        for (auto& table : tables) {
          rows.push_back(rpc_async<int64_t>("ps", "embedding_rows", std::tuple{table}));
        }
        for (int i = 0; i < kObjects; ++i) {
          EXPECT_EQ(rows[i].wait(), 8 + i) << "round " << round << ", object " << i;
        }
      }
    }
    shutdown();
  });
}

// confirm() shows a construction error at construction, naming the owner; confirmed_by_owner()
// turns true once the owner has created the value; owner_name() is the owner's name.
TEST(RRef, ConfirmShowsConstructionErrorsAtConstruction) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options());
    if (rank == 0) {
      auto good = remote<int64_t>("worker1", "rref_sleep_ms", std::tuple{int64_t{200}});
      EXPECT_EQ(good.owner_name(), "worker1");
      good.confirm();
      EXPECT_TRUE(good.confirmed_by_owner());
      EXPECT_EQ(good.to_here(), 200);
      auto bad = remote<int64_t>("worker1", "rref_fail", std::tuple{std::string("bad option")});
      try {
        bad.confirm();
        ADD_FAILURE() << "confirm() did not throw";
      } catch (const RemoteError& error) {
        EXPECT_EQ(error.worker_name(), "worker1");
        EXPECT_NE(error.remote_message().find("refusing: bad option"), std::string::npos)
            << error.remote_message();
      }
      EXPECT_FALSE(bad.confirmed_by_owner());
      RRef<int64_t> mine(int64_t{5});
      EXPECT_TRUE(mine.confirmed_by_owner());
      EXPECT_EQ(mine.owner_name(), "worker0");
      mine.confirm();
    }
    shutdown();
  });
}

// Late replies: the callee answers only once the caller, its call timed out, has let that many
// replies go (late_reply_go); bounded by 30 s.
std::atomic<int64_t> g_late_replies_let_go{0};
DISTOPTIM_RPC_FUNCTION("late_reply_go", [] { return ++g_late_replies_let_go; });
void await_late_reply_go(int64_t count) {
  (void)wait_until([count] { return g_late_replies_let_go.load() >= count; }, 30s);
}

// Replies carrying RRefs that arrive after their call timed out are not
// dropped undecoded: their RRefs are released, and the owner's table empties.
std::vector<RRef<int64_t>> make_rrefs_late(int64_t value) {
  await_late_reply_go(value + 1);
  return {RRef<int64_t>(value), RRef<int64_t>(value + 1)};
}
DISTOPTIM_RPC_FUNCTION("make_rref_late", make_rrefs_late);

TEST(RRef, LateRepliesReleaseTheirRRefs) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options());
    if (rank == 0) {
      for (int64_t i = 0; i < 8; ++i) {
        auto late =
            rpc_async<std::vector<RRef<int64_t>>>("worker1", "make_rref_late", std::tuple{i}, 50ms);
        EXPECT_THROW(late.wait(), TimeoutError);
        rpc_sync<int64_t>("worker1", "late_reply_go");
      }
      EXPECT_TRUE(owner_table_empties("worker1", 20s));
    }
    shutdown();
  });
}

// A call through an RRef to its owner is settled by its reply (MessageHeader::kAcceptedByReply):
// no accept message follows it, and the caller holds nothing once the call returns. One that
// times out is settled by its late reply; the value stays whole for the call meanwhile, though
// the caller dropped its reference.
std::atomic<int64_t> g_late_successes{0};
DISTOPTIM_RPC_FUNCTION("plus_one_late", [](RRef<int64_t> rref) {
  await_late_reply_go(1);
  const int64_t value = rref.local_value() + 1;
  g_late_successes.fetch_add(1);
  return value;
});
DISTOPTIM_RPC_FUNCTION("late_successes", [] { return g_late_successes.load(); });

int64_t pending_children() { return get_debug_info().at("num_pending_children"); }

TEST(RRef, CallsThroughAnRRefToItsOwnerAreSettledByTheirReply) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options());
    if (rank == 0) {
      {
        RRef<int64_t> sum = remote<int64_t>("worker1", "rref_add", std::tuple{40, 2});
        for (int i = 0; i < 20; ++i) {
          EXPECT_EQ(rpc_sync<int64_t>("worker1", "plus_one_on_owner", std::tuple{sum}), 43);
          EXPECT_EQ(pending_children(), 0) << "after call " << i;
        }
        auto late = rpc_async<int64_t>("worker1", "plus_one_late", std::tuple{sum}, 50ms);
        EXPECT_THROW(late.wait(), TimeoutError);
        EXPECT_EQ(pending_children(), 1);  // until the late reply comes
      }
      rpc_sync<int64_t>("worker1", "late_reply_go");  // once the caller dropped `sum`
      const auto deadline = std::chrono::steady_clock::now() + 20s;
      while (pending_children() != 0 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(10ms);
      }
      EXPECT_EQ(pending_children(), 0);
      EXPECT_TRUE(owner_table_empties("worker1", 20s));
      EXPECT_EQ(rpc_sync<int64_t>("worker1", "late_successes"), 1);
    }
    shutdown();
    EXPECT_EQ(detail::owned_rref_count(), 0u);
  });
}

// A creator killed with remote() requests in flight: the owner drops the forks
// of the dead worker, also those whose create messages it handles after learning of the death.
TEST(RRef, KilledCreatorsRemotesDrain) {
  distoptim::testing::RunRanksOptions options;
  options.expected_exit_codes = {{1, 9}};
  run_ranks(
      2,
      [](int rank, int world_size) {
        init_rpc(worker(rank), rank, world_size, test_options());
        if (rank == 1) {
          std::vector<RRef<int64_t>> held;
          for (int64_t i = 0; i < 300; ++i) {
            held.push_back(remote<int64_t>("worker0", "rref_add", std::tuple{i, 1}));
          }
          ::_exit(9);  // Dies with creations in flight.
        }
        const auto deadline = std::chrono::steady_clock::now() + 20s;
        // Some creations arrive; then, the creator being dead, every one is dropped.
        while (detail::owned_rref_count() == 0 && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(5ms);
        }
        while (detail::owned_rref_count() != 0 && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(10ms);
        }
        EXPECT_EQ(detail::owned_rref_count(), 0u);
        shutdown(/*graceful=*/false);
      },
      options);
}

// An RRef<T> carries the name of T on the wire, and the owner checks it
// against the value: a mismatch fails the call with a c10::TypeError naming both types and the
// worker, which reaches the caller as a RemoteError.
DISTOPTIM_RPC_FUNCTION("string_on_owner",
                       [](RRef<std::string> rref) { return rref.local_value(); });

TEST(RRef, TypeNamesAreCheckedAtTheOwner) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options());
    if (rank == 0) {
      auto number = remote<int64_t>("worker1", "rref_add", std::tuple{int64_t{1}, int64_t{2}});
      number.confirm();
      EXPECT_EQ(rpc_sync<int64_t>("worker1", "plus_one_on_owner", std::tuple{number}), 4);
      RRef<std::string> wrong(number.handle());
      try {
        rpc_sync<std::string>("worker1", "string_on_owner", std::tuple{wrong});
        ADD_FAILURE() << "a mismatched RRef type passed";
      } catch (const RemoteError& error) {
        EXPECT_EQ(error.worker_name(), "worker1");
        EXPECT_NE(error.remote_message().find("worker 'worker0' sent RRef"), std::string::npos)
            << error.remote_message();
        EXPECT_NE(error.remote_message().find("as RRef<str>, but its value on worker 'worker1' "
                                              "is int"),
                  std::string::npos)
            << error.remote_message();
      }
    }
    shutdown();
  });
}

TEST(RemoteClassesUnit, RegistrationIsCheckedAndObjectsConvertByType) {
  EXPECT_THROW((register_class<EmbeddingTable, int64_t, int64_t, double>("EmbeddingTable")),
               c10::ValueError);  // taken
  EXPECT_THROW(register_method<Decoder>("Decoder", "forward", &Decoder::forward), c10::ValueError);
  EXPECT_EQ(registered_class_name(typeid(Decoder)), "Decoder");
  EXPECT_THROW(registered_class_name(typeid(std::string)), c10::TypeError);
  const c10::IValue object = to_value(std::make_shared<Decoder>(3, 2, 0.0));
  EXPECT_NE(from_value<std::shared_ptr<Decoder>>(object, "x"), nullptr);
  EXPECT_THROW(from_value<std::shared_ptr<EmbeddingTable>>(object, "x"), c10::TypeError);
}

}  // namespace rref_test
}  // namespace rpc
}  // namespace distoptim
