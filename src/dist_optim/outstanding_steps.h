#pragma once

// The steps a DistributedOptimizer with max_staleness k > 0 has taken and its owners have not
// yet answered: at most k per owner. Each owner's next step is sent only when its previous one is
// answered, so every owner applies one trainer's steps in the order they were taken (an owner
// runs requests on a pool, in no set order). A step keeps its distributed autograd context from
// being released until its owners have answered, since they read its gradients only then.
// Failures wait here until the trainer's next step or flush.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include <distoptim/optim/option_bag.h>
#include <distoptim/rpc/rref.h>

#include "remote_optimizer.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

/// One owner's part of one step.
struct OwnerStep {
  int64_t number = 0;      // the optimizer's count of steps, from 1
  int64_t context_id = 0;  // whose gradients it applies
  c10::IValue changes;     // option changes by group, or None
  // The options this owner had taken before this step, when it carries changes: after a failure
  // the optimizer sends its changes again from there.
  std::vector<optim::OptionBag> applied_before;
  std::shared_ptr<void> context_hold;  // dist_autograd::detail::hold_release's token
};

/// A step that failed on one owner.
struct FailedStep {
  size_t owner = 0;
  std::string worker;
  int64_t number = 0;
  int64_t context_id = 0;
  bool carried_changes = false;
  std::vector<optim::OptionBag> applied_before;
  std::exception_ptr error;
};

class OutstandingSteps {
 public:
  /// One queue per owner, sending to `optimizers[k]` on worker `workers[k]`.
  OutstandingSteps(std::vector<std::string> workers,
                   std::vector<rpc::RRef<RemoteOptimizer>> optimizers);
  ~OutstandingSteps();  // waits for every step sent (not for its errors)
  OutstandingSteps(const OutstandingSteps&) = delete;
  OutstandingSteps& operator=(const OutstandingSteps&) = delete;

  /// Blocks until owner `owner` has fewer than `bound` steps outstanding. Each step in flight is
  /// bounded by the RPC timeout; past it with no step answered, TimeoutError naming the worker
  /// and its outstanding steps.
  void wait_below(size_t owner, size_t bound);
  /// Queues `step` for owner `owner`, and sends it now if none of its steps is in flight.
  void add(size_t owner, OwnerStep step);
  /// Blocks until no step is outstanding on any owner (as wait_below).
  void wait_all();
  /// The failures so far, oldest first, taken away.
  std::vector<FailedStep> take_failures();
  /// Puts `failures` (another record's, older) before this one's.
  void keep_failures(std::vector<FailedStep> failures);

 private:
  struct State;
  /// Sends owner `owner`'s front step, and on its reply the next, while steps wait. Called
  /// without the lock, with the front step marked in flight.
  static void send_front(const std::shared_ptr<State>& state, size_t owner);
  /// Takes the answered front step off owner `owner`'s queue, noting `error`; true when another
  /// step waits, now marked in flight.
  static bool finish_front(State& state, size_t owner, std::exception_ptr error);

  std::shared_ptr<State> state_;  // shared with the replies' callbacks
};

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
