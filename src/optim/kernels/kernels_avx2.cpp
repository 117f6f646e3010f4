// The update kernels compiled for the avx2 instruction set (flags in src/optim/CMakeLists.txt).
#define DISTOPTIM_KERNEL_NAMESPACE isa_avx2
#include "update_kernels.inc"
