#pragma once

// A trainer's steps two at a time: step n's forward runs while step n-1's backward and optimizer
// step are under way, the parameter server paper's worker that pulls its next parameters while it
// pushes its last gradients. Each step runs in a distributed autograd context of its own, on one of
// two threads that take the steps in turn (a context is current on the thread that made it), so
// the servers work on one step's backward and the next one's forward at once, where a trainer that
// steps one at a time leaves them idle in turns.
//
// What a forward reads: step n's forward starts once step n-1's forward is done and step n-2's
// optimizer step has returned, so it misses at most step n-1 and the steps the optimizer left
// outstanding when step n-2's returned. With DistributedOptimizer::set_max_staleness(K - 1) that
// is K steps of this trainer at most: the example's --max-staleness K.

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include <ATen/core/Tensor.h>

namespace click_through {

/// Where a trainer's steps spend their time, summed over the steps taken: what bounded staleness
/// can hide is the waits on the servers.
struct PhaseTimes {
  using Duration = std::chrono::steady_clock::duration;
  int64_t steps = 0;
  Duration forward{}, backward{}, step{};

  /// One line: the mean of each phase per step and the optimizer step's share of the three.
  void print(const std::string& name) const;
};

/// One step's parts, each called with the step's number.
struct StepParts {
  /// The forward: the loss, computed with a distributed autograd context current on the calling
  /// thread (the step's own).
  std::function<at::Tensor(int64_t step)> forward;
  /// The backward of that context; runs while the next step's forward does.
  std::function<void(int64_t step, int64_t context_id, const at::Tensor& loss)> backward;
  /// The optimizer step of that context; called in step order, once the last one returned.
  std::function<void(int64_t step, int64_t context_id)> optimizer_step;
  /// After the optimizer step, in step order, one at a time (the loss's value, a report).
  std::function<void(int64_t step, const at::Tensor& loss)> after;
  /// Whether the next step's forward waits for this step's `after` (an evaluation that must see
  /// no forward running, such as one that switches the model to eval mode). May be empty: never.
  std::function<bool(int64_t step)> drains;
};

struct PipelineOptions {
  /// Each step's work takes this many times as long, as on a slower machine: before step n's
  /// forward the trainer sleeps (slowdown - 1) times the time from step n-1's forward to the
  /// moment step n's may start (1: no sleep).
  double slowdown = 1;
  /// The longest one thread waits for the other to reach its turn (a wait past it throws
  /// c10::Error naming the step waited for and what it waits for). The other thread's parts are
  /// bounded by the RPC timeout; this bounds the rest.
  std::chrono::seconds turn_timeout{600};
};

/// Runs steps first .. last (first >= 1) of `parts`, two in flight at once, and returns the time
/// spent in each phase. The first part that throws ends both threads, and its exception is
/// rethrown here once both have stopped; no step's forward begins after it.
PhaseTimes run_pipelined(int64_t first, int64_t last, const StepParts& parts,
                         const PipelineOptions& options);

}  // namespace click_through
