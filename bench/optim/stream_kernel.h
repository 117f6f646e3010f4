#pragma once

#include <cstdint>

namespace distoptim {
namespace bench {

/// The STREAM-style in-place kernel the optimizer steps are compared against:
/// `a[i] += s * b[i]` for i in [0, n), which reads 8 and writes 4 bytes per element.
/// One copy per instruction set, each in its own translation unit compiled with that set's flags
/// (see bench/CMakeLists.txt); call a copy only when the CPU supports its instruction set.
using StreamUpdateFn = void (*)(float* a, const float* b, float s, int64_t n);

/// Compiled for the compiler's baseline target (x86-64: SSE2) at -O3.
void stream_update_default(float* a, const float* b, float s, int64_t n);
/// Compiled with -mavx2 -mfma.
void stream_update_avx2(float* a, const float* b, float s, int64_t n);
/// Compiled with -mavx512f and 512-bit vectors preferred.
void stream_update_avx512(float* a, const float* b, float s, int64_t n);

}  // namespace bench
}  // namespace distoptim
