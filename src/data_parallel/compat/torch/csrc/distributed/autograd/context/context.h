#pragma once

// Debian 12's libtorch-dev ships c10d's reducer.hpp but not the distributed-autograd headers it
// includes. reducer.hpp needs two names from this one: the ContextPtr alias (a member of the
// Reducer holds one) and DistAutogradContext::GradCallback (a static_assert compares it). Both
// are declared here exactly as LibTorch 1.13 declares them; nothing else of the class is used.
// Searched with -idirafter, so a real header, where installed, takes precedence.

#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>

namespace torch {
namespace distributed {
namespace autograd {

class DistAutogradContext {
 public:
  using GradCallback = std::function<bool(at::Tensor&)>;
};

using ContextPtr = std::shared_ptr<DistAutogradContext>;

}  // namespace autograd
}  // namespace distributed
}  // namespace torch
