#pragma once

// Tensors the reference scripts (PyTorch, run by the parity tests) write to files.

#include <filesystem>
#include <vector>

#include <ATen/core/Tensor.h>

namespace distoptim {
namespace testing {

/// The list of tensors in `file`, saved by Python's `torch.save([t0, t1, ...], file)`. Throws
/// c10::Error naming the file when it cannot be read.
std::vector<at::Tensor> load_tensor_list(const std::filesystem::path& file);

}  // namespace testing
}  // namespace distoptim
