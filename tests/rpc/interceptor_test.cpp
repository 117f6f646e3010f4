// The interceptor across real processes on loopback: it sees the values of requests and
// responses on both sides, its metadata travels with them, and what its on_receive returns lives
// while the handler runs, for rpc_sync, remote() arguments (to another worker and to this one),
// RRef method calls and to_here() results alike. Metadata is bounded.

#include <atomic>
#include <mutex>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <distoptim/rpc.h>
#include <distoptim/rpc/classes.h>

#include "harness/multiprocess.h"
#include "harness/rpc_workers.h"

namespace distoptim {
namespace rpc {
namespace interceptor_test {

using namespace std::chrono_literals;
using distoptim::testing::run_ranks;
using distoptim::testing::worker;

// The caller the running handler was sent by, as the interceptor saw it.
thread_local std::string t_sent_by;

size_t count_tensors(const c10::IValue& value) {
  if (value.isTensor()) return 1;
  size_t count = 0;
  if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) count += count_tensors(item);
  }
  return count;
}

struct Tagger : Interceptor {
  void on_send(const MessageInfo& info, std::vector<c10::IValue>& values,
               CallMetadata& metadata) override {
    size_t tensors = 0;
    for (const c10::IValue& value : values) tensors += count_tensors(value);
    metadata["from"] = get_worker_info().name;
    metadata["tensors"] = std::to_string(tensors);
    if (oversized) {
      for (int i = 0; i < 20; ++i) metadata["key" + std::to_string(i)] = "x";
    }
  }
  std::shared_ptr<void> on_receive(const MessageInfo& info, std::vector<c10::IValue>& values,
                                   const CallMetadata& metadata) override {
    size_t tensors = 0;
    for (const c10::IValue& value : values) tensors += count_tensors(value);
    if (metadata.at("tensors") != std::to_string(tensors)) ++mismatches;
    if (info.kind == MessageInfo::Kind::kResponse) {
      std::lock_guard<std::mutex> lock(mutex);
      responses_from.push_back(metadata.at("from"));
      return nullptr;
    }
    t_sent_by = metadata.at("from");
    // Cleared once the handler has run.
    return std::shared_ptr<void>(nullptr, [](void*) { t_sent_by.clear(); });
  }

  std::atomic<bool> oversized{false};
  std::atomic<int> mismatches{0};
  std::mutex mutex;
  std::vector<std::string> responses_from;  // guarded by mutex
};

DISTOPTIM_RPC_FUNCTION("sent_by", [](const at::Tensor&) { return t_sent_by; });
DISTOPTIM_RPC_FUNCTION("identity", [](const at::Tensor& tensor) { return tensor; });

struct Greeter {
  explicit Greeter(std::string greeting) : greeting(std::move(greeting) + " " + t_sent_by) {}
  std::string created_for() { return greeting; }
  std::string called_by() { return t_sent_by; }
  std::string greeting;
};
DISTOPTIM_RPC_CLASS(Greeter, std::string);
DISTOPTIM_RPC_METHOD(Greeter, created_for);
DISTOPTIM_RPC_METHOD(Greeter, called_by);

TEST(RpcInterceptor, SeesEveryKindOfMessageOnBothSides) {
  run_ranks(2, [](int rank, int world_size) {
    auto tagger = std::make_shared<Tagger>();
    set_interceptor(tagger);
    init_rpc(worker(rank), rank, world_size,
             RpcBackendOptions("env://").init_timeout(30s).shutdown_timeout(30s));
    if (rank == 0) {
      const at::Tensor x = at::ones({3});
      // rpc_sync: the handler runs inside the context the interceptor set.
      EXPECT_EQ(rpc_sync<std::string>(worker(1), "sent_by", std::tuple{x}), "worker0");
      // remote() to another worker: the creation runs inside it too; to_here's result is seen.
      auto remote_greeter = remote<Greeter>(worker(1), "Greeter", std::tuple{std::string("hi")});
      EXPECT_EQ(remote_greeter.rpc_sync().method<std::string>("created_for"), "hi worker0");
      // An RRef method call.
      EXPECT_EQ(remote_greeter.rpc_sync().method<std::string>("called_by"), "worker0");
      auto remote_value = remote<std::string>(worker(1), "sent_by", std::tuple{x});
      EXPECT_EQ(remote_value.to_here(), "worker0");
      // remote() to this worker behaves as to another: intercepted, and given a copy.
      auto local_greeter = remote<Greeter>(worker(0), "Greeter", std::tuple{std::string("hey")});
      EXPECT_EQ(local_greeter.rpc_sync().method<std::string>("created_for"), "hey worker0");
      at::Tensor mine = at::zeros({4});
      auto copy = remote<at::Tensor>(worker(0), "identity", std::tuple{mine});
      mine.add_(1);
      EXPECT_TRUE(at::equal(copy.to_here(), at::zeros({4})));
      // Metadata past its bounds fails the call at the sender, naming the bound.
      tagger->oversized = true;
      EXPECT_THROW(rpc_sync<std::string>(worker(1), "sent_by", std::tuple{x}), c10::ValueError);
      tagger->oversized = false;
      {
        std::lock_guard<std::mutex> lock(tagger->mutex);
        EXPECT_GE(tagger->responses_from.size(), 5u);
        for (const std::string& from : tagger->responses_from) {
          EXPECT_TRUE(from == "worker1" || from == "worker0") << from;
        }
      }
    }
    shutdown();
    EXPECT_EQ(tagger->mismatches.load(), 0);
    set_interceptor(nullptr);
  });
}

}  // namespace interceptor_test
}  // namespace rpc
}  // namespace distoptim
