#include "pipelined_steps.h"

#include <condition_variable>
#include <cstdio>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

#include <c10/util/Exception.h>
#include <fmt/core.h>

#include <distoptim/dist_autograd.h>

namespace click_through {

void PhaseTimes::print(const std::string& name) const {
  if (steps == 0) return;
  const auto ms = [&](Duration d) {
    return std::chrono::duration<double, std::milli>(d).count() / static_cast<double>(steps);
  };
  const double all = ms(forward) + ms(backward) + ms(step);
  fmt::print(
      "{}: {} steps, each on average: forward {:.2f} ms, backward {:.2f} ms, optimizer step "
      "{:.2f} ms ({:.1f}% of the three)\n",
      name, steps, ms(forward), ms(backward), ms(step), 100 * ms(step) / all);
  std::fflush(stdout);
}

namespace {

using Clock = std::chrono::steady_clock;

// What the two threads tell each other, under `mutex`.
class Turns {
 public:
  Turns(int64_t first, const PipelineOptions& options)
      : forwards_done_(first - 1), steps_done_(first - 1), timeout_(options.turn_timeout) {}

  // Waits until step n's forward may start; returns the time since step n-1's forward began (the
  // last step's length, for the slowdown), or nullopt once the other thread failed. `drained`:
  // whether step n-1's `after` must have returned too.
  std::optional<Clock::duration> wait_to_forward(int64_t n, bool drained) {
    std::unique_lock<std::mutex> lock(mutex_);
    const int64_t steps_needed = drained ? n - 1 : n - 2;
    wait(
        lock, n, [&] { return forwards_done_ >= n - 1 && steps_done_ >= steps_needed; },
        [&] {
          return forwards_done_ < n - 1 ? fmt::format("step {}'s forward", n - 1)
                                        : fmt::format("step {}'s optimizer step", steps_needed);
        });
    if (failure_) return std::nullopt;
    return Clock::now() - last_forward_began_;
  }

  void forward_done(int64_t n, Clock::time_point began) {
    std::lock_guard<std::mutex> lock(mutex_);
    forwards_done_ = n;
    last_forward_began_ = began;
    changed_.notify_all();
  }

  // Waits until step n-1's optimizer step and `after` returned; false once the other failed.
  bool wait_to_step(int64_t n) {
    std::unique_lock<std::mutex> lock(mutex_);
    wait(
        lock, n, [&] { return steps_done_ >= n - 1; },
        [&] { return fmt::format("step {}'s optimizer step", n - 1); });
    return !failure_;
  }

  void step_done(int64_t n) {
    std::lock_guard<std::mutex> lock(mutex_);
    steps_done_ = n;
    changed_.notify_all();
  }

  // The first failure is kept; the other thread stops at its next wait.
  void fail(std::exception_ptr failure) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_) failure_ = std::move(failure);
    changed_.notify_all();
  }

  // The first failure, if any.
  std::exception_ptr failure() {
    std::lock_guard<std::mutex> lock(mutex_);
    return failure_;
  }

 private:
  template <typename Ready, typename Missing>
  void wait(std::unique_lock<std::mutex>& lock, int64_t n, Ready ready, Missing missing) {
    const bool in_time = changed_.wait_for(lock, timeout_, [&] { return failure_ || ready(); });
    TORCH_CHECK(in_time, "click_through: step ", n, " waited ", timeout_.count(), " s for ",
                missing(), ", which the trainer's other thread had not finished");
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  int64_t forwards_done_;  // the last step whose forward returned
  int64_t steps_done_;     // the last step whose optimizer step and `after` returned
  Clock::time_point last_forward_began_ = Clock::now();
  std::exception_ptr failure_;  // set once: the first part that threw
  const std::chrono::seconds timeout_;
};

// Steps first, first + 2, ... up to last, on the calling thread.
void take_turns(int64_t first, int64_t last, int64_t pipeline_first, const StepParts& parts,
                const PipelineOptions& options, Turns& turns, PhaseTimes& phases) {
  for (int64_t n = first; n <= last; n += 2) {
    const bool drained = n > pipeline_first && parts.drains && parts.drains(n - 1);
    const std::optional<Clock::duration> last_took = turns.wait_to_forward(n, drained);
    if (!last_took) return;
    if (options.slowdown > 1 && n > pipeline_first) {
      std::this_thread::sleep_for(*last_took * (options.slowdown - 1));
    }
    const auto began = Clock::now();
    at::Tensor loss;
    {
      distoptim::dist_autograd::ContextGuard context;
      loss = parts.forward(n);
      const auto forward_done = Clock::now();
      turns.forward_done(n, began);
      parts.backward(n, context.id(), loss);
      const auto backward_done = Clock::now();
      if (!turns.wait_to_step(n)) return;
      const auto step_began = Clock::now();
      parts.optimizer_step(n, context.id());
      phases.forward += forward_done - began;
      phases.backward += backward_done - forward_done;
      phases.step += Clock::now() - step_began;
      ++phases.steps;
    }
    parts.after(n, loss);
    turns.step_done(n);
  }
}

}  // namespace

PhaseTimes run_pipelined(int64_t first, int64_t last, const StepParts& parts,
                         const PipelineOptions& options) {
  TORCH_CHECK_VALUE(first >= 1, "run_pipelined: first step ", first, " (steps count from 1)");
  TORCH_CHECK_VALUE(options.slowdown >= 1, "run_pipelined: slowdown ", options.slowdown,
                    " is below 1");
  Turns turns(first, options);
  PhaseTimes phases[2];
  const auto body = [&](int thread) {
    try {
      take_turns(first + thread, last, first, parts, options, turns, phases[thread]);
    } catch (...) {
      turns.fail(std::current_exception());
    }
  };
  std::thread second(body, 1);
  body(0);
  second.join();
  if (const std::exception_ptr failure = turns.failure()) std::rethrow_exception(failure);
  PhaseTimes all;
  for (const PhaseTimes& p : phases) {
    all.steps += p.steps;
    all.forward += p.forward;
    all.backward += p.backward;
    all.step += p.step;
  }
  return all;
}

}  // namespace click_through
