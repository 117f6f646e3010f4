#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <distoptim/optim/functional_optimizer.h>
#include <distoptim/optim/option_bag.h>

namespace distoptim {
namespace optim {

/// Builds an optimizer over `groups` with `defaults` (an OptionBag: only the keys to change).
using OptimizerFactory = std::function<std::unique_ptr<FunctionalOptimizer>(
    std::vector<ParamGroup> groups, const OptionBag& defaults)>;

/// The process-wide map from optimizer name to factory. The built-ins ("sgd", "adam", "adamw",
/// "adagrad", "adadelta", "adamax", "rmsprop", "rprop") are always present; users add their own,
/// which is how a remote worker builds an optimizer it was named over the wire.
/// Thread safety: all functions are safe to call concurrently.
/// Errors: registering a taken name, or creating an unknown one, throws c10::Error listing the
/// registered names.
void register_optimizer(const std::string& name, OptimizerFactory factory);
bool is_optimizer_registered(const std::string& name);
std::vector<std::string> registered_optimizers();
std::unique_ptr<FunctionalOptimizer> create_optimizer(const std::string& name,
                                                      std::vector<ParamGroup> groups,
                                                      const OptionBag& defaults = {});

/// The factory for an optimizer class `Optim` with options struct `Options`: the bag is parsed
/// into `Options` (unknown keys and bad values throw) and handed to `Optim(groups, options)`.
template <class Optim, class Options>
OptimizerFactory typed_factory(Options base = Options()) {
  return [base](std::vector<ParamGroup> groups, const OptionBag& defaults) {
    return std::unique_ptr<FunctionalOptimizer>(
        new Optim(std::move(groups), options_from_bag<Options>(defaults, base)));
  };
}

/// Registers a factory when constructed; for static registration in a user's translation unit:
/// `static distoptim::optim::OptimizerRegistration reg("qhm", typed_factory<QHM, QHMOptions>());`
struct OptimizerRegistration {
  OptimizerRegistration(const std::string& name, OptimizerFactory factory) {
    register_optimizer(name, std::move(factory));
  }
};

}  // namespace optim
}  // namespace distoptim
