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
// with that owner's gradients in the context and returns when all are done. On each owner, steps
// of every DistributedOptimizer in the process are serialized by one lock (two trainers may build
// two optimizers over the same parameters), and run under rpc::InPlaceUpdateGuard, so a reply
// carrying a parameter never mixes values from before and after a step.
//
// Threading: step(), state_dict() and load_state_dict() may be called from any thread; calls on
// one instance must not overlap.

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <distoptim/optim/functional_optimizer.h>
#include <distoptim/optim/option_bag.h>
#include <distoptim/rpc/rref.h>

namespace distoptim {
namespace dist_optim {

/// A checkpoint of a DistributedOptimizer, which PyTorch's lacks: every owner's optimizer state,
/// keyed by owner and by the positions of its parameters in the list the optimizer was built from.
struct DistributedOptimizerStateDict {
  struct Owner {
    std::string worker;               // the owner's name
    std::vector<int64_t> positions;   // its parameters' positions in the constructor's list
    optim::OptimizerStateDict state;  // its optimizer's state, by index into `positions`
  };
  std::string optimizer;
  std::vector<Owner> owners;

  /// A nested GenericDict for torch::pickle_save / torch::save (and Python's torch.load).
  c10::IValue to_ivalue() const;
  static DistributedOptimizerStateDict from_ivalue(const c10::IValue& value);
};

class DistributedOptimizer {
 public:
  /// `optimizer`: a name registered in optim's registry (a user's own included) in this process
  /// and on every owner; `params`: references to the parameters, each a leaf tensor that requires
  /// grad on its owner; `options`: the optimizer's options (only the keys to change). Blocks until
  /// every owner has built its optimizer. Errors, before any message is sent: c10::ValueError for
  /// an empty or repeated parameter list, an optimizer name not registered here (naming those
  /// that are), or an option its optimizer refuses (naming it). An owner's refusal (a parameter it
  /// cannot update, an optimizer registered here but not there) as rpc::RemoteError naming that
  /// worker; nothing is left on any owner then.
  DistributedOptimizer(const std::string& optimizer, std::vector<rpc::RRef<at::Tensor>> params,
                       const optim::OptionBag& options = {});
  ~DistributedOptimizer();
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;

  /// One step on every owner with its gradients in distributed autograd context `context_id`.
  /// A parameter without a gradient there is left as it is, with its state, as in a local step;
  /// an owner that the context never reached (no gradients at all) changes nothing. Errors: every
  /// owner that failed, named (RemoteError, PeerLostError, TimeoutError, the first one's type),
  /// after all owners have answered.
  void step(int64_t context_id);

  /// Every owner's optimizer state (copies).
  DistributedOptimizerStateDict state_dict() const;
  /// Sends each owner its part. The dict must come from an optimizer of the same name over the
  /// same owners and positions (c10::ValueError naming the mismatch, before anything is sent);
  /// an owner's refusal leaves the others loaded (RemoteError naming it).
  void load_state_dict(const DistributedOptimizerStateDict& dict);

  const std::string& optimizer() const { return optimizer_; }
  /// The owners, in order of their first parameter in the list.
  std::vector<std::string> owners() const;

 private:
  struct Owner;
  std::string optimizer_;
  std::vector<Owner> owners_;
};

}  // namespace dist_optim
}  // namespace distoptim
