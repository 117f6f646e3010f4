// The DistributedOptimizer's bounded staleness (set_max_staleness) across real processes on
// loopback: steps that return before their owners apply them, applied in the order taken and
// never more than max_staleness behind, with contexts released early; failures of outstanding
// steps reported by the next step or flush, naming the owner and the step; refused settings.
// The loss is linear in every parameter, so each step's gradients do not depend on how stale
// the parameters its forward read were, and the result must equal the same gradients applied in
// order in one process.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <distoptim/comm/errors.h>
#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/optim/adam.h>
#include <distoptim/optim/registry.h>
#include <distoptim/optim/sgd.h>
#include <distoptim/rpc.h>

#include "harness/multiprocess.h"
#include "harness/rpc_workers.h"

namespace distoptim {
namespace dist_optim {
namespace max_staleness_test {

using namespace std::chrono_literals;
using dist_autograd::ContextGuard;
using distoptim::testing::worker;
using optim::OptionBag;
using rpc::rpc_sync;
using rpc::RRef;

constexpr std::chrono::seconds kBound{60};  // every wait's bound

// Each worker's parameters: w (4 x 4) and b (4), different on each worker, the same every run.
std::vector<at::Tensor> make_params(int rank) {
  auto generator = at::detail::createCPUGenerator(700 + rank);
  auto options = at::TensorOptions().dtype(at::kDouble);
  return {at::randn({4, 4}, generator, options).requires_grad_(),
          at::randn({4}, generator, options).requires_grad_()};
}
std::vector<at::Tensor>& my_params() {
  static std::vector<at::Tensor> params = make_params(rpc::get_worker_info().id);
  return params;
}

// The coefficients of step `step`'s loss on worker `rank`: the gradients of w and b there.
std::vector<at::Tensor> coefficients(int64_t step, int rank) {
  auto generator = at::detail::createCPUGenerator(1000 * step + rank);
  auto options = at::TensorOptions().dtype(at::kDouble);
  return {at::randn({4, 4}, generator, options), at::randn({4}, generator, options)};
}

DISTOPTIM_RPC_FUNCTION("linear", [](int64_t step) {
  const std::vector<at::Tensor> c = coefficients(step, rpc::get_worker_info().id);
  return (my_params()[0] * c[0]).sum() + (my_params()[1] * c[1]).sum();
});
DISTOPTIM_RPC_FUNCTION("staleness_param_rrefs", [] {
  std::vector<RRef<at::Tensor>> rrefs;
  for (const at::Tensor& p : my_params()) rrefs.emplace_back(p);
  return rrefs;
});
DISTOPTIM_RPC_FUNCTION("staleness_params", [] {
  rpc::InPlaceUpdateGuard guard;  // not torn by a step
  std::vector<at::Tensor> copies;
  for (const at::Tensor& p : my_params()) copies.push_back(p.detach().clone());
  return copies;
});
DISTOPTIM_RPC_FUNCTION("staleness_context_count",
                       [] { return static_cast<int64_t>(dist_autograd::context_count()); });

// A gate every owner's step waits at (at most kBound) until the test opens it, and the count of
// steps applied on this worker.
struct Gate {
  std::mutex mutex;
  std::condition_variable changed;
  bool open = true;  // guarded by mutex
};
Gate& gate() {
  static Gate instance;
  return instance;
}
std::atomic<int64_t> g_applied{0};
DISTOPTIM_RPC_FUNCTION("shut_gate", [] {
  std::lock_guard<std::mutex> lock(gate().mutex);
  gate().open = false;
});
DISTOPTIM_RPC_FUNCTION("open_gate", [] {
  std::lock_guard<std::mutex> lock(gate().mutex);
  gate().open = true;
  gate().changed.notify_all();
});
DISTOPTIM_RPC_FUNCTION("applied", [] { return g_applied.load(); });

class GatedAdam : public optim::Adam {
 public:
  using optim::Adam::Adam;

 protected:
  void update(size_t group, const std::vector<ParamUpdate>& updates) override {
    {
      std::unique_lock<std::mutex> lock(gate().mutex);
      TORCH_CHECK(gate().changed.wait_for(lock, kBound, [] { return gate().open; }),
                  "GatedAdam: the gate stayed shut for ", kBound.count(), " s");
    }
    optim::Adam::update(group, updates);
    ++g_applied;
  }
};
const optim::OptimizerRegistration kGatedAdam(
    "gated_adam", optim::typed_factory<GatedAdam, optim::AdamOptions>());

// SGD (lr 0.1) that refuses every step on worker2.
class RefusingOnWorker2 : public optim::SGD {
 public:
  using optim::SGD::SGD;

 protected:
  void update(size_t group, const std::vector<ParamUpdate>& updates) override {
    TORCH_CHECK_VALUE(rpc::get_worker_info().name != worker(2), "refusing to step on ",
                      rpc::get_worker_info().name);
    optim::SGD::update(group, updates);
  }
};
const optim::OptimizerRegistration kRefusingOnWorker2(
    "refusing_on_worker2",
    optim::typed_factory<RefusingOnWorker2, optim::SGDOptions>(optim::SGDOptions(0.1)));

// SGD (lr 0.1) whose process ends in its step on worker2, as in a crash.
class DyingOnWorker2 : public optim::SGD {
 public:
  using optim::SGD::SGD;

 protected:
  void update(size_t group, const std::vector<ParamUpdate>& updates) override {
    if (rpc::get_worker_info().name == worker(2)) std::_Exit(7);
    optim::SGD::update(group, updates);
  }
};
const optim::OptimizerRegistration kDyingOnWorker2(
    "dying_on_worker2",
    optim::typed_factory<DyingOnWorker2, optim::SGDOptions>(optim::SGDOptions(0.1)));
std::atomic<bool> g_leave{false};
DISTOPTIM_RPC_FUNCTION("staleness_leave", [] { g_leave = true; });

void with_workers(int world_size, const std::function<void()>& trainer) {
  testing::with_workers(world_size, trainer, testing::test_options(60s));
}

std::vector<RRef<at::Tensor>> params_of(int rank) {
  return rpc_sync<std::vector<RRef<at::Tensor>>>(worker(rank), "staleness_param_rrefs");
}

// One step's forward and backward through worker1 and worker2, in a context released as soon as
// the step returns.
void take_step(DistributedOptimizer& optimizer, int64_t step) {
  ContextGuard context;
  const at::Tensor loss = rpc_sync<at::Tensor>(worker(1), "linear", std::tuple{step}) +
                          rpc_sync<at::Tensor>(worker(2), "linear", std::tuple{step});
  dist_autograd::backward(context.id(), {loss});
  optimizer.step(context.id());
}

void expect_equal(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  EXPECT_TRUE(at::allclose(actual, expected, 1e-12, 1e-14)) << what << ":\n"
                                                            << actual << "\nexpected\n"
                                                            << expected;
}

// Waits (at most kBound) until no worker holds a context: the early releases arrived.
void expect_contexts_released() {
  const auto deadline = std::chrono::steady_clock::now() + kBound;
  for (int rank : {1, 2}) {
    int64_t held = 0;
    while ((held = rpc_sync<int64_t>(worker(rank), "staleness_context_count")) != 0 &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(10ms);
    }
    EXPECT_EQ(held, 0) << worker(rank) << " still holds contexts";
  }
  EXPECT_EQ(dist_autograd::context_count(), 0u);
}

TEST(MaxStaleness, StepsReturnBeforeTheyAreAppliedAndApplyInOrder) {
  with_workers(3, [] {
    const OptionBag options = OptionBag().set("lr", 0.05).set("amsgrad", true);
    std::vector<RRef<at::Tensor>> params = params_of(1);
    for (const auto& p : params_of(2)) params.push_back(p);
    DistributedOptimizer optimizer("gated_adam", params, options);
    optimizer.set_max_staleness(3);
    EXPECT_EQ(optimizer.max_staleness(), 3);
    // Shut: the first step stays in its update on both owners, its context released here.
    for (int rank : {1, 2}) rpc_sync(worker(rank), "shut_gate");
    const int64_t steps = 8;
    for (int64_t step = 0; step < 3; ++step) take_step(optimizer, step);
    for (int rank : {1, 2}) {
      EXPECT_EQ(rpc_sync<int64_t>(worker(rank), "applied"), 0) << worker(rank);
      rpc_sync(worker(rank), "open_gate");
    }
    for (int64_t step = 3; step < steps; ++step) {
      take_step(optimizer, step);
      // Never more than 3 steps behind: step `step` (from 0) was sent once step - 3 was answered.
      for (int rank : {1, 2}) EXPECT_GE(rpc_sync<int64_t>(worker(rank), "applied"), step - 2);
    }
    optimizer.flush();

    // The same gradients applied in order in one process.
    for (int rank : {1, 2}) {
      EXPECT_EQ(rpc_sync<int64_t>(worker(rank), "applied"), steps) << worker(rank);
      std::vector<at::Tensor> local = make_params(rank);
      auto adam = optim::create_optimizer("adam", {optim::ParamGroup(local)}, options);
      for (int64_t step = 0; step < steps; ++step) adam->step(coefficients(step, rank));
      const auto now = rpc_sync<std::vector<at::Tensor>>(worker(rank), "staleness_params");
      expect_equal(now[0], local[0].detach(), worker(rank) + "'s w");
      expect_equal(now[1], local[1].detach(), worker(rank) + "'s b");
    }
    expect_contexts_released();
  });
}

TEST(MaxStaleness, AFailedStepIsReportedByTheNextStepWhichSendsNothing) {
  with_workers(3, [] {
    std::vector<RRef<at::Tensor>> params = params_of(1);
    for (const auto& p : params_of(2)) params.push_back(p);
    DistributedOptimizer optimizer("refusing_on_worker2", params);
    optimizer.set_max_staleness(1);
    ContextGuard first;
    const at::Tensor loss = rpc_sync<at::Tensor>(worker(1), "linear", std::tuple{int64_t{0}}) +
                            rpc_sync<at::Tensor>(worker(2), "linear", std::tuple{int64_t{0}});
    dist_autograd::backward(first.id(), {loss});
    optimizer.step(first.id());  // returns: worker2's refusal comes later

    ContextGuard second;
    const at::Tensor loss2 = rpc_sync<at::Tensor>(worker(1), "linear", std::tuple{int64_t{1}}) +
                             rpc_sync<at::Tensor>(worker(2), "linear", std::tuple{int64_t{1}});
    dist_autograd::backward(second.id(), {loss2});
    // With max_staleness 1 this step waits for the first to be answered, and reports it.
    try {
      optimizer.step(second.id());
      ADD_FAILURE() << "the first step's failure was not reported";
    } catch (const rpc::RemoteError& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find("worker '" + worker(2) + "', step 1 (context " +
                             std::to_string(first.id()) + "): "),
                std::string::npos)
          << message;
      EXPECT_NE(message.find("refusing to step on " + worker(2)), std::string::npos) << message;
      EXPECT_NE(message.find("reported by step(" + std::to_string(second.id()) + ")"),
                std::string::npos)
          << message;
      EXPECT_EQ(message.find("worker '" + worker(1) + "'"), std::string::npos) << message;
    }
    // Nothing of the second step was sent: worker1 took the first alone.
    std::vector<at::Tensor> expected = make_params(1);
    for (size_t i = 0; i < 2; ++i) {
      expected[i] = expected[i].detach() - 0.1 * coefficients(0, 1)[i];
    }
    optimizer.flush();  // nothing outstanding, nothing failed
    auto now = rpc_sync<std::vector<at::Tensor>>(worker(1), "staleness_params");
    expect_equal(now[0], expected[0], "worker1's w after one step");
    // Taken again, it is sent; flush reports its failure on worker2 as step 2.
    optimizer.step(second.id());
    try {
      optimizer.flush();
      ADD_FAILURE() << "the second step's failure was not reported";
    } catch (const rpc::RemoteError& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find("worker '" + worker(2) + "', step 2 (context " +
                             std::to_string(second.id()) + "): "),
                std::string::npos)
          << message;
      EXPECT_NE(message.find("reported by flush()"), std::string::npos) << message;
    }
    for (size_t i = 0; i < 2; ++i) {
      expected[i] = expected[i] - 0.1 * coefficients(1, 1)[i];
    }
    now = rpc_sync<std::vector<at::Tensor>>(worker(1), "staleness_params");
    expect_equal(now[0], expected[0], "worker1's w after two steps");
    expect_equal(now[1], expected[1], "worker1's b after two steps");
  });
}

// An owner lost with a step outstanding: flush reports a PeerLostError naming it and the step;
// the other owner applied the step.
TEST(MaxStaleness, AnOwnerLostWithAStepOutstandingIsNamedByFlush) {
  testing::RunRanksOptions options;
  options.expected_exit_codes = {{2, 7}};
  testing::run_ranks(
      3,
      [](int rank, int size) {
        rpc::init_rpc(worker(rank), rank, size, testing::test_options(60s));
        if (rank != 0) {
          while (!g_leave) std::this_thread::sleep_for(10ms);  // serves until told to leave
          rpc::shutdown(/*graceful=*/false);
          return;
        }
        std::vector<RRef<at::Tensor>> params = params_of(1);
        for (const auto& p : params_of(2)) params.push_back(p);
        DistributedOptimizer optimizer("dying_on_worker2", params);
        optimizer.set_max_staleness(2);
        int64_t context_id = 0;
        {
          ContextGuard context;
          context_id = context.id();
          const at::Tensor loss =
              rpc_sync<at::Tensor>(worker(1), "linear", std::tuple{int64_t{0}}) +
              rpc_sync<at::Tensor>(worker(2), "linear", std::tuple{int64_t{0}});
          dist_autograd::backward(context.id(), {loss});
          optimizer.step(context.id());  // returns; worker2 dies in it
        }
        try {
          optimizer.flush();
          ADD_FAILURE() << "the step passed without worker2";
        } catch (const PeerLostError& error) {
          const std::string message = error.what();
          EXPECT_NE(message.find("worker '" + worker(2) + "', step 1 (context " +
                                 std::to_string(context_id) + "): "),
                    std::string::npos)
              << message;
          EXPECT_EQ(message.find("worker '" + worker(1) + "'"), std::string::npos) << message;
        }
        std::vector<at::Tensor> expected = make_params(1);
        const auto now = rpc_sync<std::vector<at::Tensor>>(worker(1), "staleness_params");
        for (size_t i = 0; i < 2; ++i) {
          expect_equal(now[i], expected[i].detach() - 0.1 * coefficients(0, 1)[i],
                       "worker1's parameter " + std::to_string(i));
        }
        optimizer.flush();  // reported once
        rpc_sync(worker(1), "staleness_leave");
        rpc::shutdown(/*graceful=*/false);
      },
      options);
}

TEST(MaxStaleness, RefusedSettingsAndContextsChangeNothing) {
  with_workers(2, [] {
    DistributedOptimizer optimizer("sgd", params_of(1), OptionBag().set("lr", 0.1));
    optimizer.set_max_staleness(2);
    try {
      optimizer.set_max_staleness(-1);
      ADD_FAILURE() << "max_staleness -1 was taken";
    } catch (const c10::ValueError& error) {
      EXPECT_NE(std::string(error.what()).find("max_staleness must be 0"), std::string::npos)
          << error.what();
      EXPECT_NE(std::string(error.what()).find("got -1"), std::string::npos) << error.what();
    }
    EXPECT_EQ(optimizer.max_staleness(), 2);
    // A context this worker does not hold: refused before anything is sent.
    const int64_t unknown = 12345;
    try {
      optimizer.step(unknown);
      ADD_FAILURE() << "a step on an unknown context was taken";
    } catch (const c10::ValueError& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find("context " + std::to_string(unknown)), std::string::npos) << message;
      EXPECT_NE(message.find("max_staleness 2"), std::string::npos) << message;
    }
    optimizer.flush();
    const auto now = rpc_sync<std::vector<at::Tensor>>(worker(1), "staleness_params");
    expect_equal(now[0], make_params(1)[0].detach(), "worker1's w");
    // Back to synchronous steps.
    optimizer.set_max_staleness(0);
    EXPECT_EQ(optimizer.max_staleness(), 0);
  });
}

}  // namespace max_staleness_test
}  // namespace dist_optim
}  // namespace distoptim
