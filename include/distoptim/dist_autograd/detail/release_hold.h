#pragma once

// Internal: for the DistributedOptimizer's outstanding steps (max_staleness), which read a
// context's gradients on the owners after the trainer's ContextGuard is gone; defined in
// src/dist_autograd/api.cpp. Not part of the public API; names may change.

#include <cstdint>
#include <memory>

namespace distoptim {
namespace dist_autograd {
namespace detail {

/// Keeps context `context_id`, created on this worker and not yet released, from being released
/// here and on the workers it reached while the returned token (or a copy) lives: a ContextGuard
/// destroyed meanwhile leaves it, and the last token's end releases it everywhere. The token may
/// end on any thread. c10::ValueError naming the context when this worker does not hold it.
std::shared_ptr<void> hold_release(int64_t context_id);

}  // namespace detail
}  // namespace dist_autograd
}  // namespace distoptim
