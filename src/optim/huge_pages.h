#pragma once

// Transparent huge pages for the large tensors a sparse step reaches into at random rows (an
// embedding table and its optimizer state): with 4 KB pages each row touched is a TLB miss on
// top of its cache miss, and a table of gigabytes outgrows the TLB's reach many times over.
// Advice only: the kernel may decline (THP set to `never`, no huge page free, an old kernel
// without MADV_COLLAPSE), and then nothing changes; values never change either way.

#include <ATen/core/Tensor.h>

namespace distoptim {
namespace optim {
namespace detail {

/// Tensors smaller than this keep their pages: the TLB covers them well enough, and a huge page
/// half used would cost memory.
constexpr size_t kHugePageMinBytes = size_t{32} << 20;

/// Asks for huge pages under the storage of `tensor` when it is a CPU tensor of at least
/// kHugePageMinBytes: MADV_HUGEPAGE, for pages faulted in later, then MADV_COLLAPSE, which moves
/// the pages already touched into huge pages now (a copy of the storage, once; its time is the
/// caller's). Only the whole 2 MB blocks inside the storage are affected. Errors are ignored: a
/// refusal leaves the small pages, which work as before.
void advise_huge_pages(const at::Tensor& tensor);

/// The same for a tensor just made, none of whose pages is touched yet (at::empty): MADV_HUGEPAGE
/// alone, so that its first writes fault in huge pages, one fault for 2 MB where 4 KB pages take
/// 512 (on a virtual machine a fault costs far more than the page's copy).
void advise_huge_pages_before_first_touch(const at::Tensor& tensor);

/// at::empty(sizes, options), contiguous, advised as above when it is large enough: its first
/// writes fault in huge pages.
at::Tensor empty_with_huge_pages(at::IntArrayRef sizes, const at::TensorOptions& options);

/// A contiguous copy of `tensor` in memory of its own, made with empty_with_huge_pages: for the
/// large copies a server keeps or sends (a backup's copy of a shard), whose pages would
/// otherwise fault in 4 KB at a time as the copy writes them.
at::Tensor clone_with_huge_pages(const at::Tensor& tensor);

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
