#include <distoptim/optim/kernel_isa.h>

#include <atomic>

#include <c10/util/Exception.h>

#include "update_task.h"

namespace distoptim {
namespace optim {
namespace {

enum class Isa : int { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };

bool cpu_has(Isa isa) {
  switch (isa) {
    case Isa::kDefault:
      return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw");
  }
  return false;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kDefault:
      return "default";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "?";
}

Isa best_isa() {
  __builtin_cpu_init();
  if (cpu_has(Isa::kAvx512)) return Isa::kAvx512;
  if (cpu_has(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kDefault;
}

std::atomic<int>& active() {
  static std::atomic<int> isa{static_cast<int>(best_isa())};
  return isa;
}

}  // namespace

std::string kernel_isa() { return isa_name(static_cast<Isa>(active().load())); }

std::vector<std::string> supported_kernel_isas() {
  std::vector<std::string> out;
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kDefault}) {
    if (cpu_has(isa)) out.emplace_back(isa_name(isa));
  }
  return out;
}

void set_kernel_isa(const std::string& name) {
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kDefault}) {
    if (name == isa_name(isa)) {
      TORCH_CHECK_VALUE(cpu_has(isa), "set_kernel_isa: this CPU cannot run isa '", name, "'");
      active().store(static_cast<int>(isa));
      return;
    }
  }
  TORCH_CHECK_VALUE(false, "set_kernel_isa: unknown isa '", name,
                    "' (known: avx512, avx2, default)");
}

namespace kernels {

UpdateTask::Kernel select_kernel(Algorithm algorithm, at::ScalarType dtype, uint32_t flags) {
  UpdateTask::Kernel kernel = nullptr;
  switch (static_cast<Isa>(active().load(std::memory_order_relaxed))) {
    case Isa::kAvx512:
      kernel = isa_avx512::select(algorithm, dtype, flags);
      break;
    case Isa::kAvx2:
      kernel = isa_avx2::select(algorithm, dtype, flags);
      break;
    case Isa::kDefault:
      kernel = isa_default::select(algorithm, dtype, flags);
      break;
  }
  TORCH_INTERNAL_ASSERT(kernel != nullptr, "no update kernel for dtype ", dtype, " flags ", flags);
  return kernel;
}

}  // namespace kernels
}  // namespace optim
}  // namespace distoptim
