#pragma once

// Helpers the tests of every layer share: expected errors and tensor lists compared exactly.

#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace distoptim {
namespace testing {

/// Expects `fn` to throw c10::Error whose message contains every one of `parts`.
template <class Fn>
void expect_error_containing(Fn&& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    for (const auto& part : parts) {
      EXPECT_NE(message.find(part), std::string::npos)
          << "message lacks '" << part << "': " << message;
    }
    return;
  }
  ADD_FAILURE() << "expected a c10::Error";
}

/// Deep copies, so a test can compare against the values before a call.
inline std::vector<at::Tensor> clone_all(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.defined() ? t.clone() : at::Tensor());
  return out;
}

inline void expect_all_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << "tensor " << i;
    if (a[i].defined()) EXPECT_TRUE(at::equal(a[i], b[i])) << "tensor " << i;
  }
}

}  // namespace testing
}  // namespace distoptim
