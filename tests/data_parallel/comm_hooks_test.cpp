// The DDP communication hooks' bad input (their results: comm_hooks_parity_test.cpp).

#include <memory>

#include <gtest/gtest.h>

#include <distoptim/data_parallel/comm_hooks.h>
#include <distoptim/data_parallel/power_sgd_hook.h>

namespace distoptim {
namespace data_parallel {
namespace comm_hooks_test {

// A group this process is not in: bad options must fail before the group is looked at.
void expect_bad_power_sgd_options(const PowerSGDOptions& options, const std::string& named) {
  try {
    PowerSGDState state(comm::Group(), options);
    ADD_FAILURE() << "PowerSGDState accepted " << named;
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << e.what();
  }
}

TEST(PowerSGDStateTest, RejectsOptionsOutOfRange) {
  expect_bad_power_sgd_options(PowerSGDOptions().matrix_approximation_rank(0),
                               "matrix_approximation_rank = 0");
  expect_bad_power_sgd_options(PowerSGDOptions().orthogonalization_epsilon(-1e-8),
                               "orthogonalization_epsilon = -1e-08");
  expect_bad_power_sgd_options(PowerSGDOptions().min_compression_rate(-1),
                               "min_compression_rate = -1");
  expect_bad_power_sgd_options(PowerSGDOptions().start_power_sgd_iter(-3),
                               "start_power_sgd_iter = -3");
  expect_bad_power_sgd_options(PowerSGDOptions().random_seed(-1), "random_seed = -1");
  expect_bad_power_sgd_options(PowerSGDOptions().random_seed(int64_t{1} << 32),
                               "random_seed = 4294967296");
  // As in PyTorch: remembering buckets across DDP's rebuild after the first iteration.
  expect_bad_power_sgd_options(PowerSGDOptions().start_power_sgd_iter(1),
                               "start_power_sgd_iter = 1");
  expect_bad_power_sgd_options(PowerSGDOptions().start_power_sgd_iter(0).use_error_feedback(false),
                               "start_power_sgd_iter = 0");
}

TEST(PowerSGDStateTest, RejectsARankOutsideTheGroup) {
  EXPECT_THROW(PowerSGDState(comm::Group(), PowerSGDOptions()), c10::ValueError);
  EXPECT_THROW(
      PowerSGDState(
          comm::Group(),
          PowerSGDOptions().start_power_sgd_iter(0).use_error_feedback(false).warm_start(false)),
      c10::ValueError);
}

TEST(CommHooksTest, RejectNullArguments) {
  EXPECT_THROW(power_sgd_hook(nullptr), c10::ValueError);
  EXPECT_THROW(batched_power_sgd_hook(nullptr), c10::ValueError);
  EXPECT_THROW(fp16_compress_wrapper(nullptr), c10::ValueError);
  EXPECT_THROW(bf16_compress_wrapper(nullptr), c10::ValueError);
  EXPECT_NE(noop_hook(), nullptr);
}

}  // namespace comm_hooks_test
}  // namespace data_parallel
}  // namespace distoptim
