// The streaming probes compiled for the avx512 instruction set (flags in bench/CMakeLists.txt).
#define DISTOPTIM_STREAM_PROBES_FN stream_probes_avx512
#include "stream_probes.inc"
