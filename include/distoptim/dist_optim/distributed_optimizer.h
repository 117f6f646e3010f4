#pragma once

// The DistributedOptimizer (torch.distributed.optim.DistributedOptimizer): updates parameters
// that live on other workers with the gradients a distributed backward pass left there.
//
//   std::vector<RRef<at::Tensor>> params = ...;  // on any workers, this one included
//   DistributedOptimizer optimizer("sgd", params, OptionBag().set("lr", 0.05));
//   {
//     dist_autograd::ContextGuard context;
//     at::Tensor loss = ...;  // a forward pass through RPCs
//     dist_autograd::backward(context.id(), {loss});
//     optimizer.step(context.id());
//   }
//
// One functional optimizer per owner, created there (through a remote class that users cannot
// name), holds the state of that owner's parameters. step() runs every owner's optimizer at once
// with that owner's gradients in the context and returns when all are done. On each owner, the
// steps of one DistributedOptimizer are serialized by its own lock. Two trainers may build two
// optimizers over the same parameters: a step locks only what it writes, under
// rpc::InPlaceRowUpdateGuard (row_guard.h): of a parameter whose gradient is sparse and whose
// update moves only its rows (SGD without momentum, Adagrad, SparseAdam), those rows; of any
// other parameter with a gradient, all of it. Steps of disjoint rows or of other parameters run at
// once, and lookups of them go on; steps of shared rows or parameters take turns (a parameter
// that is a view into a larger storage takes the process-wide rpc::InPlaceUpdateGuard). Either
// way no update is lost, and a reply carrying a parameter or rows of it (an embedding lookup)
// never mixes values from before and after a step.
//
// Beyond PyTorch's: param groups with options of their own, options that change between steps
// (set_group_options), and a torch::optim::Optimizer face, so LibTorch's LR schedulers drive it:
//
//   DistributedOptimizer optimizer("sgd", {{weights, OptionBag().set("momentum", 0.9)},
//                                          {biases, OptionBag().set("weight_decay", 0.0)}},
//                                  OptionBag().set("lr", 0.1).set("weight_decay", 1e-4));
//   torch::optim::StepLR schedule(optimizer, /*step_size=*/5, /*gamma=*/0.5);
//   for (...) {
//     dist_autograd::ContextGuard context;
//     ...  // forward, dist_autograd::backward
//     optimizer.step(context.id());  // or optimizer.step(): the current context
//     schedule.step();
//   }
//
// Threading: step(), state_dict() and load_state_dict() may be called from any thread; calls on
// one instance (an LR scheduler's included) must not overlap.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <distoptim/dist_optim/detail/owner_access.h>
#include <distoptim/optim/functional_optimizer.h>
#include <distoptim/optim/option_bag.h>
#include <distoptim/optim/torch_adapter.h>
#include <distoptim/rpc/rref.h>

namespace distoptim {
namespace dist_optim {

/// A checkpoint of a DistributedOptimizer, which PyTorch's lacks: every owner's optimizer state,
/// keyed by owner and by the positions of its parameters in the list the optimizer was built from
/// (with param groups: their lists concatenated, group 0 first).
struct DistributedOptimizerStateDict {
  struct Owner {
    std::string worker;               // the owner's name
    std::vector<int64_t> positions;   // its parameters' positions in the constructor's list
    optim::OptimizerStateDict state;  // its optimizer's state, by index into `positions`; one
                                      // group per group of the DistributedOptimizer
  };
  std::string optimizer;
  std::vector<Owner> owners;

  /// A nested GenericDict for torch::pickle_save / torch::save (and Python's torch.load).
  c10::IValue to_ivalue() const;
  static DistributedOptimizerStateDict from_ivalue(const c10::IValue& value);
};

/// One param group of a DistributedOptimizer: parameters on any workers and the options that
/// override the optimizer's for them (Python's `{"params": [...], "lr": 0.1}`).
struct RemoteParamGroup {
  RemoteParamGroup(std::vector<rpc::RRef<at::Tensor>> params, optim::OptionBag overrides = {})
      : params(std::move(params)), overrides(std::move(overrides)) {}
  std::vector<rpc::RRef<at::Tensor>> params;
  optim::OptionBag overrides;
};

/// As a torch::optim::Optimizer (so LibTorch's LR schedulers, which read and write
/// `param_groups()[g].options().get_lr()/set_lr()`, drive it): `param_groups()` holds one
/// OptimizerParamGroup per group WITHOUT tensors (the parameters live on their owners), whose
/// options are an optim::AdapterOptions with the group's complete options (the optimizer's
/// defaults, then the constructor's options, then the group's overrides); `defaults()` the same
/// without a group's overrides. A change made there (`set_lr`, `AdapterOptions::set`) is checked
/// at the next step, before anything is sent, and reaches each owner with that step; so does one
/// made through set_group_options, which checks it at once. The base class's state() stays empty
/// and its zero_grad() does nothing (no tensors here; gradients live in the autograd contexts).
/// Groups added through the base class's add_param_group make every step throw c10::ValueError:
/// groups are fixed at construction.
class DistributedOptimizer : public torch::optim::Optimizer {
 public:
  /// `optimizer`: a name registered in optim's registry (a user's own included) in this process
  /// and on every owner; `params`: references to the parameters, each a leaf tensor that requires
  /// grad on its owner; `options`: the optimizer's options (only the keys to change). One param
  /// group. Blocks until every owner has built its optimizer. Errors, before any message is sent:
  /// c10::ValueError for an empty or repeated parameter list, an optimizer name not registered
  /// here (naming those that are), or an option its optimizer refuses (naming it). An owner's
  /// refusal (a parameter it cannot update, an optimizer registered here but not there) as
  /// rpc::RemoteError naming that worker; nothing is left on any owner then.
  DistributedOptimizer(const std::string& optimizer, std::vector<rpc::RRef<at::Tensor>> params,
                       const optim::OptionBag& options = {});
  /// Param groups, as the list form (whose rules apply to all groups' parameters together): group
  /// g's overrides apply over `options` for its parameters, on every owner. Each owner holds as
  /// many groups (its parameters of each, possibly none), so group g means the same everywhere.
  /// A group may be empty, but not all of them. Errors also: c10::ValueError naming the group
  /// and the option for an override its optimizer refuses, before any message is sent.
  DistributedOptimizer(const std::string& optimizer, std::vector<RemoteParamGroup> groups,
                       const optim::OptionBag& options = {});
  /// The same from a typed options struct, as LibTorch's optimizers take theirs; the options'
  /// type names the optimizer (its `kOptimizer`: SGDOptions "sgd", AdamOptions "adam", ...; a
  /// user's own struct declares the name it registered):
  ///   DistributedOptimizer optimizer(params, optim::AdamOptions(1e-3).betas({0.9, 0.98}));
  template <class Options, class = decltype(Options::kOptimizer)>
  DistributedOptimizer(std::vector<rpc::RRef<at::Tensor>> params, const Options& options)
      : DistributedOptimizer(std::string(Options::kOptimizer), std::move(params),
                             optim::options_to_bag(options)) {}
  template <class Options, class = decltype(Options::kOptimizer)>
  DistributedOptimizer(std::vector<RemoteParamGroup> groups, const Options& options)
      : DistributedOptimizer(std::string(Options::kOptimizer), std::move(groups),
                             optim::options_to_bag(options)) {}
  ~DistributedOptimizer() override;
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;

  /// One step on every owner with its gradients in distributed autograd context `context_id`.
  /// A parameter without a gradient there is left as it is, with its state, as in a local step;
  /// an owner that the context never reached (no gradients at all) changes nothing, and does not
  /// join the context (the step's calls travel outside it: nothing is recorded for them). Option
  /// changes made since an owner last took one travel with its step (nothing extra otherwise)
  /// and apply before it. Errors: c10::ValueError naming the group and option for a change made
  /// through param_groups() that the optimizer refuses, before anything is sent; every owner that
  /// failed, named, after all owners have answered: a PeerLostError when any owner was lost
  /// (whatever the others said: a replicated owner whose backup died fails with a RemoteError),
  /// else the first failure's type (RemoteError, TimeoutError). An owner that failed is sent its
  /// option changes again next step.
  void step(int64_t context_id);
  /// Bounded staleness, which PyTorch's lacks (the parameter-server paper's bounded delay): with
  /// max_staleness k > 0, step() returns once its calls are on their way, with at most k steps
  /// of this optimizer outstanding on any owner (it first waits for the oldest as needed), so a
  /// trainer runs its next forward and backward while its last steps are applied, reading
  /// parameters up to k steps behind its own. Each owner applies this optimizer's steps in the
  /// order they were taken (its next is sent when its last is answered). The step's context may
  /// be released at once (its ContextGuard destroyed): it stays on the owners until they have
  /// stepped with it; a step with k > 0 must be taken on the worker that made its context
  /// (c10::ValueError otherwise). An outstanding step's failure is reported by the next step(),
  /// which then sends nothing, or by flush(): every failed step named by worker, step number
  /// (from 1, as counted here) and context, of the first failure's type as step()'s. The default
  /// k = 0 is PyTorch's synchronous step. Changing k first flush()es. c10::ValueError naming the
  /// value for k < 0.
  void set_max_staleness(int64_t max_staleness);
  int64_t max_staleness() const { return max_staleness_; }
  /// Waits until no step of this optimizer is outstanding, then reports the failures of those
  /// that failed (as above). Each wait is bounded by the RPC timeout of the step it waits for.
  /// state_dict() waits for them too (without reporting), load_state_dict(), rebind() and
  /// set_max_staleness() flush; the destructor waits and warns of failures no one heard of.
  void flush();

  /// LibTorch's form: runs `closure` (if any) with grad mode on, then step(context_id) with this
  /// thread's current distributed autograd context (dist_autograd::ContextGuard); returns the
  /// closure's loss (undefined without one). c10::ValueError, before the closure runs, when no
  /// context is current.
  at::Tensor step(LossClosure closure = nullptr) override;

  size_t num_param_groups() const { return param_groups_.size(); }
  /// The complete options of group `group`, as the next step will use them (param_groups()'s).
  optim::OptionBag group_options(size_t group) const;
  /// Changes some options of group `group` from the next step on; checked at once, here:
  /// c10::IndexError naming a group that does not exist, c10::ValueError (TypeError for a value
  /// of the wrong type) naming the group and the option the optimizer refuses. On error nothing
  /// changes.
  void set_group_options(size_t group, const optim::OptionBag& changes);

  /// Every owner's optimizer state (copies), its groups' overrides as options are set here (a
  /// change not yet sent included, so a checkpoint taken after an LR scheduler's step resumes
  /// with the new rate). c10::ValueError as step() for a change the optimizer refuses.
  DistributedOptimizerStateDict state_dict() const;
  /// Sends each owner its part, then takes each group's options from the dict (its first
  /// owner's). The dict must come from an optimizer of the same name over the same owners,
  /// positions and number of groups (c10::ValueError naming the mismatch, before anything is
  /// sent); an owner's refusal leaves the others loaded (RemoteError naming it).
  void load_state_dict(const DistributedOptimizerStateDict& dict);

  /// torch::save(optimizer, path) writes state_dict() (fetched from the owners) as the optimizer
  /// adapters write theirs; torch::load(optimizer, path) reads it and load_state_dict()s it, with
  /// its errors (c10::ValueError for an archive without that entry).
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  const std::string& optimizer() const { return optimizer_; }
  /// The owners, in order of their first parameter in the list.
  std::vector<std::string> owners() const;

  /// After an owner died and was started again under its name, or its backup took over its
  /// parameters (dist_optim/recovery.h does all of it): replaces old_params[i], a parameter this
  /// optimizer holds (the same reference it was given, or an earlier rebind's), by
  /// new_params[i]. An owner's parameters are replaced all at once, all by parameters of one
  /// worker (its own name's new incarnation, or another worker). The optimizer of each worker
  /// that gets new parameters is made anew there, with every group's current options: the new
  /// parameters without state, and a worker's own parameters that stay with the state they had
  /// (a worker that takes another's parameters holds them beside its own, in one optimizer).
  /// Errors, changing nothing: c10::ValueError for lists of different lengths, an empty or
  /// repeated reference, one this optimizer does not hold, an owner only some of whose
  /// parameters are given, or one whose new parameters are on several workers (each named by
  /// its index); the new owners' refusals (RemoteError, PeerLostError naming them).
  void rebind(const std::vector<rpc::RRef<at::Tensor>>& old_params,
              const std::vector<rpc::RRef<at::Tensor>>& new_params);
  /// The parameters this optimizer holds, in the order it was given them (rebound ones replaced).
  std::vector<rpc::RRef<at::Tensor>> parameters() const;

 private:
  friend struct detail::OwnerAccess;  // the owners' remote optimizers, for the table checkpoints
  struct Owner;
  struct Outstanding;  // the steps sent and not yet answered, with max_staleness > 0
  /// step() with max_staleness > 0.
  void step_ahead(int64_t context_id);
  /// Reports the outstanding steps' failures (as step's errors); `what` names the call.
  void report_failed_steps(const std::string& what);
  /// A new record of outstanding steps for the current owners (none with max_staleness 0).
  void restart_outstanding();
  /// The option changes `owner` has not taken, by group, or None (and it is marked current).
  c10::IValue changes_for(Owner& owner) const;
  // An owner's applied_generation that matches none: its changes are computed again.
  static constexpr uint64_t kResendChanges = ~uint64_t{0};
  /// Checks the options of param_groups() against the last checked ones and takes them as
  /// current; throws, changing nothing for that group, when the optimizer refuses them.
  void check_pending_changes() const;
  /// Takes `wanted` as group `group`'s options once check_ accepts the difference; `how` names
  /// the way of the change in an error.
  void apply_checked(size_t group, const optim::OptionBag& wanted, const char* how) const;
  /// The options of group `group` in param_groups(), checked for shape.
  const optim::OptionBag& mirror_options(size_t group) const;
  /// Makes param_groups()'s options of group `group` current_[group].
  void mirror_current(size_t group);

  std::string optimizer_;
  std::vector<Owner> owners_;
  // A local optimizer over one empty tensor per group: it checks a change as every owner will.
  // It, current_ and options_generation_ are the record of checked options, which the const
  // state_dict() brings up to date too.
  std::unique_ptr<optim::FunctionalOptimizer> check_;
  // Each group's complete options as checked, what the next step sends; changing them starts a
  // new generation.
  mutable std::vector<optim::OptionBag> current_;
  mutable uint64_t options_generation_ = 0;
  int64_t max_staleness_ = 0;
  int64_t steps_taken_ = 0;  // numbers the steps in errors
  std::unique_ptr<Outstanding> outstanding_;
};

}  // namespace dist_optim
}  // namespace distoptim
