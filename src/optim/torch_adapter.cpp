#include <distoptim/optim/torch_adapter.h>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <distoptim/optim/registry.h>

namespace distoptim {
namespace optim {

namespace {

const AdapterOptions& adapter_options(const torch::optim::OptimizerOptions& options, size_t group) {
  const auto* adapter = dynamic_cast<const AdapterOptions*>(&options);
  TORCH_CHECK(adapter != nullptr, "FunctionalOptimizerAdapter: the options of param group ", group,
              " are not a distoptim::optim::AdapterOptions (LibTorch's own options types, such "
              "as torch::optim::AdamOptions, do not apply to a distoptim optimizer)");
  return *adapter;
}

void check_leaves(const std::vector<at::Tensor>& params, size_t group) {
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(!params[i].defined() || params[i].is_leaf(),
                "FunctionalOptimizerAdapter: parameter ", i, " of param group ", group,
                " is not a leaf tensor (can't optimize a non-leaf Tensor)");
  }
}

std::unique_ptr<torch::optim::OptimizerOptions> make_defaults(
    const std::unique_ptr<FunctionalOptimizer>& optimizer) {
  TORCH_CHECK(optimizer != nullptr, "FunctionalOptimizerAdapter: optimizer must not be null");
  return std::make_unique<AdapterOptions>(optimizer->defaults());
}

}  // namespace

AdapterOptions& AdapterOptions::set(const std::string& key, c10::IValue value) {
  bag_.set(key, std::move(value));
  return *this;
}

double AdapterOptions::get_lr() const {
  TORCH_CHECK(bag_.contains("lr"),
              "AdapterOptions::get_lr: these options have no 'lr': ", bag_.to_string());
  return bag_.get_double("lr");
}

void AdapterOptions::set_lr(const double lr) {
  TORCH_CHECK(bag_.contains("lr"), "AdapterOptions::set_lr(", lr,
              "): these options have no 'lr': ", bag_.to_string());
  bag_.set("lr", lr);
}

void AdapterOptions::serialize(torch::serialize::OutputArchive& archive) const {
  for (const auto& item : bag_.items()) archive.write(item.first, item.second);
}

void AdapterOptions::serialize(torch::serialize::InputArchive& archive) {
  OptionBag bag;
  for (const std::string& key : archive.keys()) {
    // Every archive is a script module, which carries a "training" flag of its own.
    if (key == "training") continue;
    c10::IValue value;
    archive.read(key, value);
    bag.set(key, std::move(value));
  }
  bag_ = std::move(bag);
}

FunctionalOptimizerAdapter::FunctionalOptimizerAdapter(
    std::unique_ptr<FunctionalOptimizer> optimizer)
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                              make_defaults(optimizer)),
      optimizer_(std::move(optimizer)) {
  for (size_t g = 0; g < optimizer_->num_param_groups(); ++g) {
    param_groups_.push_back(mirror_group(g));
    check_leaves(param_groups_.back().params(), g);
  }
}

FunctionalOptimizerAdapter::FunctionalOptimizerAdapter(const std::string& name,
                                                       std::vector<ParamGroup> groups,
                                                       const OptionBag& defaults)
    : FunctionalOptimizerAdapter(create_optimizer(name, std::move(groups), defaults)) {}

FunctionalOptimizerAdapter::FunctionalOptimizerAdapter(const std::string& name,
                                                       std::vector<at::Tensor> params,
                                                       const OptionBag& defaults)
    : FunctionalOptimizerAdapter(name, std::vector<ParamGroup>{ParamGroup(std::move(params))},
                                 defaults) {}

std::vector<ParamGroup> FunctionalOptimizerAdapter::to_param_groups(
    const std::vector<torch::optim::OptimizerParamGroup>& groups, const OptionBag& defaults) {
  std::vector<ParamGroup> converted;
  converted.reserve(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    check_leaves(groups[g].params(), g);
    // A LibTorch group's options are complete; only the keys that differ from the defaults
    // need to become overrides (the others resolve to the same values).
    OptionBag overrides;
    if (groups[g].has_options()) {
      overrides = adapter_options(groups[g].options(), g).bag().changed_from(defaults);
    }
    converted.emplace_back(groups[g].params(), std::move(overrides));
  }
  return converted;
}

torch::optim::OptimizerParamGroup FunctionalOptimizerAdapter::mirror_group(size_t group) const {
  const auto& all = optimizer_->params();
  std::vector<at::Tensor> params;
  for (int64_t index : optimizer_->group_param_indices(group)) params.push_back(all.at(index));
  return torch::optim::OptimizerParamGroup(
      std::move(params), std::make_unique<AdapterOptions>(optimizer_->group_options(group)));
}

void FunctionalOptimizerAdapter::refresh_group_options(size_t group) {
  auto& mirror = param_groups_.at(group);
  auto* options = mirror.has_options() ? dynamic_cast<AdapterOptions*>(&mirror.options()) : nullptr;
  // Assign in place so references a user holds to the options object stay valid.
  if (options != nullptr) {
    options->bag() = optimizer_->group_options(group);
  } else {
    mirror.set_options(std::make_unique<AdapterOptions>(optimizer_->group_options(group)));
  }
}

void FunctionalOptimizerAdapter::sync() {
  const size_t known = optimizer_->num_param_groups();
  TORCH_CHECK(param_groups_.size() >= known, "FunctionalOptimizerAdapter: param_groups() holds ",
              param_groups_.size(), " groups but the optimizer has ", known,
              "; param groups cannot be removed");
  const auto& all = optimizer_->params();
  for (size_t g = 0; g < known; ++g) {
    const auto& mirror = param_groups_[g];
    const auto& indices = optimizer_->group_param_indices(g);
    bool same = mirror.params().size() == indices.size();
    for (size_t i = 0; same && i < indices.size(); ++i) {
      same = mirror.params()[i].unsafeGetTensorImpl() == all[indices[i]].unsafeGetTensorImpl();
    }
    TORCH_CHECK(same, "FunctionalOptimizerAdapter: the parameters of param group ", g,
                " were changed outside the optimizer (", mirror.params().size(),
                " parameters, the optimizer has ", indices.size(),
                "); add parameters only as a new group with add_param_group");
    TORCH_CHECK(mirror.has_options(), "FunctionalOptimizerAdapter: param group ", g,
                " has no options");
    const OptionBag& wanted = adapter_options(mirror.options(), g).bag();
    const OptionBag current = optimizer_->group_options(g);
    if (wanted != current) {
      const OptionBag changed = wanted.changed_from(current);
      if (!changed.empty()) optimizer_->set_group_options(g, changed);
      refresh_group_options(g);
    }
  }
  // Groups appended through torch::optim::Optimizer::add_param_group (non-virtual, so it
  // bypasses ours): LibTorch gave each complete options (a clone of defaults() when none).
  for (size_t g = known; g < param_groups_.size(); ++g) {
    const auto& mirror = param_groups_[g];
    check_leaves(mirror.params(), g);
    OptionBag overrides;
    if (mirror.has_options()) {
      overrides = adapter_options(mirror.options(), g).bag().changed_from(optimizer_->defaults());
    }
    optimizer_->add_param_group(ParamGroup(mirror.params(), std::move(overrides)));
    refresh_group_options(g);
  }
}

void FunctionalOptimizerAdapter::add_param_group(const torch::optim::OptimizerParamGroup& group) {
  sync();
  const size_t index = param_groups_.size();
  // A LibTorch group's options are complete: they replace defaults() as a whole.
  const OptionBag& options = group.has_options() ? adapter_options(group.options(), index).bag()
                                                 : adapter_options(*defaults_, index).bag();
  append_group(ParamGroup(group.params(), options.changed_from(optimizer_->defaults())));
}

void FunctionalOptimizerAdapter::add_param_group(const ParamGroup& group) {
  sync();
  const size_t index = param_groups_.size();
  // As in LibTorch, a new group starts from defaults() as they are now, which the user may have
  // changed since construction; its own overrides come on top.
  const OptionBag base =
      adapter_options(*defaults_, index).bag().changed_from(optimizer_->defaults());
  append_group(ParamGroup(group.params, base.merged_with(group.overrides)));
}

void FunctionalOptimizerAdapter::append_group(const ParamGroup& group) {
  check_leaves(group.params, param_groups_.size());
  optimizer_->add_param_group(group);
  param_groups_.push_back(mirror_group(optimizer_->num_param_groups() - 1));
}

at::Tensor FunctionalOptimizerAdapter::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  sync();
  const auto& params = optimizer_->params();
  grads_.resize(params.size());
  for (size_t i = 0; i < params.size(); ++i) grads_[i] = params[i].grad();
  try {
    optimizer_->step(grads_);
  } catch (...) {
    for (auto& grad : grads_) grad.reset();
    throw;
  }
  // Hold no reference to a gradient between steps: the user owns them (set_to_none, memory).
  for (auto& grad : grads_) grad.reset();
  return loss;
}

void FunctionalOptimizerAdapter::save(torch::serialize::OutputArchive& archive) const {
  // save() is const, so changes still pending in param_groups() (an LR scheduler's latest
  // set_lr, groups appended through the base class) are written into the snapshot here rather
  // than pushed to the functional optimizer first; the archive matches what step() would use.
  OptimizerStateDict dict = optimizer_->state_dict();
  const size_t known = optimizer_->num_param_groups();
  TORCH_INTERNAL_ASSERT(dict.param_groups.size() == known);
  int64_t next_index = static_cast<int64_t>(optimizer_->params().size());
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& mirror = param_groups_[g];
    TORCH_CHECK(mirror.has_options(), "FunctionalOptimizerAdapter::save: param group ", g,
                " has no options");
    const OptionBag& wanted = adapter_options(mirror.options(), g).bag();
    if (g < known) {
      TORCH_CHECK(mirror.params().size() == optimizer_->group_param_indices(g).size(),
                  "FunctionalOptimizerAdapter::save: the parameters of param group ", g,
                  " were changed outside the optimizer");
      dict.param_groups[g].overrides = dict.param_groups[g].overrides.merged_with(
          wanted.changed_from(optimizer_->group_options(g)));
    } else {
      OptimizerStateDict::Group group;
      for (size_t i = 0; i < mirror.params().size(); ++i)
        group.param_indices.push_back(next_index++);
      group.overrides = wanted.changed_from(optimizer_->defaults());
      dict.param_groups.push_back(std::move(group));
    }
  }
  archive.write(kArchiveKey, dict.to_ivalue());
}

void FunctionalOptimizerAdapter::load(torch::serialize::InputArchive& archive) {
  c10::IValue value;
  TORCH_CHECK(archive.try_read(kArchiveKey, value),
              "FunctionalOptimizerAdapter::load: the archive has no '", kArchiveKey,
              "' entry; it was not written by a distoptim adapter (LibTorch's own optimizers "
              "write another format)");
  const OptimizerStateDict dict = OptimizerStateDict::from_ivalue(value);
  sync();
  optimizer_->load_state_dict(dict);
  for (size_t g = 0; g < param_groups_.size(); ++g) refresh_group_options(g);
  // load_state_dict also restores the snapshot's defaults; keep defaults() their mirror.
  if (auto* defaults = dynamic_cast<AdapterOptions*>(defaults_.get())) {
    defaults->bag() = optimizer_->defaults();
  } else {
    defaults_ = std::make_unique<AdapterOptions>(optimizer_->defaults());
  }
}

}  // namespace optim
}  // namespace distoptim
