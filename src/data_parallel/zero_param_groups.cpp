// ZeroRedundancyOptimizer's param groups as a torch::optim::Optimizer shows them (so LibTorch's
// LR schedulers drive it), and how their options reach the local optimizer: checked on every
// rank, agreed across the ranks, then applied, at each step.
#include <torch/optim/optimizer.h>

#include <distoptim/optim/torch_adapter.h>

#include "zero_impl.h"

namespace distoptim {
namespace data_parallel {

using zero_detail::kName;

std::unique_ptr<torch::optim::OptimizerOptions> ZeroRedundancyOptimizer::Impl::local_group_options(
    size_t g) const {
  if (const optim::LibTorchOptimizerAdapter* adapter = libtorch_adapter()) {
    return adapter->optimizer().param_groups().at(g).options().clone();
  }
  return std::make_unique<optim::AdapterOptions>(local->group_options(g));
}

torch::optim::OptimizerParamGroup ZeroRedundancyOptimizer::Impl::mirror_group(size_t g) const {
  std::vector<at::Tensor> group_params;
  for (int64_t i : group_indices.at(g)) group_params.push_back(params[i]);
  return torch::optim::OptimizerParamGroup(std::move(group_params), local_group_options(g));
}

std::unique_ptr<torch::optim::OptimizerOptions> ZeroRedundancyOptimizer::Impl::default_options()
    const {
  if (const optim::LibTorchOptimizerAdapter* adapter = libtorch_adapter()) {
    return adapter->optimizer().defaults().clone();
  }
  return std::make_unique<optim::AdapterOptions>(local->defaults());
}

void ZeroRedundancyOptimizer::Impl::refresh_mirror_options(size_t g) {
  torch::optim::OptimizerParamGroup& group = mirror->at(g);
  auto* options =
      group.has_options() ? dynamic_cast<optim::AdapterOptions*>(&group.options()) : nullptr;
  if (options != nullptr && libtorch_adapter() == nullptr) {
    // In place, so a reference a user holds to the options stays valid.
    options->bag() = local->group_options(g);
  } else {
    group.set_options(local_group_options(g));
  }
}

optim::OptionBag ZeroRedundancyOptimizer::Impl::wanted_options(size_t g) const {
  const torch::optim::OptimizerParamGroup& group = mirror->at(g);
  TORCH_CHECK_VALUE(group.has_options(), kName, ": param group ", g, " has no options");
  if (libtorch_adapter() != nullptr) return optim::OptionBag().set("lr", group.options().get_lr());
  const auto* options = dynamic_cast<const optim::AdapterOptions*>(&group.options());
  TORCH_CHECK_VALUE(options != nullptr, kName, ": the options of param group ", g,
                    " are not a distoptim::optim::AdapterOptions (LibTorch's own options types, "
                    "such as torch::optim::AdamOptions, do not apply to a distoptim optimizer)");
  return options->bag();
}

optim::OptionBag ZeroRedundancyOptimizer::Impl::current_options(size_t g) const {
  if (const optim::LibTorchOptimizerAdapter* adapter = libtorch_adapter()) {
    return optim::OptionBag().set("lr",
                                  adapter->optimizer().param_groups().at(g).options().get_lr());
  }
  return local->group_options(g);
}

void ZeroRedundancyOptimizer::Impl::check_group_change(size_t g,
                                                       const optim::OptionBag& changes) const {
  if (libtorch_adapter() == nullptr) {
    local->check_group_options(g, changes);
    return;
  }
  for (const std::string& key : changes.keys()) {
    TORCH_CHECK_VALUE(key == "lr", kName, ": param group ", g, ": option '", key,
                      "' cannot be set through an OptionBag on a LibTorch local optimizer; only "
                      "'lr' can (set the others on param_groups()'s options)");
  }
  if (changes.contains("lr")) {
    const double lr = changes.get_double("lr");
    TORCH_CHECK_VALUE(lr >= 0, kName, ": param group ", g, ": invalid learning rate ", lr);
  }
}

void ZeroRedundancyOptimizer::Impl::apply_group_options(const std::string& caller,
                                                        const std::string& call) {
  const size_t groups = group_indices.size();
  std::vector<optim::OptionBag> changes(groups);
  std::string options_text;
  StateDictCheck check;
  try {
    TORCH_CHECK_VALUE(mirror->size() == groups, "param_groups() holds ", mirror->size(),
                      " groups, the optimizer ", groups,
                      "; groups are added with ZeroRedundancyOptimizer::add_param_group");
    for (size_t g = 0; g < groups; ++g) {
      TORCH_CHECK_VALUE((*mirror)[g].params().size() == group_indices[g].size(),
                        "the parameters of param group ", g,
                        " were changed outside the optimizer (", (*mirror)[g].params().size(),
                        " parameters, the optimizer has ", group_indices[g].size(), ")");
      const optim::OptionBag wanted = wanted_options(g);
      options_text += wanted.to_string();
      options_text += '\n';
      changes[g] = wanted.changes_from(current_options(g));
      if (!changes[g].empty()) check_group_change(g, changes[g]);
    }
    check.digest = bytes_digest(options_text.data(), options_text.size());
  } catch (const std::exception& e) {
    check.error = error_text(e);
  }
  AgreementWording wording;
  wording.failed = "cannot apply its param group options";
  wording.disagree = "ranks hold different param group options";
  wording.outcome = "no rank changed anything";
  wording.outcome_here = "nothing changed on this rank";
  wording.exchanged = "the param group options";
  wording.call = call;
  agree_on_state_dict(group, check, caller, wording);
  // Checked on every rank and the same everywhere: nothing below refuses.
  optim::LibTorchOptimizerAdapter* adapter = libtorch_adapter();
  for (size_t g = 0; g < groups; ++g) {
    if (adapter != nullptr) {
      // The LibTorch optimizer takes the group's options whole: what the user set on the typed
      // options (betas, ...) goes along with the learning rate.
      adapter->optimizer().param_groups()[g].set_options((*mirror)[g].options().clone());
    } else if (!changes[g].empty()) {
      local->set_group_options(g, changes[g]);
    }
  }
}

size_t ZeroRedundancyOptimizer::num_param_groups() const { return impl_->group_indices.size(); }

optim::OptionBag ZeroRedundancyOptimizer::group_options(size_t group) const {
  TORCH_CHECK_INDEX(group < num_param_groups(), kName, ".group_options: param group ", group,
                    " out of range (", num_param_groups(), " groups)");
  return impl_->wanted_options(group);
}

void ZeroRedundancyOptimizer::set_group_options(size_t group, const optim::OptionBag& changes) {
  Impl& s = *impl_;
  TORCH_CHECK_INDEX(group < num_param_groups(), kName, ".set_group_options: param group ", group,
                    " out of range (", num_param_groups(), " groups)");
  const optim::OptionBag wanted = s.wanted_options(group).merged_with(changes);
  try {
    s.check_group_change(group, wanted.changes_from(s.current_options(group)));
  } catch (c10::Error& error) {
    error.add_context(c10::str(kName, ".set_group_options(", group, ", ", changes.to_string(),
                               ") on rank ", s.group.global_rank(s.my_rank()),
                               ": refused; nothing changed"));
    throw;
  }
  torch::optim::OptimizerOptions& options = param_groups_.at(group).options();
  if (s.libtorch_adapter() != nullptr) {
    options.set_lr(wanted.get_double("lr"));
  } else {
    dynamic_cast<optim::AdapterOptions&>(options).bag() = wanted;
  }
}

void ZeroRedundancyOptimizer::expose_param_groups() {
  impl_->mirror = &param_groups_;
  param_groups_.clear();
  for (size_t g = 0; g < impl_->group_indices.size(); ++g) {
    param_groups_.push_back(impl_->mirror_group(g));
  }
  defaults_ = impl_->default_options();
}

}  // namespace data_parallel
}  // namespace distoptim
