#pragma once

// What this process holds in memory, for tests that check that a long-running worker (a
// parameter server outliving its trainers) returns to a baseline; with the bounded poll they wait
// for it with (wait_until.h).

#include <malloc.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

#include "support/sanitizers.h"
#include "support/wait_until.h"

namespace distoptim {
namespace testing {

/// False under AddressSanitizer, whose allocator keeps freed memory in quarantine and does not
/// answer mallinfo2: memory bounds are checked only without it.
constexpr bool kChecksMemory = !DISTOPTIM_UNDER_ASAN;

/// The process's resident memory in bytes (-1 if unknown), malloc trimmed first: freed memory
/// the allocator still keeps would read as held.
inline int64_t resident_bytes() {
  malloc_trim(0);
  long pages = 0;
  long resident = 0;
  FILE* statm = std::fopen("/proc/self/statm", "r");
  if (statm == nullptr) return -1;
  const int read = std::fscanf(statm, "%ld %ld", &pages, &resident);
  std::fclose(statm);
  return read == 2 ? resident * sysconf(_SC_PAGESIZE) : -1;
}

/// Bytes malloc has handed out and not had back, in every arena and mapped alone (all of
/// LibTorch's tensors, and our objects).
inline int64_t allocated_bytes() {
  const struct mallinfo2 m = mallinfo2();
  return static_cast<int64_t>(m.uordblks + m.hblkhd);
}

}  // namespace testing
}  // namespace distoptim
