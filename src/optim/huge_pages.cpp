#include "huge_pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>

// Linux 6.1's value; older C libraries do not name it (older kernels refuse it with EINVAL).
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

namespace distoptim {
namespace optim {
namespace detail {

void advise_huge_pages(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.has_storage() || !tensor.device().is_cpu()) return;
  const c10::Storage& storage = tensor.storage();
  if (storage.nbytes() < kHugePageMinBytes || storage.data() == nullptr) return;
  // madvise wants a page-aligned start; the kernel itself keeps to the whole huge pages inside.
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(storage.data());
  const uintptr_t end = begin + storage.nbytes();
  const uintptr_t aligned = (begin + page - 1) / page * page;
  if (aligned >= end) return;
  void* start = reinterpret_cast<void*>(aligned);
  const size_t length = (end - aligned) / page * page;
  // Errors ignored on purpose (see huge_pages.h): THP off, no huge page to be had, an old
  // kernel, memory LibTorch did not get from mmap; the small pages then stay as they were.
  (void)::madvise(start, length, MADV_HUGEPAGE);
  (void)::madvise(start, length, MADV_COLLAPSE);
}

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
