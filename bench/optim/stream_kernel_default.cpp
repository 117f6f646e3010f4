// The streaming probes compiled for the default instruction set (flags in bench/CMakeLists.txt).
#define DISTOPTIM_STREAM_PROBES_FN stream_probes_default
#include "stream_probes.inc"
