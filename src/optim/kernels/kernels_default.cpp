// The update kernels compiled for the default instruction set (flags in src/optim/CMakeLists.txt).
#define DISTOPTIM_KERNEL_NAMESPACE isa_default
#include "update_kernels.inc"
