#include <distoptim/optim/registry.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <distoptim/optim/adam.h>
#include <distoptim/optim/sgd.h>

#include "support/test_util.h"

namespace distoptim {
namespace optim {
namespace registry_test {

using testing::expect_error_containing;

TEST(Registry, BuiltinsArePresent) {
  for (const char* name :
       {"sgd", "adam", "adamw", "adagrad", "adadelta", "adamax", "rmsprop", "rprop"}) {
    EXPECT_TRUE(is_optimizer_registered(name)) << name;
  }
}

TEST(Registry, CreatesBuiltinWithBagOptionsAndGroups) {
  at::Tensor a = at::zeros({3});
  at::Tensor b = at::zeros({2});
  auto opt = create_optimizer(
      "adam", {ParamGroup({a}), ParamGroup({b}, OptionBag().set("lr", 0.5))},
      OptionBag().set("lr", 0.1).set("betas", c10::ivalue::Tuple::create({0.5, 0.9})));
  ASSERT_NE(dynamic_cast<Adam*>(opt.get()), nullptr);
  auto* adam = static_cast<Adam*>(opt.get());
  EXPECT_EQ(adam->options(0).lr(), 0.1);
  EXPECT_EQ(adam->options(1).lr(), 0.5);
  EXPECT_EQ(adam->options(1).betas(), std::make_tuple(0.5, 0.9));
  // The first Adam step moves every coordinate by lr (the update is m/sqrt(v) = sign(g)).
  opt->step({at::ones({3}), -at::ones({2})});
  EXPECT_TRUE(at::allclose(a, at::full({3}, -0.1)));
  EXPECT_TRUE(at::allclose(b, at::full({2}, 0.5)));
}

TEST(Registry, SgdByNameRequiresLr) {
  expect_error_containing([] { create_optimizer("sgd", {ParamGroup({at::zeros({1})})}); },
                          {"'sgd' requires option 'lr'"});
}

TEST(Registry, UnknownNameListsRegistered) {
  expect_error_containing([] { create_optimizer("lamb", {}); },
                          {"unknown optimizer 'lamb'", "adam", "rprop", "sgd"});
}

TEST(Registry, DuplicateRegistrationIsRefused) {
  expect_error_containing([] { register_optimizer("adam", typed_factory<Adam, AdamOptions>()); },
                          {"'adam' is already registered"});
}

TEST(Registry, UserFactoryIsCalledWithGroupsAndBag) {
  register_optimizer("registry_test_sgd_half_lr",
                     [](std::vector<ParamGroup> groups, const OptionBag& bag) {
                       SGDOptions o = options_from_bag<SGDOptions>(bag);
                       o.lr(o.lr() / 2);
                       return std::unique_ptr<FunctionalOptimizer>(new SGD(std::move(groups), o));
                     });
  at::Tensor p = at::zeros({2});
  auto opt =
      create_optimizer("registry_test_sgd_half_lr", {ParamGroup({p})}, OptionBag().set("lr", 1.0));
  opt->step({at::ones({2})});
  EXPECT_TRUE(at::equal(p, at::full({2}, -0.5)));
}

}  // namespace registry_test
}  // namespace optim
}  // namespace distoptim
