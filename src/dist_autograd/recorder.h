#pragma once

#include <memory>

namespace distoptim {
namespace dist_autograd {
namespace detail {

class Context;

/// Installs the interceptor and registers the internal RPCs; idempotent. Runs at start-up.
void install();

/// Fails the context's running pass and tells every worker it reached, except `except`, to
/// release it (they tell theirs). Does not wait.
void release_everywhere(const std::shared_ptr<Context>& context, int except = -1);

}  // namespace detail
}  // namespace dist_autograd
}  // namespace distoptim
