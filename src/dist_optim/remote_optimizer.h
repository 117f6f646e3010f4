#pragma once

// The part of a DistributedOptimizer that lives on a parameters' owner: a functional optimizer
// over the owner's own tensors. Created by remote() under a reserved class name.

#include <cstdint>
#include <memory>
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
  /// `params` arrive as references to this worker's values; `options` is an OptionBag's
  /// to_ivalue(). Throws what the registry or the optimizer throws for a bad name or option.
  RemoteOptimizer(std::string optimizer, std::vector<rpc::RRef<at::Tensor>> params,
                  c10::IValue options);

  /// A step with the gradients of this worker's copy of context `context_id`, under the
  /// process-wide step lock and an rpc::InPlaceUpdateGuard.
  void step(int64_t context_id);
  /// OptimizerStateDict::to_ivalue() of the optimizer, and its inverse.
  c10::IValue state_dict();
  void load_state_dict(c10::IValue state);

 private:
  std::unique_ptr<optim::FunctionalOptimizer> optimizer_;
};

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
