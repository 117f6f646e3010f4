#pragma once

namespace distoptim {
namespace dist_autograd {
namespace detail {

/// Installs the interceptor and registers the engine's internal RPCs (register_engine_functions);
/// idempotent. Runs at start-up.
void install();

}  // namespace detail
}  // namespace dist_autograd
}  // namespace distoptim
