#pragma once

// Internal: what a FunctionalOptimizer keeps between steps for its kernels
// (functional_optimizer.h), defined in src/optim/step_cache.h. Not part of the public API; names
// may change.

namespace distoptim {
namespace optim {
namespace detail {

struct StepCache;

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
