// Requests that wait on other requests, across real processes on loopback (tests/harness): chains
// of nested calls ping-ponging between two workers, many more of them than the request pool has
// threads, made by handlers that block (the pool compensates) and by async_execution handlers
// (that hold no thread); a method call on an object still being created; shutdown() called from a
// handler; a request that blocks outside the library. And, on their own, the request pool's
// compensation and the I/O loop's turns (a job keeping the loop, losing it, leading it while it
// waits). Every wait is bounded.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>

#include <distoptim/rpc.h>

#include "calling_thread.h"
#include "executor.h"
#include "harness/multiprocess.h"
#include "harness/rpc_workers.h"
#include "transport/io_loop.h"

namespace distoptim {
namespace rpc {
namespace nested_test {

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

DISTOPTIM_RPC_FUNCTION("nested_fail", [](const std::string& why) -> int64_t {
  TORCH_CHECK_VALUE(false, "refusing: ", why);
});
// An async_execution function whose future fails.
DISTOPTIM_RPC_FUNCTION("fail_async", [](const std::string& why) {
  return rpc_async<int64_t>(other_worker(), "nested_fail", std::tuple{why});
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

DISTOPTIM_RPC_FUNCTION("thread_count",
                       [] { return static_cast<int64_t>(distoptim::testing::thread_count()); });

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

// A gate a request waits at with the user's own lock, not the library's: the request keeps the I/O
// thread that read it, and the request that opens the gate can only be read once the loop's other
// thread has taken the loop over (io_loop.h).
struct Gate {
  std::mutex mutex;
  std::condition_variable opened_cv;
  bool opened = false;
};
Gate& gate() {
  static Gate gate;
  return gate;
}
DISTOPTIM_RPC_FUNCTION("wait_at_gate", [] {
  std::unique_lock<std::mutex> lock(gate().mutex);
  return gate().opened_cv.wait_for(lock, 30s, [] { return gate().opened; });
});
DISTOPTIM_RPC_FUNCTION("open_gate", [] {
  {
    std::lock_guard<std::mutex> lock(gate().mutex);
    gate().opened = true;
  }
  gate().opened_cv.notify_all();
  return true;
});
// Waits in a request for a future completed on the completion thread (a then() callback), not on
// the I/O thread that leads the loop while the request waits.
DISTOPTIM_RPC_FUNCTION("add_two_then_wait", [](int64_t a) {
  return rpc_async<int64_t>(other_worker(), "add_one", std::tuple{a})
      .then([](int64_t a_plus_one) { return a_plus_one + 1; })
      .wait();
});

// A request waiting under its own thread-local state (here inference mode) for a reply its thread
// reads: the reply is decoded as on any I/O thread, into an ordinary tensor.
DISTOPTIM_RPC_FUNCTION("ones", [] { return at::ones({4}); });
DISTOPTIM_RPC_FUNCTION("fetch_in_inference_mode", [] {
  c10::InferenceMode inference_mode;
  const at::Tensor fetched = rpc_sync<at::Tensor>(other_worker(), "ones");
  return !fetched.is_inference() && fetched.equal(at::ones({4}));
});

TEST(NestedCalls, RequestsThatBlockOrWaitOnTheIoThreadLeaveTheWorkerServing) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options().rpc_timeout(60s));
    if (rank == 0) {
      for (int round = 0; round < 3; ++round) {
        auto waiting = rpc_async<bool>("worker1", "wait_at_gate");
        EXPECT_TRUE(rpc_sync<bool>("worker1", "open_gate"));
        EXPECT_TRUE(waiting.wait()) << "round " << round << ": the gate never opened";
        EXPECT_EQ(rpc_sync<int64_t>("worker1", "add_two_then_wait", std::tuple{int64_t{round}}),
                  round + 2);
        EXPECT_TRUE(rpc_sync<bool>("worker1", "fetch_in_inference_mode"));
      }
    }
    shutdown();
  });
}

// Which threads read the replies to this process's calls (their responses' on_receive runs there).
struct ReplyThreads : Interceptor {
  std::shared_ptr<void> on_receive(const MessageInfo& info, std::vector<c10::IValue>& /*values*/,
                                   const CallMetadata& /*metadata*/) override {
    if (info.kind == MessageInfo::Kind::kResponse) {
      std::lock_guard<std::mutex> lock(mutex);
      threads.push_back(std::this_thread::get_id());
    }
    return nullptr;
  }
  std::mutex mutex;
  std::vector<std::thread::id> threads;
};

DISTOPTIM_RPC_FUNCTION("ones_later", [] {
  // Likely answers after "ones", to a caller already waiting: neither is visible to the callee.
  std::this_thread::sleep_for(5ms);
  return at::ones({4});
});

// worker0's side of a call worker1 makes back to it while worker0's caller is outside the library.
std::promise<int64_t>& called_back() {
  static std::promise<int64_t> promise;
  return promise;
}
DISTOPTIM_RPC_FUNCTION("note_call_back", [](int64_t value) {
  called_back().set_value(value);
  return value;
});
std::thread& caller_back_thread() {
  static std::thread thread;
  return thread;
}
// On worker1: calls worker0 back a little later, from a thread of its own (joined by
// join_call_back).
DISTOPTIM_RPC_FUNCTION("call_back_later", [](int64_t value) {
  caller_back_thread() = std::thread([value] {
    // Likely lets worker0 reach its std::future first: telling us would take it into the library.
    std::this_thread::sleep_for(20ms);
    (void)rpc_sync<int64_t>("worker0", "note_call_back", std::tuple{value});
  });
  return true;
});
DISTOPTIM_RPC_FUNCTION("join_call_back", [] {
  caller_back_thread().join();
  return true;
});

TEST(NestedCalls, ACallerWaitingAgainReadsItsRepliesItselfAndTheWorkerServesMeanwhile) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, test_options().rpc_timeout(60s));
    if (rank == 0) {
      auto replies = std::make_shared<ReplyThreads>();
      set_interceptor(replies);
      {
        // Replies read on this thread are decoded under the loop's modes, not its own.
        c10::InferenceMode inference_mode;
        for (int call = 0; call < 50; ++call) {
          const at::Tensor ones = rpc_sync<at::Tensor>("worker1", "ones");
          EXPECT_FALSE(ones.is_inference()) << "call " << call;
          EXPECT_TRUE(ones.equal(at::ones({4}))) << "call " << call;
        }
      }
      {
        std::lock_guard<std::mutex> lock(replies->mutex);
        ASSERT_EQ(replies->threads.size(), 50u);
        // Back to back, the caller reads most replies itself; at least one it must (a loaded
        // machine may keep it away from the library longer than a loop thread waits for it).
        EXPECT_GE(std::count(replies->threads.begin(), replies->threads.end(),
                             std::this_thread::get_id()),
                  1);
        replies->threads.clear();
      }
      // Two calls made at once and waited for one after the other (as DistributedOptimizer's
      // step waits for its owners), the second answered later: its reply is read by the caller
      // too, after the first.
      int last_read_here = 0;
      for (int round = 0; round < 20; ++round) {
        auto first = detail::waited_call_values("worker1", "ones", {}, kDefaultTimeout);
        auto second = detail::waited_call_values("worker1", "ones_later", {}, kDefaultTimeout);
        detail::wait_future(*first);
        detail::wait_future(*second);
        EXPECT_TRUE(first->value().toTensor().equal(at::ones({4}))) << "round " << round;
        EXPECT_TRUE(second->value().toTensor().equal(at::ones({4}))) << "round " << round;
        std::lock_guard<std::mutex> lock(replies->mutex);
        ASSERT_EQ(replies->threads.size(), 2u) << "round " << round;
        last_read_here += replies->threads.back() == std::this_thread::get_id();
        replies->threads.clear();
      }
      EXPECT_GE(last_read_here, 1);
      // A call whose future may have callbacks (rpc_async) completes off the loop, on the
      // completion thread: once it has, the loop is left for this thread's next wait all the
      // same, and the blocking call after it reads its reply here too.
      int next_read_here = 0;
      for (int round = 0; round < 20; ++round) {
        EXPECT_TRUE(rpc_async<at::Tensor>("worker1", "ones_later").wait().equal(at::ones({4})))
            << "round " << round;
        EXPECT_TRUE(rpc_sync<at::Tensor>("worker1", "ones").equal(at::ones({4})))
            << "round " << round;
        std::lock_guard<std::mutex> lock(replies->mutex);
        ASSERT_EQ(replies->threads.size(), 2u) << "round " << round;
        next_read_here += replies->threads.back() == std::this_thread::get_id();
        replies->threads.clear();
      }
      EXPECT_GE(next_read_here, 1);
      // An RRef's to_here (a control message, only waited for) reads its reply here as well.
      {
        auto rref = remote<at::Tensor>("worker1", "ones", std::tuple{});
        for (int round = 0; round < 20; ++round) {
          EXPECT_TRUE(rref.to_here().equal(at::ones({4}))) << "round " << round;
        }
      }
      {
        std::lock_guard<std::mutex> lock(replies->mutex);
        EXPECT_GE(std::count(replies->threads.begin(), replies->threads.end(),
                             std::this_thread::get_id()),
                  1);
        replies->threads.clear();
      }
      set_interceptor(nullptr);
      // A request arriving while this thread is outside the library (its loop left for its next
      // wait) is served: worker1 calls back while this thread waits on a plain std::future.
      auto back = called_back().get_future();
      EXPECT_TRUE(rpc_sync<bool>("worker1", "call_back_later", std::tuple{int64_t{42}}));
      ASSERT_EQ(back.wait_for(60s), std::future_status::ready) << "worker0 never served worker1";
      EXPECT_EQ(back.get(), 42);
      EXPECT_TRUE(rpc_sync<bool>("worker1", "join_call_back"));
      // A request arriving while this thread leads the loop waiting is served too (on the pool).
      EXPECT_EQ(rpc_sync<int64_t>("worker1", "add_two_then_wait", std::tuple{int64_t{5}}), 7);
    }
    shutdown();
  });
}

// The I/O loop on its own: an io_context run by two threads taking turns, as the agent runs it.
class IoLoopUnit : public ::testing::Test {
 protected:
  void start(std::chrono::microseconds long_job) {
    loop_ = std::make_unique<detail::IoLoop>(io_, 2, long_job);
  }
  void TearDown() override {
    asio::post(io_, [this] { io_.stop(); });
    work_.reset();
    if (loop_) loop_->join();
  }
  // Posts `job` to run after a handler, on the thread that ran the handler; returns that thread.
  std::future<std::thread::id> run_after_a_handler(std::function<void()> job) {
    auto ran = std::make_shared<std::promise<std::thread::id>>();
    auto handler_thread = ran->get_future();
    asio::post(io_, [ran, job = std::move(job)]() mutable {
      // The second thread may not wait to follow yet, just after the loop started.
      for (int i = 0; i < 10000 && !detail::IoLoop::can_run_after_handler(); ++i) {
        std::this_thread::sleep_for(1ms);
      }
      ran->set_value(std::this_thread::get_id());
      if (detail::IoLoop::can_run_after_handler()) {
        detail::IoLoop::run_after_handler(std::move(job));
      }
    });
    return handler_thread;
  }
  // Where a handler posted now runs.
  std::future<std::thread::id> post_recording_thread() {
    auto ran = std::make_shared<std::promise<std::thread::id>>();
    auto future = ran->get_future();
    asio::post(io_, [ran] { ran->set_value(std::this_thread::get_id()); });
    return future;
  }

  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_{io_.get_executor()};
  std::unique_ptr<detail::IoLoop> loop_;
};

TEST_F(IoLoopUnit, AShortJobKeepsTheLoopAndItsThreadReadsOn) {
  start(std::chrono::hours(1));  // nobody takes the loop over
  std::promise<std::thread::id> job_ran;
  std::future<std::thread::id> after_job;
  auto handler = run_after_a_handler([&] {
    after_job = post_recording_thread();
    job_ran.set_value(std::this_thread::get_id());
  });
  auto job = job_ran.get_future();
  ASSERT_EQ(job.wait_for(60s), std::future_status::ready);
  const std::thread::id job_thread = job.get();
  EXPECT_EQ(job_thread, handler.get());
  // The handler posted by the job waited for the job to end, and then ran on the job's thread:
  // the other thread never led.
  ASSERT_EQ(after_job.wait_for(60s), std::future_status::ready);
  EXPECT_EQ(after_job.get(), job_thread);
}

TEST_F(IoLoopUnit, AJobBlockedElsewhereLosesTheLoopToTheOtherThread) {
  start(detail::IoLoop::kLongJob);
  std::promise<void> opened;
  std::shared_future<void> gate = opened.get_future().share();
  std::promise<bool> job_saw_gate;
  std::promise<std::thread::id> job_thread;
  auto handler = run_after_a_handler([&] {
    job_thread.set_value(std::this_thread::get_id());
    job_saw_gate.set_value(gate.wait_for(30s) == std::future_status::ready);
  });
  ASSERT_EQ(handler.wait_for(60s), std::future_status::ready);
  // Only the loop can open the gate: a handler the other thread runs once it took the loop over.
  std::promise<std::thread::id> opener;
  asio::post(io_, [&] {
    opener.set_value(std::this_thread::get_id());
    opened.set_value();
  });
  auto saw = job_saw_gate.get_future();
  ASSERT_EQ(saw.wait_for(60s), std::future_status::ready);
  EXPECT_TRUE(saw.get());
  EXPECT_NE(opener.get_future().get(), job_thread.get_future().get());
  // The job's thread follows again: the loop goes on serving.
  auto later = post_recording_thread();
  EXPECT_EQ(later.wait_for(60s), std::future_status::ready);
}

TEST_F(IoLoopUnit, AJobWaitingInTheLibraryLeadsTheLoopItself) {
  start(std::chrono::hours(1));  // nobody takes the loop over
  std::atomic<bool> done_by_handler{false};
  std::atomic<bool> done_elsewhere{false};
  std::promise<std::function<void()>> wake_given;
  struct Outcome {
    std::thread::id job_thread;
    bool led_first = false, led_second = false, led_third = false;
    bool first_done = false, second_done = false;
    std::chrono::steady_clock::duration third_took{};
  };
  std::promise<Outcome> outcome;
  std::future<std::thread::id> done_handler_thread;
  auto handler = run_after_a_handler([&] {
    Outcome out;
    out.job_thread = std::this_thread::get_id();
    // 1. What it waits for is a handler of the loop: it runs on this very thread.
    auto recorded = std::make_shared<std::promise<std::thread::id>>();
    done_handler_thread = recorded->get_future();
    asio::post(io_, [&, recorded] {
      recorded->set_value(std::this_thread::get_id());
      done_by_handler = true;
    });
    out.led_first = detail::IoLoop::lead_until([&] { return done_by_handler.load(); },
                                               [](std::function<void()>) {}, std::nullopt);
    out.first_done = done_by_handler;
    // 2. What it waits for happens off the loop, which then calls the wake-up it was given.
    out.led_second = detail::IoLoop::lead_until(
        [&] { return done_elsewhere.load(); },
        [&](std::function<void()> wake) { wake_given.set_value(std::move(wake)); }, std::nullopt);
    out.second_done = done_elsewhere;
    // 3. Nothing comes: it returns at the deadline.
    const auto begin = std::chrono::steady_clock::now();
    out.led_third = detail::IoLoop::lead_until([] { return false; }, [](std::function<void()>) {},
                                               begin + 50ms);
    out.third_took = std::chrono::steady_clock::now() - begin;
    outcome.set_value(out);
  });
  auto wake = wake_given.get_future();
  ASSERT_EQ(wake.wait_for(60s), std::future_status::ready);
  done_elsewhere = true;
  wake.get()();
  auto result = outcome.get_future();
  ASSERT_EQ(result.wait_for(60s), std::future_status::ready);
  const Outcome out = result.get();
  EXPECT_EQ(out.job_thread, handler.get());
  EXPECT_TRUE(out.led_first && out.led_second && out.led_third);
  EXPECT_TRUE(out.first_done && out.second_done);
  EXPECT_EQ(done_handler_thread.get(), out.job_thread);
  EXPECT_GE(out.third_took, 50ms);
  // Off a loop's thread there is nothing to lead: the caller waits its own way.
  EXPECT_FALSE(
      detail::IoLoop::lead_until([] { return false; }, [](std::function<void()>) {}, std::nullopt));
}

// Whom a test leaves the loop for: a thread that comes back to wait, or one that does not.
class TestWaiter final : public detail::IoLoop::NextWaiter {
 public:
  explicit TestWaiter(bool comes_back) : comes_back_(comes_back) {}
  bool comes_back() const override { return comes_back_; }

 private:
  const bool comes_back_;
};

std::shared_ptr<const detail::IoLoop::NextWaiter> coming_back() {
  return std::make_shared<TestWaiter>(true);
}

// Has a loop thread leave the loop for the next outside wait; false if no thread ran the handler.
bool leave_for_the_next_wait(asio::io_context& io) {
  auto left = std::make_shared<std::promise<void>>();
  asio::post(io, [left] {
    detail::IoLoop::leave_to_next_wait(coming_back());
    left->set_value();
  });
  return left->get_future().wait_for(60s) == std::future_status::ready;
}

// Leads the loop from this (outside) thread until `done`, once the loop is left for it: the loop
// thread that ran the handler asking for it may not have left it yet. False if it never was.
// `last`: the lead's last handler (IoLoop::lead_left_loop_until).
bool lead_once_left(const std::function<bool()>& done, const std::function<void()>& last = {}) {
  for (int i = 0; i < 10000; ++i) {
    if (detail::IoLoop::lead_left_loop_until(
            done, [](std::function<void()>) {}, std::nullopt, last))
      return true;
    std::this_thread::sleep_for(1ms);
  }
  return false;
}

TEST_F(IoLoopUnit, ALoopLeftForTheNextWaitIsLedByTheWaitingThread) {
  start(std::chrono::hours(1));  // nobody takes the loop over
  auto left = std::make_shared<std::promise<std::thread::id>>();
  asio::post(io_, [left] {
    detail::IoLoop::leave_to_next_wait(coming_back());
    left->set_value(std::this_thread::get_id());
  });
  auto loop_thread = left->get_future();
  ASSERT_EQ(loop_thread.wait_for(60s), std::future_status::ready);
  EXPECT_NE(loop_thread.get(), std::this_thread::get_id());
  // 1. The waiting thread runs the handler it waits for, and a handler of the same lead asks
  // to leave the loop for the next wait again.
  std::atomic<bool> first{false};
  std::thread::id first_thread;
  asio::post(io_, [&] {
    first_thread = std::this_thread::get_id();
    detail::IoLoop::leave_to_next_wait(coming_back());
    first = true;
  });
  ASSERT_TRUE(lead_once_left([&] { return first.load(); }));
  EXPECT_EQ(first_thread, std::this_thread::get_id());
  // 2. So the next wait leads at once; no handler asks this time.
  std::atomic<bool> second{false};
  std::thread::id second_thread;
  asio::post(io_, [&] {
    second_thread = std::this_thread::get_id();
    second = true;
  });
  EXPECT_TRUE(detail::IoLoop::lead_left_loop_until([&] { return second.load(); },
                                                   [](std::function<void()>) {}, std::nullopt));
  EXPECT_TRUE(second);
  EXPECT_EQ(second_thread, std::this_thread::get_id());
  // 3. So the loop went back to its threads: a handler runs there, and a wait leads nothing.
  auto later = post_recording_thread();
  ASSERT_EQ(later.wait_for(60s), std::future_status::ready);
  EXPECT_NE(later.get(), std::this_thread::get_id());
  EXPECT_FALSE(detail::IoLoop::lead_left_loop_until([] { return false; },
                                                    [](std::function<void()>) {}, std::nullopt));
}

// What a handler sees of LibTorch's thread-local state.
struct SeenModes {
  std::thread::id thread;
  bool grad = false;
  bool inference = false;
  bool thread_callbacks = true;
};

// A waiting thread that leads the loop runs its handlers under the loop threads' modes whatever
// its own (the same, or a no-grad guard, inference mode, a thread-local profiling callback), and
// has its own back after.
TEST_F(IoLoopUnit, AWaitingThreadRunsHandlersUnderTheLoopsModesAndKeepsItsOwn) {
  start(std::chrono::hours(1));  // nobody takes the loop over
  ASSERT_TRUE(leave_for_the_next_wait(io_));
  // Leads once, the loop left for it; the handler leaves it again unless `last`.
  const auto lead_a_handler = [this](bool last) {
    std::atomic<bool> ran{false};
    SeenModes seen;
    asio::post(io_, [&, last] {
      seen.thread = std::this_thread::get_id();
      seen.grad = c10::GradMode::is_enabled();
      seen.inference = c10::InferenceMode::is_enabled();
      seen.thread_callbacks = at::hasThreadLocalCallbacks();
      if (!last) detail::IoLoop::leave_to_next_wait(coming_back());
      ran = true;
    });
    EXPECT_TRUE(lead_once_left([&] { return ran.load(); }));
    EXPECT_EQ(seen.thread, std::this_thread::get_id());
    return seen;
  };
  const auto expect_loop_modes = [](const SeenModes& seen, const char* caller) {
    EXPECT_TRUE(seen.grad) << caller;
    EXPECT_FALSE(seen.inference) << caller;
    EXPECT_FALSE(seen.thread_callbacks) << caller;
  };
  expect_loop_modes(lead_a_handler(false), "a caller in the loop's modes");
  {
    at::NoGradGuard no_grad;
    expect_loop_modes(lead_a_handler(false), "a caller under a no-grad guard");
    EXPECT_FALSE(c10::GradMode::is_enabled());
  }
  {
    c10::InferenceMode inference_mode;
    expect_loop_modes(lead_a_handler(false), "a caller in inference mode");
    EXPECT_TRUE(c10::InferenceMode::is_enabled());
  }
  const at::CallbackHandle profiling = at::addThreadLocalCallback(at::RecordFunctionCallback(
      [](const at::RecordFunction&) -> std::unique_ptr<at::ObserverContext> { return nullptr; }));
  expect_loop_modes(lead_a_handler(true), "a caller with a thread-local callback");
  EXPECT_TRUE(at::hasThreadLocalCallbacks());
  at::removeCallback(profiling);
  EXPECT_TRUE(c10::GradMode::is_enabled());
  EXPECT_FALSE(c10::InferenceMode::is_enabled());
}

// A lead's last handler runs once its wait is done and may leave the loop for the next wait, as
// a handler may (wait_future's, when the future completed off the loop); not when a handler of
// the lead already asked.
TEST_F(IoLoopUnit, ALeadsLastHandlerMayLeaveTheLoopForTheNextWait) {
  start(std::chrono::hours(1));  // nobody takes the loop over
  ASSERT_TRUE(leave_for_the_next_wait(io_));
  const auto no_arm = [](std::function<void()>) {};
  // 1. No handler asks to leave; the last handler does, on this thread.
  std::atomic<bool> first{false};
  asio::post(io_, [&] { first = true; });
  int last_runs = 0;
  std::thread::id last_thread;
  ASSERT_TRUE(lead_once_left([&] { return first.load(); },
                             [&] {
                               ++last_runs;
                               last_thread = std::this_thread::get_id();
                               detail::IoLoop::leave_to_next_wait(coming_back());
                             }));
  EXPECT_EQ(last_runs, 1);
  EXPECT_EQ(last_thread, std::this_thread::get_id());
  // 2. So the next wait leads at once; a handler asks to leave, and the last handler is not run.
  std::atomic<bool> second{false};
  asio::post(io_, [&] {
    detail::IoLoop::leave_to_next_wait(coming_back());
    second = true;
  });
  EXPECT_TRUE(detail::IoLoop::lead_left_loop_until([&] { return second.load(); }, no_arm,
                                                   std::nullopt, [&] { ++last_runs; }));
  EXPECT_EQ(last_runs, 1);
  // 3. Left again by that handler: the next wait leads; nobody asks, so the loop goes back to its
  // threads.
  std::atomic<bool> third{false};
  asio::post(io_, [&] { third = true; });
  EXPECT_TRUE(
      detail::IoLoop::lead_left_loop_until([&] { return third.load(); }, no_arm, std::nullopt));
  auto later = post_recording_thread();
  ASSERT_EQ(later.wait_for(60s), std::future_status::ready);
  EXPECT_NE(later.get(), std::this_thread::get_id());
}

TEST_F(IoLoopUnit, ALoopLeftForAWaitThatDoesNotComeIsTakenBack) {
  start(detail::IoLoop::kLongJob);
  auto left = std::make_shared<std::promise<void>>();
  asio::post(io_, [left] {
    detail::IoLoop::leave_to_next_wait(coming_back());
    left->set_value();
  });
  ASSERT_EQ(left->get_future().wait_for(60s), std::future_status::ready);
  // Nobody waits: a watching loop thread takes the loop back and runs what comes.
  auto later = post_recording_thread();
  ASSERT_EQ(later.wait_for(60s), std::future_status::ready);
  EXPECT_NE(later.get(), std::this_thread::get_id());
}

TEST_F(IoLoopUnit, ALoopIsNotLeftForAThreadThatWillNotComeBack) {
  start(std::chrono::hours(1));  // a loop left would stay unread
  auto asked = std::make_shared<std::promise<std::thread::id>>();
  asio::post(io_, [asked] {
    detail::IoLoop::leave_to_next_wait(std::make_shared<TestWaiter>(false));
    asked->set_value(std::this_thread::get_id());
  });
  auto asking_thread = asked->get_future();
  ASSERT_EQ(asking_thread.wait_for(60s), std::future_status::ready);
  // The thread that asked reads on: the next handler runs on it, and there is nothing to lead.
  auto later = post_recording_thread();
  ASSERT_EQ(later.wait_for(60s), std::future_status::ready);
  EXPECT_EQ(later.get(), asking_thread.get());
  EXPECT_FALSE(detail::IoLoop::lead_left_loop_until([] { return false; },
                                                    [](std::function<void()>) {}, std::nullopt));
}

TEST(CallingThreadUnit, ComesBackUnlessBlockedOnAFutureNotYetCompleted) {
  const std::shared_ptr<const detail::CallingThread> self = detail::CallingThread::current();
  ASSERT_NE(self, nullptr);
  EXPECT_EQ(detail::CallingThread::current(), self);  // one per thread
  EXPECT_TRUE(self->comes_back());                    // it runs
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
  {
    detail::CallingThread::Waiting waiting(*self, *future);
    EXPECT_FALSE(self->comes_back());
    future->markCompleted(c10::IValue(int64_t{1}));
    EXPECT_TRUE(self->comes_back());
  }
  auto other = c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
  {
    detail::CallingThread::Waiting waiting(*self, *other);
    EXPECT_FALSE(self->comes_back());
  }
  EXPECT_TRUE(self->comes_back());  // the wait ended
  // A pool's thread never leads a loop left for its wait.
  detail::Executor pool(1, /*max_extra_threads=*/0);
  std::promise<bool> on_pool;
  pool.post([&] { on_pool.set_value(detail::CallingThread::current() == nullptr); });
  EXPECT_TRUE(on_pool.get_future().get());
  pool.stop();
}

TEST_F(IoLoopUnit, AnOutsideThreadLeadingReturnsWhenTheLoopStops) {
  start(std::chrono::hours(1));
  asio::post(io_, [] { detail::IoLoop::leave_to_next_wait(coming_back()); });
  std::atomic<bool> leading{false};
  std::thread stopper([&] {
    while (!leading) std::this_thread::sleep_for(1ms);
    asio::post(io_, [this] { io_.stop(); });
  });
  // Waits for what never comes until the loop stops; the loop's threads then leave (TearDown).
  const bool led = lead_once_left([&] {
    leading = true;
    return false;
  });
  leading = true;  // also lets the stopper go when the loop was never left (then the test fails)
  stopper.join();
  EXPECT_TRUE(led);
  EXPECT_TRUE(io_.stopped());
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
    // Time for a wrong compensating thread to run the second job: a job not run has no event.
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

}  // namespace nested_test
}  // namespace rpc
}  // namespace distoptim
