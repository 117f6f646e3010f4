// A context's gradients: which ones accumulate keeps as handed over and which it copies (a
// gradient someone else can still reach must be copied; one nobody else holds need not be).

#include "context.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

namespace distoptim {
namespace dist_autograd {
namespace detail {
namespace context_test {

// Hands `grad` over as backward does (the last reference) and says whether the context kept that
// very memory.
bool kept_as_is(at::Tensor grad) {
  Context context(1);
  const at::Tensor variable = at::zeros({2, 3});
  const void* memory = grad.data_ptr();
  const at::Tensor expected = grad.clone();
  context.accumulate(variable, std::move(grad));
  const at::Tensor held = context.gradient(variable);
  EXPECT_TRUE(held.equal(expected));
  return held.data_ptr() == memory;
}

TEST(ContextAccumulate, KeepsAGradientNobodyElseHolds) {
  EXPECT_TRUE(kept_as_is(at::randn({2, 3})));
}

TEST(ContextAccumulate, KeepsAWholeContiguousViewWhoseBaseNobodyElseHolds) {
  at::Tensor view = at::randn({6}).view({2, 3});
  ASSERT_TRUE(view.is_view());
  EXPECT_TRUE(kept_as_is(std::move(view)));
}

TEST(ContextAccumulate, CopiesAViewWhoseBaseIsStillHeld) {
  const at::Tensor base = at::randn({6});
  const at::Tensor before = base.clone();
  EXPECT_FALSE(kept_as_is(base.view({2, 3})));
  EXPECT_TRUE(base.equal(before));
}

TEST(ContextAccumulate, CopiesAViewOfPartOfAStorage) {
  EXPECT_FALSE(kept_as_is(at::randn({12}).narrow(0, 6, 6).view({2, 3})));
}

TEST(ContextAccumulate, CopiesATransposedView) { EXPECT_FALSE(kept_as_is(at::randn({3, 2}).t())); }

TEST(ContextAccumulate, CopiesAGradientSharedWithAnotherTensor) {
  const at::Tensor grad = at::randn({2, 3});
  EXPECT_FALSE(kept_as_is(grad));
}

}  // namespace context_test
}  // namespace detail
}  // namespace dist_autograd
}  // namespace distoptim
