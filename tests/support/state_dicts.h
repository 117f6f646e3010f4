#pragma once

// Optimizer state dicts compared field by field (tests of the layers that hold one: optim,
// data_parallel, dist_optim).

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <distoptim/optim/functional_optimizer.h>

namespace distoptim {
namespace testing {

/// Equal optimizer names, options, param groups and steps; every state buffer of the same dtype
/// and shape, and within 1e-10, or bit-identical when `exact`.
inline void expect_state_dicts_close(const optim::OptimizerStateDict& actual,
                                     const optim::OptimizerStateDict& expected,
                                     bool exact = false) {
  EXPECT_EQ(actual.optimizer, expected.optimizer);
  EXPECT_EQ(actual.defaults, expected.defaults);
  ASSERT_EQ(actual.param_groups.size(), expected.param_groups.size());
  for (size_t g = 0; g < actual.param_groups.size(); ++g) {
    EXPECT_EQ(actual.param_groups[g].param_indices, expected.param_groups[g].param_indices);
    EXPECT_EQ(actual.param_groups[g].overrides, expected.param_groups[g].overrides);
  }
  ASSERT_EQ(actual.state.size(), expected.state.size());
  for (const auto& [index, state] : expected.state) {
    ASSERT_EQ(actual.state.count(index), 1u) << "no state for parameter " << index;
    const auto& got = actual.state.at(index);
    EXPECT_EQ(got.step, state.step) << "parameter " << index;
    ASSERT_EQ(got.buffers.size(), state.buffers.size()) << "parameter " << index;
    for (const auto& [name, tensor] : state.buffers) {
      ASSERT_EQ(got.buffers.count(name), 1u) << name << " of parameter " << index;
      const at::Tensor& buffer = got.buffers.at(name);
      ASSERT_EQ(buffer.scalar_type(), tensor.scalar_type()) << name << " of parameter " << index;
      ASSERT_EQ(buffer.sizes(), tensor.sizes()) << name << " of parameter " << index;
      EXPECT_TRUE(exact ? at::equal(buffer, tensor) : at::allclose(buffer, tensor, 1e-10, 1e-12))
          << name << " of parameter " << index;
    }
  }
}

}  // namespace testing
}  // namespace distoptim
