#pragma once

// Tensors the reference scripts (PyTorch, run by the parity tests) write to files.

#include <filesystem>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

namespace distoptim {
namespace testing {

/// What Python's `torch.save(value, file)` saved (dicts, lists, tuples, numbers, strings and
/// tensors), as LibTorch's torch::pickle_load reads it. Throws c10::Error naming the file when it
/// cannot be read.
c10::IValue load_pickle(const std::filesystem::path& file);

/// The list of tensors in `file`, saved by Python's `torch.save([t0, t1, ...], file)`. Throws
/// c10::Error naming the file when it cannot be read.
std::vector<at::Tensor> load_tensor_list(const std::filesystem::path& file);

}  // namespace testing
}  // namespace distoptim
