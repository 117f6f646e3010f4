#include <distoptim/optim/option_bag.h>

#include <type_traits>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <distoptim/optim/adam.h>
#include <distoptim/optim/rprop.h>
#include <distoptim/optim/sgd.h>

#include "support/test_util.h"

namespace distoptim {
namespace optim {
namespace option_bag_test {

using testing::expect_error_containing;

TEST(OptionBag, TypedOptionsRoundTripThroughBag) {
  AdamOptions options(0.01);
  options.betas({0.8, 0.95}).eps(1e-6).weight_decay(0.1).amsgrad(true).maximize(true);
  const OptionBag bag = options_to_bag(options);
  EXPECT_EQ(bag.keys(), (std::vector<std::string>{"amsgrad", "betas", "eps", "lr", "maximize",
                                                  "weight_decay"}));
  const AdamOptions back = options_from_bag<AdamOptions>(bag);
  EXPECT_EQ(back.lr(), 0.01);
  EXPECT_EQ(back.betas(), std::make_tuple(0.8, 0.95));
  EXPECT_EQ(back.eps(), 1e-6);
  EXPECT_EQ(back.weight_decay(), 0.1);
  EXPECT_TRUE(back.amsgrad());
  EXPECT_TRUE(back.maximize());
}

// Adam and AdamW share their options but keep PyTorch's defaults each (weight_decay 0 and
// 1e-2), and a chain of setters keeps the struct it started from.
TEST(OptionBag, AdamAndAdamWOptionsKeepTheirDefaultsAndType) {
  static_assert(std::is_same<decltype(AdamWOptions().lr(0.1)), AdamWOptions&>::value);
  static_assert(std::is_same<decltype(AdamOptions().maximize(true)), AdamOptions&>::value);
  EXPECT_EQ(options_to_bag(AdamOptions()), OptionBag({{"lr", 1e-3},
                                                      {"betas", std::make_tuple(0.9, 0.999)},
                                                      {"eps", 1e-8},
                                                      {"weight_decay", 0.0},
                                                      {"amsgrad", false},
                                                      {"maximize", false}}));
  EXPECT_EQ(options_to_bag(AdamWOptions()), options_to_bag(AdamOptions().weight_decay(1e-2)));
  const AdamWOptions w = AdamWOptions(0.01).betas({0.8, 0.95}).amsgrad(true);
  EXPECT_EQ(w.lr(), 0.01);
  EXPECT_EQ(w.betas(), std::make_tuple(0.8, 0.95));
  EXPECT_EQ(w.weight_decay(), 1e-2);
  EXPECT_TRUE(w.amsgrad());
}

TEST(OptionBag, PartialBagKeepsBaseValues) {
  const SGDOptions o = options_from_bag<SGDOptions>(OptionBag().set("momentum", 0.9),
                                                    SGDOptions(0.5).nesterov(true));
  EXPECT_EQ(o.lr(), 0.5);
  EXPECT_EQ(o.momentum(), 0.9);
  EXPECT_TRUE(o.nesterov());
}

TEST(OptionBag, IntegersReadAsDoublesListsAsPairs) {
  OptionBag bag;
  bag.set("lr", int64_t{1}).set("etas", c10::List<double>({0.4, 1.5}));
  const RpropOptions o = options_from_bag<RpropOptions>(bag);
  EXPECT_EQ(o.lr(), 1.0);
  EXPECT_EQ(o.etas(), std::make_tuple(0.4, 1.5));
}

TEST(OptionBag, UnknownKeyListsKnownKeys) {
  expect_error_containing(
      [] { options_from_bag<SGDOptions>(OptionBag().set("lr", 0.1).set("betas", 0.9)); },
      {"unknown optimizer option 'betas'", "lr", "momentum", "dampening", "weight_decay",
       "nesterov", "maximize"});
}

TEST(OptionBag, WrongTypeNamesKeyAndValue) {
  expect_error_containing([] { options_from_bag<SGDOptions>(OptionBag().set("nesterov", 0.5)); },
                          {"nesterov", "must be a bool", "0.5"});
  expect_error_containing([] { options_from_bag<AdamOptions>(OptionBag().set("betas", 0.9)); },
                          {"betas", "pair of numbers"});
  expect_error_containing([] { OptionBag().set("lr", at::ones({1})); },
                          {"lr", "not an optimizer option value"});
}

TEST(OptionBag, SerializesThroughLibTorchPickle) {
  OptionBag bag;
  bag.set("lr", 0.25)
      .set("betas", c10::ivalue::Tuple::create({0.5, 0.75}))
      .set("amsgrad", true)
      .set("name", std::string("x"))
      .set("count", int64_t{3});
  const std::vector<char> bytes = torch::pickle_save(bag.to_ivalue());
  const OptionBag back = OptionBag::from_ivalue(torch::pickle_load(bytes));
  EXPECT_EQ(back, bag);
  EXPECT_EQ(back.get_pair("betas"), std::make_tuple(0.5, 0.75));
  EXPECT_EQ(back.get_string("name"), "x");
  EXPECT_EQ(back.get_int("count"), 3);
}

TEST(OptionBag, MergedWithOverrides) {
  const OptionBag merged =
      OptionBag().set("lr", 0.1).set("momentum", 0.9).merged_with(OptionBag().set("lr", 0.2));
  EXPECT_EQ(merged.get_double("lr"), 0.2);
  EXPECT_EQ(merged.get_double("momentum"), 0.9);
  EXPECT_EQ(merged.to_string(), "{lr: 0.2, momentum: 0.9}");
}

TEST(OptionBag, ChangesFromKeepsWhatDiffers) {
  const OptionBag current = OptionBag().set("lr", 0.1).set("momentum", 0.9).set("nesterov", false);
  const OptionBag wanted = OptionBag().set("lr", 0.05).set("momentum", 0.9).set("dampening", 0.1);
  // A changed value and a key `current` lacks; keys only `current` has are left out.
  EXPECT_EQ(wanted.changes_from(current).to_string(), "{dampening: 0.1, lr: 0.05}");
  EXPECT_TRUE(current.changes_from(current).empty());
  // Numbers compare as == does: an int equal to a double is no change.
  EXPECT_TRUE(OptionBag().set("lr", int64_t{1}).changes_from(OptionBag().set("lr", 1.0)).empty());
}

TEST(OptionBag, ATupleIsABracedListOfNumbers) {
  const OptionBag braced = OptionBag().set("betas", {0.9, 0.98});
  EXPECT_EQ(braced, OptionBag().set("betas", std::make_tuple(0.9, 0.98)));
  EXPECT_EQ(braced.get_pair("betas"), std::make_tuple(0.9, 0.98));
  EXPECT_EQ(options_from_bag<AdamOptions>(braced).betas(), std::make_tuple(0.9, 0.98));
}

}  // namespace option_bag_test
}  // namespace optim
}  // namespace distoptim
