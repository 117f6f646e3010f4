#pragma once

// The part of a DistributedOptimizer that lives on a parameters' owner: a functional optimizer
// over the owner's own tensors. Created by remote() under a reserved class name.

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include <distoptim/optim/functional_optimizer.h>
#include <distoptim/rpc/rref.h>

namespace distoptim {
namespace dist_optim {
namespace detail {

constexpr const char* kRemoteOptimizerClass = "__distoptim.dist_optim.RemoteOptimizer";

class RemoteOptimizer {
 public:
  /// `groups`: this worker's parameters of each group of the DistributedOptimizer (possibly
  /// none), as references to this worker's values; `options` is an OptionBag's to_ivalue(),
  /// `overrides` one per group. Throws what the registry or the optimizer throws for a bad name
  /// or option.
  RemoteOptimizer(std::string optimizer, std::vector<std::vector<rpc::RRef<at::Tensor>>> groups,
                  c10::IValue options, std::vector<c10::IValue> overrides);

  /// A step with the gradients of this worker's copy of context `context_id`, under this
  /// optimizer's mutex and, when the step writes only the rows its sparse gradients name
  /// (FunctionalOptimizer::updates_only_gradient_rows), an rpc::InPlaceRowUpdateGuard on those
  /// rows; otherwise an rpc::InPlaceUpdateGuard. Other optimizers (another trainer's over the
  /// same table) step other rows meanwhile. `changes`: None, or one OptionBag (to_ivalue()) per
  /// group, set on that group (set_group_options) before the step. All or nothing: the gradients
  /// are read first, under the mutex; a released context (its trainer was lost) throws
  /// c10::ValueError with nothing changed, options included.
  void step(int64_t context_id, c10::IValue changes);
  /// OptimizerStateDict::to_ivalue() of the optimizer, and its inverse.
  c10::IValue state_dict();
  void load_state_dict(c10::IValue state);

 private:
  // Guards optimizer_ (options, state, step counts): its calls must not overlap.
  std::mutex mutex_;
  std::unique_ptr<optim::FunctionalOptimizer> optimizer_;
};

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
