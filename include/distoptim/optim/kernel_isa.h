#pragma once

#include <string>
#include <vector>

namespace distoptim {
namespace optim {

/// The instruction set the fused update kernels run with: "avx512", "avx2" or "default"
/// (whatever the compiler's baseline target gives). Chosen once from the CPU at first use.
std::string kernel_isa();
/// The instruction sets this CPU can run, best first.
std::vector<std::string> supported_kernel_isas();
/// Forces an instruction set, for tests and benchmarks. Throws c10::Error naming the value if
/// it is unknown or the CPU lacks it. Not synchronized with steps running on other threads.
void set_kernel_isa(const std::string& isa);

}  // namespace optim
}  // namespace distoptim
