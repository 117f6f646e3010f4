// register_torchscript_optimizer (torchscript_optimizer.h): a module saved by torch.jit.save,
// checked once when registered, and the FunctionalOptimizer that calls its methods.

#include <distoptim/optim/torchscript_optimizer.h>

#include <memory>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/script.h>

#include <distoptim/optim/registry.h>

namespace distoptim {
namespace optim {
namespace {

// The methods of the recipe: name, argument types after `self`, return type (as TorchScript
// prints them), and whether a module must have it.
struct MethodSignature {
  const char* name;
  std::vector<std::string> arguments;
  std::string returns;
  bool required;
};
const std::vector<MethodSignature>& recipe() {
  static const std::vector<MethodSignature> kMethods = {
      {"defaults", {}, "Dict(str, float)", true},
      {"init_state", {"Tensor"}, "Dict(str, Tensor)", true},
      {"update",
       {"Tensor[]", "Tensor[]", "Dict(str, Tensor)[]", "int[]", "Dict(str, float)"},
       "Dict(str, Tensor)[]",
       true},
      {"check_options", {"Dict(str, float)"}, "NoneType", false},
  };
  return kMethods;
}

std::string describe(const std::string& name, const std::vector<std::string>& arguments,
                     const std::string& returns) {
  std::string text = name + "(";
  for (size_t i = 0; i < arguments.size(); ++i) text += (i ? ", " : "") + arguments[i];
  return text + ") -> " + returns;
}

// The script's module, checked against the recipe; what every optimizer of it shares.
struct Script {
  std::string path;
  mutable torch::jit::Module module;  // a handle; calling its methods changes nothing of it
  std::vector<std::string> state_names;
  OptionBag defaults;
  bool has_check_options = false;
};

std::shared_ptr<const Script> load_script(const std::string& path) {
  auto script = std::make_shared<Script>();
  script->path = path;
  try {
    script->module = torch::jit::load(path);
  } catch (const c10::Error& error) {
    TORCH_CHECK_VALUE(false, "register_torchscript_optimizer: '", path,
                      "' is not a TorchScript archive (a file torch.jit.save writes): ",
                      error.what_without_backtrace());
  }
  for (const MethodSignature& want : recipe()) {
    const auto method = script->module.find_method(want.name);
    if (!method) {
      TORCH_CHECK_VALUE(!want.required, "register_torchscript_optimizer: '", path,
                        "' has no method '", want.name, "' (export it with @torch.jit.export: ",
                        describe(want.name, want.arguments, want.returns), "; docs/optim.md)");
      continue;
    }
    const c10::FunctionSchema& schema = method->function().getSchema();
    std::vector<std::string> arguments;
    for (size_t i = 1; i < schema.arguments().size(); ++i) {  // after `self`
      arguments.push_back(schema.arguments()[i].type()->str());
    }
    const std::string returns =
        schema.returns().size() == 1 ? schema.returns()[0].type()->str() : "(several values)";
    TORCH_CHECK_VALUE(arguments == want.arguments && returns == want.returns,
                      "register_torchscript_optimizer: '", path, "': method ", want.name, " is ",
                      describe(want.name, arguments, returns), "; the recipe's is ",
                      describe(want.name, want.arguments, want.returns), " (docs/optim.md)");
    if (std::string(want.name) == "check_options") script->has_check_options = true;
  }
  try {
    for (const auto& entry : script->module.run_method("defaults").toGenericDict()) {
      script->defaults.set(entry.key().toStringRef(), entry.value().toDouble());
    }
    at::NoGradGuard no_grad;
    for (const auto& entry :
         script->module.run_method("init_state", at::zeros({1})).toGenericDict()) {
      script->state_names.push_back(entry.key().toStringRef());
    }
  } catch (const std::exception& error) {
    TORCH_CHECK_VALUE(false, "register_torchscript_optimizer: '", path,
                      "': calling defaults() or init_state() failed: ", error.what());
  }
  return script;
}

// What a script's `raise` said: the last line of its error, after the TorchScript traceback.
std::string raised(const std::exception& error) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&error);
  std::string text = c10_error ? c10_error->what_without_backtrace() : error.what();
  while (!text.empty() && text.back() == '\n') text.pop_back();
  return text.substr(text.rfind('\n') + 1);
}

c10::Dict<std::string, double> as_script_options(const OptionBag& options) {
  c10::Dict<std::string, double> dict;
  for (const auto& [key, value] : options.items()) dict.insert(key, value.toDouble());
  return dict;
}

class TorchScriptOptimizer : public FunctionalOptimizer {
 public:
  TorchScriptOptimizer(const std::string& name, std::shared_ptr<const Script> script,
                       std::vector<ParamGroup> groups, const OptionBag& overrides)
      : FunctionalOptimizer(name, script->state_names, script->defaults.merged_with(overrides)),
        script_(std::move(script)) {
    check_options(defaults());
    for (const ParamGroup& group : groups) add_param_group(group);
  }

 protected:
  void check_options(const OptionBag& resolved) const override {
    const OptionBag& known = script_->defaults;
    for (const auto& [key, value] : resolved.items()) {
      TORCH_CHECK_VALUE(known.contains(key), "optimizer '", name(), "' (", script_->path,
                        ") has no option '", key,
                        "'; its options: ", c10::Join(", ", known.keys()));
      TORCH_CHECK_TYPE(value.isDouble() || value.isInt(), "optimizer '", name(), "' (",
                       script_->path, "): option '", key, "' must be a number, got ",
                       value.tagKind());
    }
    if (!script_->has_check_options) return;
    try {
      script_->module.get_method("check_options")({as_script_options(resolved)});
    } catch (const std::exception& error) {  // a `raise` in the script: a JITException
      TORCH_CHECK_VALUE(false, "optimizer '", name(), "' (", script_->path, ") refuses options ",
                        resolved.to_string(), ": ", raised(error));
    }
  }

  void on_group_options(size_t group, const OptionBag& resolved) override {
    if (options_.size() <= group) options_.resize(group + 1);
    options_[group] = as_script_options(resolved);
  }

  void update(size_t group, const std::vector<ParamUpdate>& updates) override {
    at::NoGradGuard no_grad;
    const torch::jit::Method init_state = script_->module.get_method("init_state");
    c10::List<at::Tensor> params, grads;
    c10::impl::GenericList states(
        c10::DictType::create(c10::StringType::get(), c10::TensorType::get()));
    c10::List<int64_t> steps;
    for (const ParamUpdate& u : updates) {
      ParamState& state = *u.state;
      if (!state_names().empty() && !state.buffers[0].defined()) {
        const auto made = init_state({*u.param}).toGenericDict();
        state.buffers = take_state(made, u, "init_state");
      }
      c10::Dict<std::string, at::Tensor> dict;
      for (size_t s = 0; s < state_names().size(); ++s) {
        dict.insert(state_names()[s], state.buffers[s]);
      }
      params.push_back(*u.param);
      grads.push_back(*u.grad);
      states.push_back(std::move(dict));
      steps.push_back(state.step + 1);
    }
    const c10::IValue returned =
        script_->module.get_method("update")({params, grads, states, steps, options_.at(group)});
    const c10::impl::GenericList after = returned.toList();
    TORCH_CHECK_VALUE(after.size() == updates.size(), "optimizer '", name(), "' (", script_->path,
                      "): update returned ", after.size(), " states for ", updates.size(),
                      " parameters");
    std::vector<std::vector<at::Tensor>> taken;
    for (size_t i = 0; i < updates.size(); ++i) {
      taken.push_back(take_state(after.get(i).toGenericDict(), updates[i], "update"));
    }
    for (size_t i = 0; i < updates.size(); ++i) {
      updates[i].state->buffers = std::move(taken[i]);
      ++updates[i].state->step;
    }
  }

 private:
  // The state tensors of `dict`, in state_names() order, each of its parameter's shape.
  std::vector<at::Tensor> take_state(const c10::impl::GenericDict& dict, const ParamUpdate& u,
                                     const char* method) const {
    std::vector<at::Tensor> buffers;
    for (const std::string& key : state_names()) {
      const auto found = dict.find(key);
      TORCH_CHECK_VALUE(found != dict.end(), "optimizer '", name(), "' (", script_->path,
                        "): ", method, " returned no '", key, "' for parameter ", u.index,
                        " (every state needs ", c10::Join(", ", state_names()), ")");
      const at::Tensor tensor = found->value().toTensor();
      TORCH_CHECK_VALUE(tensor.sizes() == u.param->sizes(), "optimizer '", name(), "' (",
                        script_->path, "): ", method, " returned '", key, "' of shape ",
                        tensor.sizes(), " for parameter ", u.index, " of shape ", u.param->sizes());
      buffers.push_back(tensor);
    }
    return buffers;
  }

  std::shared_ptr<const Script> script_;
  std::vector<c10::Dict<std::string, double>> options_;  // by group
};

}  // namespace

void register_torchscript_optimizer(const std::string& name, const std::string& path) {
  std::shared_ptr<const Script> script = load_script(path);
  register_optimizer(name,
                     [name, script](std::vector<ParamGroup> groups, const OptionBag& defaults) {
                       return std::unique_ptr<FunctionalOptimizer>(
                           new TorchScriptOptimizer(name, script, std::move(groups), defaults));
                     });
}

}  // namespace optim
}  // namespace distoptim
