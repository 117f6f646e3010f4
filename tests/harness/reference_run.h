#pragma once

// The output of a reference script (PyTorch under the system Python) that a parity test runs once
// per test program, in the test process, for the rank processes to read.
//
//   static void SetUpTestSuite() {
//     if (in_rank_process()) return;
//     const auto result = run_reference(DISTOPTIM_REFERENCE_PYTHON, kScript, kDirVariable);
//     ASSERT_TRUE(result.ok) << "the reference failed: " << result.output;
//   }
//   static void TearDownTestSuite() { remove_reference(kDirVariable); }
//   ... in a rank: load_tensor_list(reference_dir(kDirVariable) / "data.pt")

#include <filesystem>
#include <string>

#include "harness/command.h"

namespace distoptim {
namespace testing {

/// Runs `python script --out DIR [extra_args]` under `timeout 150` in a fresh directory DIR under
/// /tmp, and sets the environment variable `variable` to DIR for the ranks this process starts
/// (also when the script fails, so that remove_reference removes what it wrote).
CommandResult run_reference(const std::string& python, const std::string& script,
                            const std::string& variable, const std::string& extra_args = "");

/// The directory `variable` names. Throws std::runtime_error when it is not set (the reference
/// did not run).
std::filesystem::path reference_dir(const std::string& variable);

/// Removes the directory `variable` names and unsets it; nothing when it is not set.
void remove_reference(const std::string& variable);

}  // namespace testing
}  // namespace distoptim
