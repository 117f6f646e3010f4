#pragma once

#include <cstdint>

namespace distoptim {
namespace bench {

/// The streaming probes the optimizer steps are compared against. A probe updates `read_write`
/// arrays in place from `read_only` others:
///   x_j[i] += s * (x_rw[i] + ... + x_{rw+ro-1}[i])  for each j < rw  (x_j[i] += s when ro = 0)
/// so it moves 4 * (2 * read_write + read_only) bytes per element, in 2 * rw + ro streams. The
/// optimizers' kernels are of this kind: SGD with momentum, Adagrad and RMSprop update two arrays
/// from the gradient (5 streams), Adam three (7 streams).
struct StreamProbeShape {
  int read_write;
  int read_only;
  int streams() const { return 2 * read_write + read_only; }
  int bytes_per_element() const { return 4 * streams(); }
};

/// From 2 to 7 streams; the probes run on arrays x[0..kStreamProbeArrays).
constexpr StreamProbeShape kStreamProbes[] = {{1, 0}, {1, 1}, {1, 2}, {2, 1}, {2, 2}, {3, 1}};
constexpr int kNumStreamProbes = sizeof(kStreamProbes) / sizeof(kStreamProbes[0]);
constexpr int kStreamProbeArrays = 4;

/// Runs one probe over elements [begin, end) of the arrays `x`.
using StreamProbeFn = void (*)(float* const* x, float s, int64_t begin, int64_t end);

/// The probes compiled for one instruction set, indexed like kStreamProbes. Each set is its own
/// translation unit compiled with that set's flags (see bench/CMakeLists.txt); call a set's
/// probes only when the CPU supports it.
/// Compiled for the compiler's baseline target (x86-64: SSE2) at -O3.
const StreamProbeFn* stream_probes_default();
/// Compiled with -mavx2 -mfma.
const StreamProbeFn* stream_probes_avx2();
/// Compiled with -mavx512f and 512-bit vectors preferred.
const StreamProbeFn* stream_probes_avx512();

}  // namespace bench
}  // namespace distoptim
