// The huge-page helpers the servers allocate their large copies with: the tensors they return
// are what at::empty and clone would give (sizes, dtype, contiguity, values, memory of their own),
// whether or not the kernel grants the huge pages (which this test does not assume).

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "huge_pages.h"

namespace distoptim {
namespace optim {
namespace huge_pages_test {

// Sizes below and above detail::kHugePageMinBytes: only the latter are advised.
const std::vector<std::vector<int64_t>> kShapes = {
    {3, 5}, {static_cast<int64_t>(detail::kHugePageMinBytes / sizeof(float) / 64) + 3, 64}};

TEST(HugePages, EmptyWithHugePagesIsAContiguousTensorOfTheSizesAndDtypeAsked) {
  for (const std::vector<int64_t>& shape : kShapes) {
    for (const at::ScalarType dtype : {at::kFloat, at::kLong}) {
      const at::Tensor t = detail::empty_with_huge_pages(shape, at::TensorOptions().dtype(dtype));
      EXPECT_EQ(t.sizes(), at::IntArrayRef(shape));
      EXPECT_EQ(t.scalar_type(), dtype);
      EXPECT_TRUE(t.is_contiguous());
      EXPECT_FALSE(t.requires_grad());
      // Every byte writable: the advice changes no mapping's size.
      t.fill_(7);
      EXPECT_EQ(t.sum().item<double>(), 7.0 * static_cast<double>(t.numel()));
    }
  }
}

TEST(HugePages, CloneWithHugePagesCopiesIntoContiguousMemoryOfItsOwn) {
  at::manual_seed(5);
  for (const std::vector<int64_t>& shape : kShapes) {
    const at::Tensor source = at::randn({shape[1], shape[0]}).t();  // not contiguous
    const at::Tensor copy = detail::clone_with_huge_pages(source);
    EXPECT_TRUE(copy.is_contiguous());
    EXPECT_TRUE(at::equal(copy, source));
    EXPECT_NE(copy.storage().data(), source.storage().data());
    // Later changes of the source do not reach the copy.
    const at::Tensor before = copy.clone();
    source.add_(1);
    EXPECT_TRUE(at::equal(copy, before));
  }
}

}  // namespace huge_pages_test
}  // namespace optim
}  // namespace distoptim
