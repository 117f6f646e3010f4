#include "stream_kernel.h"

namespace distoptim {
namespace bench {

// A plain loop: with -O3 (and no aliasing, promised by __restrict) GCC vectorizes it for the
// instruction set this file is compiled for. Nothing else is in this file, so no inline function
// from a shared header is compiled with these flags.
void stream_update_default(float* a, const float* b, float s, int64_t n) {
  float* __restrict out = a;
  const float* __restrict in = b;
  for (int64_t i = 0; i < n; ++i) out[i] += s * in[i];
}

}  // namespace bench
}  // namespace distoptim
