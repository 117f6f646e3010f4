// examples/click_through's pipelined steps (pipelined_steps.h) across real processes on loopback:
// a trainer (worker0) with two steps in flight against a parameter owner (worker1) and a real
// DistributedOptimizer. Each part's begin and end is logged, and the log must keep the pipeline's
// order: a forward after the last one, and after the optimizer step two steps back; optimizer
// steps and `after` in step order; a draining step's `after` before the next forward. One
// backward waits for the next step's forward to begin, so two steps must be in flight. The loss
// is linear in the parameters, so the result must equal the same gradients applied in order in
// one process. A failing part ends both threads and is rethrown; a turn waited for too long names
// the step it waited for.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/rpc.h>

#include "harness/multiprocess.h"
#include "harness/rpc_workers.h"
#include "pipelined_steps.h"

namespace click_through {
namespace pipeline_test {

using namespace std::chrono_literals;
using distoptim::dist_optim::DistributedOptimizer;
using distoptim::rpc::rpc_sync;
using distoptim::rpc::RRef;
using distoptim::testing::worker;

constexpr std::chrono::seconds kBound{60};  // every wait's bound
constexpr double kLr = 0.1;

at::Tensor& owned_weight() {
  static at::Tensor w =
      at::randn({4, 4}, at::detail::createCPUGenerator(5), at::TensorOptions().dtype(at::kDouble))
          .requires_grad_();
  return w;
}
// Step n's gradient of the linear loss.
at::Tensor coefficient(int64_t n) {
  return at::randn({4, 4}, at::detail::createCPUGenerator(100 + n),
                   at::TensorOptions().dtype(at::kDouble));
}
DISTOPTIM_RPC_FUNCTION("pipeline_linear",
                       [](int64_t n) { return (owned_weight() * coefficient(n)).sum(); });
DISTOPTIM_RPC_FUNCTION("pipeline_weight_rref", [] { return RRef<at::Tensor>(owned_weight()); });
DISTOPTIM_RPC_FUNCTION("pipeline_weight", [] {
  distoptim::rpc::InPlaceUpdateGuard guard;
  return owned_weight().detach().clone();
});

enum class Part { kForward, kBackward, kStep, kAfter };

// Each part's begin and end, in the order they happened.
class Log {
 public:
  void begin(Part part, int64_t n) { add(part, n, true); }
  void end(Part part, int64_t n) { add(part, n, false); }
  // The place of part's begin or end for step n (-1: never).
  int64_t at(Part part, int64_t n, bool begin) const {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < events_.size(); ++i) {
      if (events_[i].part == part && events_[i].n == n && events_[i].begin == begin) {
        return static_cast<int64_t>(i);
      }
    }
    return -1;
  }
  // Waits (at most kBound) until step n's forward has begun.
  bool wait_for_forward(int64_t n) {
    std::unique_lock<std::mutex> lock(mutex_);
    return changed_.wait_for(lock, kBound, [&] {
      return std::any_of(events_.begin(), events_.end(), [&](const Event& e) {
        return e.part == Part::kForward && e.n == n && e.begin;
      });
    });
  }
  std::vector<int64_t> afters() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<int64_t> steps;
    for (const Event& e : events_) {
      if (e.part == Part::kAfter && e.begin) steps.push_back(e.n);
    }
    return steps;
  }
  int64_t last_forward_begun() const {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t last = 0;
    for (const Event& e : events_) {
      if (e.part == Part::kForward && e.begin) last = std::max(last, e.n);
    }
    return last;
  }

 private:
  struct Event {
    Part part;
    int64_t n;
    bool begin;
  };
  void add(Part part, int64_t n, bool begin) {
    std::lock_guard<std::mutex> lock(mutex_);
    events_.push_back({part, n, begin});
    changed_.notify_all();
  }
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<Event> events_;
};

// Parts that step the owner's weight through `optimizer`, logged; `hold` runs inside each part.
StepParts logged_parts(DistributedOptimizer& optimizer, Log& log,
                       std::map<int64_t, int64_t>& contexts, std::mutex& contexts_mutex,
                       const std::function<void(Part, int64_t)>& hold) {
  StepParts parts;
  parts.forward = [&, hold](int64_t n) {
    log.begin(Part::kForward, n);
    {
      const auto current = distoptim::dist_autograd::current_context_id();
      std::lock_guard<std::mutex> lock(contexts_mutex);
      contexts[n] = current.value_or(-1);
    }
    hold(Part::kForward, n);
    at::Tensor loss = rpc_sync<at::Tensor>(worker(1), "pipeline_linear", std::tuple{n});
    log.end(Part::kForward, n);
    return loss;
  };
  parts.backward = [&, hold](int64_t n, int64_t context_id, const at::Tensor& loss) {
    log.begin(Part::kBackward, n);
    {
      std::lock_guard<std::mutex> lock(contexts_mutex);
      EXPECT_EQ(contexts.at(n), context_id) << "step " << n << "'s forward ran in another context";
    }
    hold(Part::kBackward, n);
    distoptim::dist_autograd::backward(context_id, {loss});
    log.end(Part::kBackward, n);
  };
  parts.optimizer_step = [&, hold](int64_t n, int64_t context_id) {
    log.begin(Part::kStep, n);
    hold(Part::kStep, n);
    optimizer.step(context_id);
    log.end(Part::kStep, n);
  };
  parts.after = [&, hold](int64_t n, const at::Tensor& loss) {
    log.begin(Part::kAfter, n);
    EXPECT_TRUE(loss.defined());
    hold(Part::kAfter, n);
    log.end(Part::kAfter, n);
  };
  return parts;
}

// A DistributedOptimizer (SGD) over the owner's weight, with the log of its steps' parts.
struct LoggedTrainer {
  DistributedOptimizer optimizer{"sgd",
                                 {rpc_sync<RRef<at::Tensor>>(worker(1), "pipeline_weight_rref")},
                                 distoptim::optim::OptionBag().set("lr", kLr)};
  Log log;
  std::map<int64_t, int64_t> contexts;  // each step's context, as its forward saw it
  std::mutex contexts_mutex;

  StepParts parts(const std::function<void(Part, int64_t)>& hold) {
    return logged_parts(optimizer, log, contexts, contexts_mutex, hold);
  }
};

void with_workers(const std::function<void()>& trainer) {
  distoptim::testing::with_workers(2, trainer, distoptim::testing::test_options(60s));
}

TEST(PipelinedSteps, TwoStepsInFlightInTheirOrderAndEveryStepAppliedOnce) {
  with_workers([] {
    for (const int64_t staleness : {1, 3}) {
      SCOPED_TRACE("max staleness " + std::to_string(staleness));
      const at::Tensor before = rpc_sync<at::Tensor>(worker(1), "pipeline_weight");
      LoggedTrainer trainer;
      trainer.optimizer.set_max_staleness(staleness - 1);
      Log& log = trainer.log;
      constexpr int64_t kFirst = 3, kLast = 12, kDraining = 7;
      StepParts parts = trainer.parts([&](Part part, int64_t n) {
        // Step 5's backward goes on only once step 6's forward has begun.
        if (part == Part::kBackward && n == 5) {
          TORCH_CHECK(log.wait_for_forward(6),
                      "step 6's forward never began during step 5's "
                      "backward");
        }
      });
      parts.drains = [](int64_t n) { return n == kDraining; };
      const PhaseTimes phases = run_pipelined(kFirst, kLast, parts, PipelineOptions());
      trainer.optimizer.flush();
      EXPECT_EQ(phases.steps, kLast - kFirst + 1);

      std::vector<int64_t> expected_afters;
      for (int64_t n = kFirst; n <= kLast; ++n) expected_afters.push_back(n);
      EXPECT_EQ(log.afters(), expected_afters);
      for (int64_t n = kFirst; n <= kLast; ++n) {
        SCOPED_TRACE("step " + std::to_string(n));
        const int64_t forward_begins = log.at(Part::kForward, n, true);
        ASSERT_GE(forward_begins, 0);
        if (n > kFirst) {
          EXPECT_GT(forward_begins, log.at(Part::kForward, n - 1, false));
          EXPECT_GT(log.at(Part::kStep, n, true), log.at(Part::kAfter, n - 1, false));
          EXPECT_NE(trainer.contexts.at(n), trainer.contexts.at(n - 1));
        }
        if (n > kFirst + 1) {
          EXPECT_GT(forward_begins, log.at(Part::kAfter, n - 2, false));
        }
        if (n == kDraining + 1) {
          EXPECT_GT(forward_begins, log.at(Part::kAfter, n - 1, false));
        }
      }
      // The linear loss's gradients do not depend on the parameters: applied in order, once each.
      at::Tensor expected = before.clone();
      for (int64_t n = kFirst; n <= kLast; ++n) expected.sub_(coefficient(n), kLr);
      const at::Tensor after = rpc_sync<at::Tensor>(worker(1), "pipeline_weight");
      EXPECT_TRUE(at::allclose(after, expected, 1e-12, 1e-14)) << after << "\nexpected\n"
                                                               << expected;
    }
  });
}

TEST(PipelinedSteps, AFailedStepEndsBothThreadsAndIsRethrown) {
  with_workers([] {
    LoggedTrainer trainer;
    Log& log = trainer.log;
    const StepParts parts = trainer.parts([](Part part, int64_t n) {
      TORCH_CHECK_VALUE(!(part == Part::kStep && n == 5), "the test refuses step 5");
    });
    try {
      run_pipelined(1, 20, parts, PipelineOptions());
      ADD_FAILURE() << "run_pipelined returned";
    } catch (const c10::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("the test refuses step 5"), std::string::npos)
          << e.what();
    }
    // Step 6's forward may have run beside step 5; step 7's needs step 5's optimizer step.
    EXPECT_EQ(log.afters(), (std::vector<int64_t>{1, 2, 3, 4}));
    EXPECT_LE(log.last_forward_begun(), 6);
  });
}

TEST(PipelinedSteps, ATurnWaitedForTooLongNamesTheStepWaitedFor) {
  with_workers([] {
    LoggedTrainer trainer;
    Log& log = trainer.log;
    // Step 2's backward stalls five times the turn's bound: step 3 waits for its optimizer step.
    const StepParts parts = trainer.parts([](Part part, int64_t n) {
      if (part == Part::kBackward && n == 2) std::this_thread::sleep_for(5s);
    });
    PipelineOptions options;
    options.turn_timeout = 1s;
    try {
      run_pipelined(1, 6, parts, options);
      ADD_FAILURE() << "run_pipelined returned";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace())
                    .find("step 3 waited 1 s for step 2's optimizer step, which the trainer's "
                          "other thread had not finished"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(log.afters(), (std::vector<int64_t>{1}));
  });
}

TEST(PipelinedSteps, RefusesAFirstStepBelowOneAndASlowdownBelowOne) {
  const StepParts parts;
  try {
    run_pipelined(0, 3, parts, PipelineOptions());
    ADD_FAILURE() << "first 0 accepted";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("run_pipelined: first step 0 (steps count from 1)"),
              std::string::npos)
        << e.what();
  }
  PipelineOptions slower;
  slower.slowdown = 0.5;
  try {
    run_pipelined(1, 3, parts, slower);
    ADD_FAILURE() << "slowdown 0.5 accepted";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("run_pipelined: slowdown 0.5 is below 1"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace pipeline_test
}  // namespace click_through
