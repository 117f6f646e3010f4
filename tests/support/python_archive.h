#pragma once

// What Python reads from an archive that torch::save(optimizer, path) wrote: the parity tests of
// the optimizers' archives (ZeroRedundancyOptimizer, DistributedOptimizer) run
// tests/optim/reference/read_archive.py under DISTOPTIM_REFERENCE_PYTHON (PyTorch 1.13), which
// loads the archive with torch.load and saves the state dict it found as plain Python data.

#include <filesystem>
#include <iostream>
#include <string>

#include <ATen/core/ivalue.h>
#include <gtest/gtest.h>

#include "harness/command.h"
#include "support/tensor_files.h"

namespace distoptim {
namespace testing {

/// The value Python's torch.load finds under `key` in `archive` (LibTorch's OutputArchive: a
/// TorchScript module, which torch.load hands to torch.jit.load; `key` is its attribute), as
/// Python saw it. Fails the test (and returns None) when Python cannot read it.
inline c10::IValue read_archive_in_python(const std::string& archive, const std::string& key) {
  const std::string out = archive + ".as_read_by_python.pt";
  const std::string command =
      "timeout 120 " + shell_quote(DISTOPTIM_REFERENCE_PYTHON) + " " +
      shell_quote(std::string(DISTOPTIM_SOURCE_DIR) + "/tests/optim/reference/read_archive.py") +
      " " + shell_quote(archive) + " " + shell_quote(key) + " " + shell_quote(out) + " 2>&1";
  const CommandResult result = run_command(command);
  std::cout << result.output;  // what Python read, in the test's log
  EXPECT_TRUE(result.ok);
  if (!result.ok) return c10::IValue();
  c10::IValue value = load_pickle(out);
  std::filesystem::remove(out);
  return value;
}

}  // namespace testing
}  // namespace distoptim
