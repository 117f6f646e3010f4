#pragma once

// Internal: for the DistributedOptimizer, the gradients of a context that may never have reached
// this worker; defined in src/dist_autograd/api.cpp. Not part of the public API; names may change.

#include <cstdint>

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>

namespace distoptim {
namespace dist_autograd {
namespace detail {

/// The gradients of a context that may never have reached this worker: empty then (an owner of
/// parameters the backward pass did not reach), where get_gradients throws. c10::ValueError when
/// the context was released here (its creator released it, or was lost). What each owner of a
/// DistributedOptimizer reads at a step, whose call travels outside the context.
c10::Dict<at::Tensor, at::Tensor> gradients_if_reached(int64_t context_id);

}  // namespace detail
}  // namespace dist_autograd
}  // namespace distoptim
