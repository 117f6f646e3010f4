#include "outstanding_steps.h"

#include <utility>

#include <ATen/core/grad_mode.h>

#include <distoptim/comm/errors.h>
#include <distoptim/rpc/api.h>
#include <distoptim/rpc/detail/rref_calls.h>

#include "owner_calls.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

namespace {

// Beyond the RPC timeout that bounds every step in flight: what a wait allows for the reply's
// own way back before it says the owner is stuck.
constexpr std::chrono::seconds kReplyMargin{5};

}  // namespace

struct OutstandingSteps::State {
  struct Queue {
    std::string worker;
    rpc::RRef<RemoteOptimizer> optimizer;
    std::deque<OwnerStep> steps;  // the front one is in flight when `in_flight`
    bool in_flight = false;
    uint64_t answered = 0;
  };
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<Queue> queues;
  std::vector<FailedStep> failures;
};

bool OutstandingSteps::finish_front(State& state, size_t owner, std::exception_ptr error) {
  std::shared_ptr<void> hold;  // ends after the lock: the context's release sends messages
  std::lock_guard<std::mutex> lock(state.mutex);
  auto& queue = state.queues[owner];
  OwnerStep done = std::move(queue.steps.front());
  queue.steps.pop_front();
  ++queue.answered;
  if (error) {
    state.failures.push_back({owner, queue.worker, done.number, done.context_id,
                              !done.changes.isNone(), std::move(done.applied_before), error});
  }
  hold = std::move(done.context_hold);
  queue.in_flight = !queue.steps.empty();
  state.changed.notify_all();
  return queue.in_flight;
}

void OutstandingSteps::send_front(const std::shared_ptr<State>& state, size_t owner) {
  for (;;) {
    rpc::RRef<RemoteOptimizer> optimizer;
    std::vector<c10::IValue> args;
    {
      std::lock_guard<std::mutex> lock(state->mutex);
      const auto& queue = state->queues[owner];
      optimizer = queue.optimizer;
      args = rpc::detail::to_values(queue.steps.front().context_id, queue.steps.front().changes);
    }
    try {
      // Outside any context this thread serves, as DistributedOptimizer::step sends its steps.
      const c10::AutoGradMode outside_the_context(false);
      waited_method(optimizer, "step", std::move(args), /*waited_only=*/false)
          .add_done_callback([state, owner](const rpc::RpcFuture<c10::IValue>& reply) {
            std::exception_ptr error;
            try {
              reply.wait();
            } catch (const std::exception&) {
              error = std::current_exception();
            }
            if (finish_front(*state, owner, error)) send_front(state, owner);
          });
      return;
    } catch (const std::exception&) {  // refused before sending (the agent shut down)
      if (!finish_front(*state, owner, std::current_exception())) return;
    }
  }
}

OutstandingSteps::OutstandingSteps(std::vector<std::string> workers,
                                   std::vector<rpc::RRef<RemoteOptimizer>> optimizers)
    : state_(std::make_shared<State>()) {
  for (size_t k = 0; k < workers.size(); ++k) {
    state_->queues.push_back({std::move(workers[k]), std::move(optimizers[k]), {}, false, 0});
  }
}

OutstandingSteps::~OutstandingSteps() {
  try {
    wait_all();
  } catch (const std::exception&) {
    // A stuck owner: its replies' callbacks keep the state alive without us.
  }
}

void OutstandingSteps::wait_below(size_t owner, size_t bound) {
  std::unique_lock<std::mutex> lock(state_->mutex);
  auto& queue = state_->queues[owner];
  const std::chrono::milliseconds timeout = rpc::get_rpc_timeout();
  while (queue.steps.size() >= bound) {
    const uint64_t answered = queue.answered;
    const auto progressed = [&] { return queue.answered != answered; };
    if (timeout.count() <= 0) {
      state_->changed.wait(lock, progressed);
    } else if (!state_->changed.wait_for(lock, timeout + kReplyMargin, progressed)) {
      std::string steps;
      for (const OwnerStep& step : queue.steps) {
        steps += (steps.empty() ? "" : ", ") + std::to_string(step.number);
      }
      throw TimeoutError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                         "DistributedOptimizer: worker '" + queue.worker + "' answered none of " +
                             "its outstanding steps (" + steps + ") within " +
                             std::to_string(timeout.count()) + " ms and " +
                             std::to_string(kReplyMargin.count()) + " s more");
    }
  }
}

void OutstandingSteps::add(size_t owner, OwnerStep step) {
  bool send = false;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    auto& queue = state_->queues[owner];
    queue.steps.push_back(std::move(step));
    send = !queue.in_flight;
    queue.in_flight = true;
  }
  if (send) send_front(state_, owner);
}

void OutstandingSteps::wait_all() {
  for (size_t k = 0; k < state_->queues.size(); ++k) wait_below(k, 1);
}

std::vector<FailedStep> OutstandingSteps::take_failures() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return std::exchange(state_->failures, {});
}

void OutstandingSteps::keep_failures(std::vector<FailedStep> failures) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  failures.insert(failures.end(), std::make_move_iterator(state_->failures.begin()),
                  std::make_move_iterator(state_->failures.end()));
  state_->failures = std::move(failures);
}

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
