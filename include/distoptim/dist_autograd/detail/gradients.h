#pragma once

// Internal: for the DistributedOptimizer, the gradients of a context that may never have reached
// this worker; defined in src/dist_autograd/api.cpp. Not part of the public API; names may change.

#include <cstdint>
#include <memory>
#include <unordered_map>

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>

#include <distoptim/rpc/detail/reassigned_rows.h>

namespace distoptim {
namespace dist_autograd {
namespace detail {

/// What a step of a context reads on this worker.
struct ReachedGradients {
  /// The leaf gradients the context's backward passes accumulated here.
  c10::Dict<at::Tensor, at::Tensor> gradients;
  /// For each sparse gradient, by its variable: the position in the rows handed to new keys
  /// (rpc/detail/reassigned_rows.h) from which its rows may hold another key than the one its
  /// gradient is of (the start, here, of the last pass that added to it). Rows handed out before
  /// that are no longer in it (the lookup's backward, or the pass that followed, left them out).
  std::unordered_map<const c10::TensorImpl*, int64_t> reassigned_from;
  /// Keeps those rows readable while the step reads them.
  std::shared_ptr<const rpc::detail::ReassignedRowsPin> pin;
};

/// The gradients of a context that may never have reached this worker: none then (an owner of
/// parameters the backward pass did not reach), where get_gradients throws. c10::ValueError when
/// the context was released here (its creator released it, or was lost). What each owner of a
/// DistributedOptimizer reads at a step, whose call travels outside the context.
ReachedGradients gradients_if_reached(int64_t context_id);

}  // namespace detail
}  // namespace dist_autograd
}  // namespace distoptim
