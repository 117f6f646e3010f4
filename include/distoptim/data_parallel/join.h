#pragma once

#include <exception>
#include <memory>
#include <vector>

#include <c10/core/Device.h>
#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <distoptim/comm/process_group.h>

namespace distoptim {
namespace data_parallel {

/// What a rank that has run out of inputs does for one Joinable (torch.distributed.algorithms
/// JoinHook): `main_hook` shadows one training iteration's collectives of the Joinable, while
/// other ranks still train; `post_hook` runs once all have joined (`is_last_joiner`: this rank
/// was among the last to run out).
class JoinHook {
 public:
  virtual ~JoinHook() = default;
  virtual void main_hook() {}
  virtual void post_hook(bool is_last_joiner) { (void)is_last_joiner; }
};

/// Options a Joinable's hook may read (PyTorch passes them as keyword arguments to Join).
struct JoinHookOptions {
  /// DDP: average gradients over the initial world size (ranks that joined contribute zeros)
  /// rather than over the ranks still training.
  TORCH_ARG(bool, divide_by_initial_world_size) = true;
};

class Join;

/// A class whose per-iteration collectives a joined rank can shadow (PyTorch's Joinable):
/// DistributedDataParallel and ZeroRedundancyOptimizer are. A Joinable calls
/// Join::notify_join_context(*this) once per iteration, before its collectives.
class Joinable {
 public:
  virtual ~Joinable() = default;
  virtual std::unique_ptr<JoinHook> join_hook(const JoinHookOptions& options) = 0;
  virtual c10::Device join_device() const = 0;
  virtual const comm::Group& join_process_group() const = 0;

 protected:
  /// Set by a Join for its lifetime.
  struct JoinConfig {
    bool enable = false;
    bool throw_on_early_termination = false;
    bool is_first_joinable = false;
    JoinHookOptions hook_options;
  };
  const JoinConfig& join_config() const { return join_config_; }

 private:
  friend class Join;
  JoinConfig join_config_;
  const Join* join_ = nullptr;  // the Join this takes part in, if any
  // The failure of a join() that ran in a Join's destructor, thrown at the next iteration.
  std::exception_ptr destroyed_join_error_;
};

struct JoinOptions {
  /// false: Join does nothing (the Joinables behave as without it).
  TORCH_ARG(bool, enable) = true;
  /// Instead of shadowing, make every rank throw once one rank runs out of inputs.
  TORCH_ARG(bool, throw_on_early_termination) = false;
  /// Passed to every Joinable's join_hook.
  TORCH_ARG(JoinHookOptions, hook_options) = {};
};

/// Training with uneven inputs (torch.distributed.algorithms.Join): ranks that run out of
/// batches keep shadowing the collectives of the others until every rank is done, so nobody
/// hangs in a collective that a finished rank no longer makes.
///
///   {
///     Join join({&ddp, &zero});           // DDP first: it announces each iteration
///     for (auto& batch : my_batches) {   // any number of batches per rank
///       zero.zero_grad();
///       loss(ddp.forward(batch)).backward();
///       zero.step();
///     }
///     join.join();                       // shadow the others until all are done
///   }
///
/// Each iteration, the first Joinable's notify_join_context allreduces a 1 on the ranks still
/// training; a joined rank allreduces a 0 to count them and, while some train, runs every
/// Joinable's main_hook in list order (the order of their collectives in an iteration). When
/// the count is 0, post hooks run and join() returns.
///
/// With throw_on_early_termination, every rank throws c10::Error ("... exhausted inputs ...")
/// at the first iteration after one rank ran out: the training ranks from notify_join_context,
/// the joined ones from join().
///
/// Collective: every rank constructs a Join over the same Joinables in the same order and
/// calls join() (or lets the destructor do it). Every wait has the group's timeout. All the
/// Joinables must use the same process group (c10::ValueError otherwise). Not thread-safe: one
/// thread drives a replica.
class Join {
 public:
  Join(std::vector<Joinable*> joinables, JoinOptions options = {});
  /// Calls join() if it was not called and no exception is propagating (as leaving PyTorch's
  /// context does), then releases the Joinables. A destructor must not throw, so an error of
  /// that join() is logged (TORCH_WARN) and kept by every Joinable of this Join: the next
  /// iteration of each (DDP's forward, ZeroRedundancyOptimizer's step) throws it, with its class
  /// (a TimeoutError stays one) and "Join: joining when the Join was destroyed failed" in front.
  /// Call join() before the end of the scope to get the error where it happens.
  ~Join();
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  /// This rank has no more inputs: shadows the others until every rank has joined, then runs
  /// the post hooks. Idempotent.
  void join();

  /// Called by a Joinable once per iteration on a rank still training. For the first Joinable
  /// of an enabled Join: allreduces a 1 (returned, not waited for: DDP reads the count of
  /// training ranks from it) and, with throw_on_early_termination, throws if a rank ran out.
  /// Returns null otherwise.
  static c10::intrusive_ptr<c10d::Work> notify_join_context(Joinable& joinable);

 private:
  int64_t count_training_ranks() const;
  [[noreturn]] void notify_ranks_to_terminate() const;
  void release();

  std::vector<Joinable*> joinables_;
  std::vector<std::unique_ptr<JoinHook>> hooks_;
  JoinOptions options_;
  comm::Group group_;
  bool joined_ = false;
  int uncaught_at_construction_ = 0;
};

}  // namespace data_parallel
}  // namespace distoptim
