#pragma once

#include <memory>
#include <string>

#include <distoptim/rpc/registry.h>

namespace distoptim {
namespace rpc {
namespace detail {

/// The function registered as `name`, or null. Thread-safe; the function stays valid while the
/// returned pointer lives.
std::shared_ptr<const RawFunction> find_function(const std::string& name);

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
