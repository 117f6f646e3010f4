// Bad input is refused with a message naming the argument and value, and leaves the optimizer
// (parameters, state, options) exactly as it was.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <distoptim/optim/adam.h>
#include <distoptim/optim/registry.h>
#include <distoptim/optim/sgd.h>

#include "optimizer_cases.h"
#include "support/test_util.h"

namespace distoptim {
namespace optim {
namespace bad_input_test {

using testing::clone_all;
using testing::expect_all_equal;
using testing::expect_error_containing;

class BadInput : public ::testing::TestWithParam<testing::OptimizerCase> {
 protected:
  void SetUp() override {
    at::manual_seed(1);
    params_ = {at::randn({4, 3}), at::randn({5})};
    optimizer_ = create_optimizer(GetParam().name, {ParamGroup(params_)}, GetParam().options);
    // Two good steps so every kind of state exists before the bad call.
    optimizer_->step({at::randn({4, 3}), at::randn({5})});
    optimizer_->step({at::randn({4, 3}), at::randn({5})});
    params_before_ = clone_all(params_);
    state_before_ = optimizer_->state_dict();
  }

  // Whatever was attempted, nothing changed.
  void expect_unchanged() {
    expect_all_equal(params_, params_before_);
    const OptimizerStateDict now = optimizer_->state_dict();
    ASSERT_EQ(now.state.size(), state_before_.state.size());
    for (const auto& item : state_before_.state) {
      const auto& other = now.state.at(item.first);
      EXPECT_EQ(other.step, item.second.step);
      ASSERT_EQ(other.buffers.size(), item.second.buffers.size());
      for (const auto& buf : item.second.buffers) {
        EXPECT_TRUE(at::equal(other.buffers.at(buf.first), buf.second)) << buf.first;
      }
    }
    EXPECT_EQ(optimizer_->group_options(0),
              state_before_.defaults.merged_with(state_before_.param_groups[0].overrides));
  }

  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> params_before_;
  OptimizerStateDict state_before_;
  std::unique_ptr<FunctionalOptimizer> optimizer_;
};

TEST_P(BadInput, GradientCount) {
  expect_error_containing(
      [&] {
        optimizer_->step({at::randn({4, 3})});
      },
      {"got 1 gradients for 2 parameters"});
  expect_unchanged();
}

TEST_P(BadInput, GradientShapeAfterAGoodOne) {
  expect_error_containing(
      [&] {
        optimizer_->step({at::randn({4, 3}), at::randn({6})});
      },
      {"gradients[1] has shape [6]", "parameter has shape [5]"});
  expect_unchanged();
}

TEST_P(BadInput, GradientDtype) {
  expect_error_containing(
      [&] {
        optimizer_->step({at::randn({4, 3}, at::kDouble), at::randn({5})});
      },
      {"gradients[0] has dtype Double", "parameter has Float"});
  expect_unchanged();
}

// A sparse gradient naming an index past its size: refused before anything moves, for its
// layout by an optimizer that takes no sparse gradient under these options, else for the index.
TEST_P(BadInput, SparseGradient) {
  const at::Tensor sparse =
      at::_sparse_coo_tensor_unsafe(at::tensor({1, 5}, at::kLong).unsqueeze(0), at::ones({2}), {5});
  const bool takes_sparse = GetParam().name == "adagrad";  // sgd's case has weight decay
  expect_error_containing(
      [&] {
        optimizer_->step({at::randn({4, 3}), sparse});
      },
      takes_sparse ? std::vector<std::string>{"gradients[1] has index 5", "out of range"}
                   : std::vector<std::string>{"gradients[1] is sparse", "not support sparse"});
  expect_unchanged();
}

TEST_P(BadInput, GradientOnAnotherDevice) {
  const at::Tensor meta = at::empty({5}, at::TensorOptions().device(at::kMeta));
  expect_error_containing(
      [&] {
        optimizer_->step({at::randn({4, 3}), meta});
      },
      {"gradients[1] is on meta", "parameter is on cpu"});
  expect_unchanged();
}

TEST_P(BadInput, InvalidLearningRateThroughGroupOptions) {
  expect_error_containing([&] { optimizer_->set_group_options(0, OptionBag().set("lr", -1.0)); },
                          {"option lr = -1", ">= 0"});
  expect_unchanged();
}

TEST_P(BadInput, UnknownOptionThroughGroupOptions) {
  expect_error_containing(
      [&] { optimizer_->set_group_options(0, OptionBag().set("learning_rate", 0.1)); },
      {"unknown optimizer option 'learning_rate'", "known options: lr"});
  expect_unchanged();
}

TEST_P(BadInput, BadParameterGroup) {
  expect_error_containing(
      [&] {
        optimizer_->add_param_group(ParamGroup({at::zeros({2}), params_[1]}));
      },
      {"parameter 1 of the new group", "more than once"});
  expect_error_containing(
      [&] { optimizer_->add_param_group(ParamGroup({at::zeros({2}, at::kLong)})); },
      {"parameter 0 of the new group has dtype Long", "Float, Double"});
  expect_error_containing([&] { optimizer_->add_param_group(ParamGroup({at::Tensor()})); },
                          {"parameter 0 of the new group is an undefined tensor"});
  EXPECT_EQ(optimizer_->num_param_groups(), 1u);
  EXPECT_EQ(optimizer_->params().size(), 2u);
  expect_unchanged();
}

TEST_P(BadInput, LoadStateDictOfOtherShape) {
  auto other = create_optimizer(GetParam().name, {ParamGroup({at::randn({4, 3}), at::randn({6})})},
                                GetParam().options);
  other->step({at::randn({4, 3}), at::randn({6})});
  expect_error_containing([&] { optimizer_->load_state_dict(other->state_dict()); },
                          {"of parameter 1 has shape [6]", "the parameter [5]"});
  OptimizerStateDict renamed = state_before_;
  renamed.optimizer = "lamb";
  expect_error_containing([&] { optimizer_->load_state_dict(renamed); },
                          {"state dict is of optimizer 'lamb'"});
  expect_unchanged();
}

INSTANTIATE_TEST_SUITE_P(Builtins, BadInput, ::testing::ValuesIn(testing::all_optimizer_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(BadOptions, EveryRuleNamesKeyAndValue) {
  const std::vector<at::Tensor> p = {at::zeros({1})};
  const auto pair = [](double a, double b) { return c10::ivalue::Tuple::create({a, b}); };
  struct Case {
    const char* optimizer;
    OptionBag bag;
    std::vector<std::string> message;
  };
  const std::vector<Case> cases = {
      {"sgd", OptionBag().set("lr", -0.1), {"SGD option lr = -0.1"}},
      {"sgd", OptionBag().set("lr", 0.1).set("momentum", -1.0), {"SGD option momentum = -1"}},
      {"sgd", OptionBag().set("lr", 0.1).set("nesterov", true), {"nesterov", "momentum > 0"}},
      {"adam", OptionBag().set("betas", pair(1.0, 0.9)), {"Adam option betas = (1, 0.9)"}},
      {"adam", OptionBag().set("eps", -1e-8), {"Adam option eps = -1e-08"}},
      {"adamw", OptionBag().set("weight_decay", -0.1), {"AdamW option weight_decay = -0.1"}},
      {"adagrad", OptionBag().set("lr_decay", -1.0), {"Adagrad option lr_decay = -1"}},
      {"adagrad",
       OptionBag().set("initial_accumulator_value", -1.0),
       {"Adagrad option initial_accumulator_value = -1"}},
      {"adadelta", OptionBag().set("rho", 1.5), {"Adadelta option rho = 1.5", "[0, 1]"}},
      {"adamax", OptionBag().set("betas", pair(0.9, -0.1)), {"Adamax option betas = (0.9, -0.1)"}},
      {"rmsprop", OptionBag().set("alpha", -0.5), {"RMSprop option alpha = -0.5"}},
      {"rprop", OptionBag().set("etas", pair(1.5, 1.2)), {"Rprop option etas = (1.5, 1.2)"}},
      {"rprop",
       OptionBag().set("step_sizes", pair(1.0, 0.5)),
       {"Rprop option step_sizes = (1, 0.5)"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.optimizer);
    expect_error_containing([&] { create_optimizer(c.optimizer, {ParamGroup(p)}, c.bag); },
                            c.message);
  }
}

TEST(BadOptions, TypedConstructorValidatesDefaults) {
  expect_error_containing([] { Adam({at::zeros({1})}, AdamOptions(-1.0)); },
                          {"Adam option lr = -1"});
}

TEST(BadFunctionalCall, ListLengthsAndShapes) {
  std::vector<at::Tensor> params = {at::zeros({3})};
  std::vector<at::Tensor> buffers;
  expect_error_containing(
      [&] {
        functional::sgd(params, {at::ones({3}), at::ones({3})}, buffers, SGDOptions(0.1));
      },
      {"functional::sgd", "2 grads for 1 params"});
  expect_error_containing(
      [&] {
        functional::adam(params, {at::ones({3})}, {at::zeros({3})}, {at::zeros({4})}, {}, {1},
                         AdamOptions());
      },
      {"functional::adam", "exp_avg_sqs[0] has shape [4]"});
  expect_error_containing(
      [&] {
        functional::adam(params, {at::ones({3})}, {at::zeros({3})}, {at::zeros({3})}, {}, {0},
                         AdamOptions());
      },
      {"steps[0] = 0"});
  EXPECT_TRUE(at::equal(params[0], at::zeros({3})));
}

}  // namespace bad_input_test
}  // namespace optim
}  // namespace distoptim
