// The streaming probes compiled for the avx2 instruction set (flags in bench/CMakeLists.txt).
#define DISTOPTIM_STREAM_PROBES_FN stream_probes_avx2
#include "stream_probes.inc"
