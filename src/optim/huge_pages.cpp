#include "huge_pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>

#include <ATen/ATen.h>

// Linux 6.1's value; older C libraries do not name it (older kernels refuse it with EINVAL).
#ifdef MADV_COLLAPSE
constexpr int kMadviseCollapse = MADV_COLLAPSE;
#else
constexpr int kMadviseCollapse = 25;
#endif

namespace distoptim {
namespace optim {
namespace detail {

namespace {

// Gives `advise` the page-aligned part of `tensor`'s storage, where it is a CPU tensor of at
// least kHugePageMinBytes. madvise wants a page-aligned start; the kernel itself keeps to the
// whole huge pages inside.
template <typename Advise>
void with_storage_pages(const at::Tensor& tensor, Advise advise) {
  if (!tensor.defined() || !tensor.has_storage() || !tensor.device().is_cpu()) return;
  const c10::Storage& storage = tensor.storage();
  if (storage.nbytes() < kHugePageMinBytes || storage.data() == nullptr) return;
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(storage.data());
  const uintptr_t end = begin + storage.nbytes();
  const uintptr_t aligned = (begin + page - 1) / page * page;
  if (aligned >= end) return;
  advise(reinterpret_cast<void*>(aligned), (end - aligned) / page * page);
}

}  // namespace

void advise_huge_pages(const at::Tensor& tensor) {
  // Errors ignored on purpose (see huge_pages.h): THP off, no huge page to be had, an old
  // kernel, memory LibTorch did not get from mmap; the small pages then stay as they were.
  with_storage_pages(tensor, [](void* start, size_t length) {
    (void)::madvise(start, length, MADV_HUGEPAGE);
    (void)::madvise(start, length, kMadviseCollapse);
  });
}

void advise_huge_pages_before_first_touch(const at::Tensor& tensor) {
  with_storage_pages(
      tensor, [](void* start, size_t length) { (void)::madvise(start, length, MADV_HUGEPAGE); });
}

at::Tensor empty_with_huge_pages(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor tensor = at::empty(sizes, options.memory_format(at::MemoryFormat::Contiguous));
  advise_huge_pages_before_first_touch(tensor);
  return tensor;
}

at::Tensor clone_with_huge_pages(const at::Tensor& tensor) {
  return empty_with_huge_pages(tensor.sizes(), tensor.options()).copy_(tensor);
}

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
