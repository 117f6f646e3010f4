#include <distoptim/optim/registry.h>

#include <map>
#include <mutex>
#include <sstream>

#include <c10/util/Exception.h>

#include <distoptim/optim/adadelta.h>
#include <distoptim/optim/adagrad.h>
#include <distoptim/optim/adam.h>
#include <distoptim/optim/adamax.h>
#include <distoptim/optim/rmsprop.h>
#include <distoptim/optim/rprop.h>
#include <distoptim/optim/sgd.h>
#include <distoptim/optim/sparse_adam.h>

namespace distoptim {
namespace optim {

namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::string, OptimizerFactory> factories;  // guarded by mutex
};

OptimizerFactory sgd_factory() {
  OptimizerFactory typed = typed_factory<SGD, SGDOptions>();
  // torch.optim.SGD has no default learning rate; neither does creating one by name.
  return [typed](std::vector<ParamGroup> groups, const OptionBag& defaults) {
    TORCH_CHECK_VALUE(defaults.contains("lr"), "optimizer 'sgd' requires option 'lr'");
    return typed(std::move(groups), defaults);
  };
}

// Built-ins are registered here rather than by static objects in their own files: a static
// library drops object files nothing references, and their registrations with them.
Registry& registry() {
  static Registry* r = [] {
    auto* reg = new Registry();
    reg->factories["sgd"] = sgd_factory();
    reg->factories["adam"] = typed_factory<Adam, AdamOptions>();
    reg->factories["adamw"] = typed_factory<AdamW, AdamWOptions>();
    reg->factories["adagrad"] = typed_factory<Adagrad, AdagradOptions>();
    reg->factories["adadelta"] = typed_factory<Adadelta, AdadeltaOptions>();
    reg->factories["adamax"] = typed_factory<Adamax, AdamaxOptions>();
    reg->factories["rmsprop"] = typed_factory<RMSprop, RMSpropOptions>();
    reg->factories["rprop"] = typed_factory<Rprop, RpropOptions>();
    reg->factories["sparse_adam"] = typed_factory<SparseAdam, SparseAdamOptions>();
    return reg;
  }();
  return *r;
}

std::string names_locked(const Registry& r) {
  std::ostringstream out;
  bool first = true;
  for (const auto& item : r.factories) {
    out << (first ? "" : ", ") << item.first;
    first = false;
  }
  return out.str();
}

}  // namespace

void register_optimizer(const std::string& name, OptimizerFactory factory) {
  TORCH_CHECK_VALUE(!name.empty(), "register_optimizer: the name is empty");
  TORCH_CHECK_VALUE(static_cast<bool>(factory), "register_optimizer('", name,
                    "'): the factory is empty");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  TORCH_CHECK_VALUE(r.factories.count(name) == 0, "register_optimizer: '", name,
                    "' is already registered (registered: ", names_locked(r), ")");
  r.factories[name] = std::move(factory);
}

bool is_optimizer_registered(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.factories.count(name) != 0;
}

std::vector<std::string> registered_optimizers() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> out;
  for (const auto& item : r.factories) out.push_back(item.first);
  return out;
}

std::unique_ptr<FunctionalOptimizer> create_optimizer(const std::string& name,
                                                      std::vector<ParamGroup> groups,
                                                      const OptionBag& defaults) {
  OptimizerFactory factory;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.factories.find(name);
    TORCH_CHECK_VALUE(it != r.factories.end(), "create_optimizer: unknown optimizer '", name,
                      "' (registered: ", names_locked(r), ")");
    factory = it->second;
  }
  // The factory is user code: call it without holding the lock.
  return factory(std::move(groups), defaults);
}

}  // namespace optim
}  // namespace distoptim
