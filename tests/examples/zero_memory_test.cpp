// examples/zero_memory run as its users run it, through distrun on 2 ranks (with a smaller model
// than the tutorial's): on every rank both variants print the same parameter sum, and the
// memory step() adds with ZeroRedundancyOptimizer is at most 0.6 of plain Adam's (it holds
// half of Adam's state; the rest is slack for what else the step allocates).

#include <map>
#include <regex>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "../harness/command.h"

namespace {

using distoptim::testing::run_command;
using distoptim::testing::shell_quote;

constexpr int kWorldSize = 2;
// ZeRO's step keeps half of Adam's state, so the ratio is about 0.5.
constexpr double kMaxStepMemoryRatio = 0.6;

// What one rank printed for one variant.
struct Variant {
  std::string params_sum;
  double step_extra_mb = -1;
};

// rank -> variant ("Using ..." / "Not Using ...") -> what it printed.
using Report = std::map<int, std::map<std::string, Variant>>;

Report parse(const std::string& output) {
  static const std::regex kLineRe(R"(^\[rank (\d+)\] (.*)$)");
  static const std::regex kHeaderRe(R"(^=== (.*) ===$)");
  static const std::regex kSumRe(R"(^params sum is: (\S+)$)");
  static const std::regex kExtraRe(R"(^optimizer step\(\) extra memory: ([0-9.]+)MB$)");
  Report report;
  std::map<int, std::string> current_variant;
  std::istringstream lines(output);
  std::string line;
  std::smatch m;
  while (std::getline(lines, line)) {
    if (!std::regex_match(line, m, kLineRe)) continue;
    const int rank = std::stoi(m[1]);
    const std::string text = m[2];
    if (std::regex_match(text, m, kHeaderRe)) {
      current_variant[rank] = m[1];
    } else if (std::regex_match(text, m, kSumRe)) {
      report[rank][current_variant[rank]].params_sum = m[1];
    } else if (std::regex_match(text, m, kExtraRe)) {
      report[rank][current_variant[rank]].step_extra_mb = std::stod(m[1]);
    }
  }
  return report;
}

TEST(ZeroMemoryExample, SameParametersAndHalfTheStepMemory) {
  const std::string command = "timeout 150 " + shell_quote(DISTOPTIM_DISTRUN_PATH) +
                              " --nproc-per-node " + std::to_string(kWorldSize) + " " +
                              shell_quote(DISTOPTIM_ZERO_MEMORY_PATH) +
                              " --layers 8 --size 1000 --batch 8 2>&1";
  const auto result = run_command(command);
  ASSERT_TRUE(result.ok) << result.output;
  const Report report = parse(result.output);
  ASSERT_EQ(report.size(), kWorldSize) << result.output;

  const std::string zero = "Using ZeroRedundancyOptimizer";
  const std::string adam = "Not Using ZeroRedundancyOptimizer";
  const std::string expected_sum = report.at(0).at(zero).params_sum;
  ASSERT_FALSE(expected_sum.empty()) << result.output;
  for (const auto& [rank, variants] : report) {
    ASSERT_EQ(variants.count(zero), 1u) << "rank " << rank << "\n" << result.output;
    ASSERT_EQ(variants.count(adam), 1u) << "rank " << rank << "\n" << result.output;
    EXPECT_EQ(variants.at(zero).params_sum, expected_sum) << "rank " << rank;
    EXPECT_EQ(variants.at(adam).params_sum, expected_sum) << "rank " << rank;
    const double zero_mb = variants.at(zero).step_extra_mb;
    const double adam_mb = variants.at(adam).step_extra_mb;
    EXPECT_GT(adam_mb, 0) << "rank " << rank << "\n" << result.output;
    EXPECT_GE(zero_mb, 0) << "rank " << rank << "\n" << result.output;
    EXPECT_LE(zero_mb, kMaxStepMemoryRatio * adam_mb)
        << "rank " << rank << ": step() added " << zero_mb << " MB with ZeRO, " << adam_mb
        << " MB with Adam\n"
        << result.output;
  }
}

}  // namespace
