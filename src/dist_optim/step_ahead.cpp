// DistributedOptimizer's bounded staleness (max_staleness > 0): steps that return once sent, at
// most max_staleness of them outstanding on any owner (outstanding_steps.h), their failures
// reported at the next step or flush, and the waits that state dicts, rebinding and the
// destructor make for them.

#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <distoptim/dist_autograd/detail/release_hold.h>
#include <distoptim/dist_optim/distributed_optimizer.h>

#include "optimizer_owner.h"
#include "owner_calls.h"

namespace distoptim {
namespace dist_optim {

void DistributedOptimizer::set_max_staleness(int64_t max_staleness) {
  TORCH_CHECK_VALUE(max_staleness >= 0, "DistributedOptimizer::set_max_staleness: max_staleness ",
                    "must be 0 (synchronous steps) or more, got ", max_staleness);
  flush();
  max_staleness_ = max_staleness;
  restart_outstanding();
}

void DistributedOptimizer::flush() {
  if (!outstanding_) return;
  outstanding_->wait_all();
  report_failed_steps("flush()");
}

void DistributedOptimizer::restart_outstanding() {
  if (max_staleness_ == 0) {
    outstanding_.reset();
    return;
  }
  std::vector<std::string> workers;
  std::vector<rpc::RRef<detail::RemoteOptimizer>> optimizers;
  for (const Owner& owner : owners_) {
    workers.push_back(owner.worker);
    optimizers.push_back(owner.optimizer);
  }
  auto next = std::make_unique<Outstanding>(std::move(workers), std::move(optimizers));
  // Failures of the steps before stay to be reported (rebind waited for those steps).
  if (outstanding_) next->keep_failures(outstanding_->take_failures());
  outstanding_ = std::move(next);
}

void DistributedOptimizer::step_ahead(int64_t context_id) {
  std::shared_ptr<void> context_hold;
  try {
    context_hold = dist_autograd::detail::hold_release(context_id);
  } catch (c10::Error& error) {
    error.add_context("DistributedOptimizer::step with max_staleness " +
                      std::to_string(max_staleness_) +
                      ": a step that returns before its owners have read the gradients must be "
                      "taken on the worker that made its context, before its release");
    throw;
  }
  // Every owner has room before any is sent to: a stuck owner's TimeoutError sends nothing. The
  // steps answered meanwhile report their failures now, and this step is not sent.
  for (size_t k = 0; k < owners_.size(); ++k) {
    outstanding_->wait_below(k, static_cast<size_t>(max_staleness_));
  }
  report_failed_steps("step(" + std::to_string(context_id) + ")");
  const int64_t number = ++steps_taken_;
  const c10::AutoGradMode outside_the_context(false);  // as step()'s sends
  for (size_t k = 0; k < owners_.size(); ++k) {
    Owner& owner = owners_[k];
    detail::OwnerStep step{number, context_id, changes_for(owner), {}, context_hold};
    if (!step.changes.isNone()) {
      // Taken as sent: a failure sends the changes again from what the owner had before.
      step.applied_before = std::exchange(owner.applied, current_);
      owner.applied_generation = options_generation_;
    }
    outstanding_->add(k, std::move(step));
  }
}

void DistributedOptimizer::report_failed_steps(const std::string& what) {
  if (!outstanding_) return;
  const std::vector<detail::FailedStep> failed = outstanding_->take_failures();
  if (failed.empty()) return;
  std::exception_ptr first;
  std::string failures;
  std::set<std::string> reset;  // owners whose options are sent again from before their failure
  for (const detail::FailedStep& step : failed) {
    for (Owner& owner : owners_) {
      if (step.carried_changes && owner.worker == step.worker &&
          step.applied_before.size() == current_.size() && reset.insert(owner.worker).second) {
        owner.applied = step.applied_before;
        owner.applied_generation = kResendChanges;
      }
    }
    try {
      std::rethrow_exception(step.error);
    } catch (const std::exception&) {
      detail::note_failure(step.worker, &first, &failures,
                           ", step " + std::to_string(step.number) + " (context " +
                               std::to_string(step.context_id) + ")");
    }
  }
  detail::throw_failures(
      first, std::to_string(failed.size()) + " outstanding step(s), reported by " + what + ",",
      failures);
}

DistributedOptimizer::~DistributedOptimizer() {
  if (!outstanding_) return;
  try {
    flush();
  } catch (const c10::Error& error) {
    TORCH_WARN("~DistributedOptimizer: ", error.what_without_backtrace());
  } catch (const std::exception& error) {
    TORCH_WARN("~DistributedOptimizer: ", error.what());
  }
}

}  // namespace dist_optim
}  // namespace distoptim
