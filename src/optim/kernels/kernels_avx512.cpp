// The update kernels compiled for the avx512 instruction set (flags in src/optim/CMakeLists.txt).
#define DISTOPTIM_KERNEL_NAMESPACE isa_avx512
#include "update_kernels.inc"
