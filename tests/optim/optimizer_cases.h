#pragma once

// Every built-in optimizer with options that switch on all of its state, for tests that sweep
// the built-ins by registry name.

#include <string>
#include <vector>

#include <distoptim/optim/option_bag.h>

namespace distoptim {
namespace testing {

struct OptimizerCase {
  std::string name;
  optim::OptionBag options;
};

inline std::vector<OptimizerCase> all_optimizer_cases() {
  using optim::OptionBag;
  const auto pair = [](double a, double b) { return c10::ivalue::Tuple::create({a, b}); };
  return {
      {"sgd", OptionBag()
                  .set("lr", 0.1)
                  .set("momentum", 0.9)
                  .set("nesterov", true)
                  .set("weight_decay", 0.01)},
      {"adam", OptionBag().set("lr", 0.01).set("amsgrad", true).set("weight_decay", 0.01)},
      {"adamw", OptionBag().set("lr", 0.01).set("amsgrad", true)},
      {"adagrad",
       OptionBag().set("lr", 0.1).set("lr_decay", 0.01).set("initial_accumulator_value", 0.1)},
      {"adadelta", OptionBag().set("lr", 0.5).set("weight_decay", 0.01)},
      {"adamax", OptionBag().set("lr", 0.01).set("betas", pair(0.8, 0.99))},
      {"rmsprop", OptionBag().set("lr", 0.01).set("momentum", 0.5).set("centered", true)},
      {"rprop", OptionBag().set("lr", 0.01).set("etas", pair(0.4, 1.3))},
  };
}

}  // namespace testing
}  // namespace distoptim
