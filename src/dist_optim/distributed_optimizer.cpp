// DistributedOptimizer (distributed_optimizer.h), the trainer's side: one RemoteOptimizer per
// owner of the parameters, each step sent to every owner at once, the options and state dicts
// gathered from them. Rebinding to parameters made anew is rebind.cpp's.

#include <distoptim/dist_optim/distributed_optimizer.h>

#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>
#include <distoptim/dist_autograd/context.h>
#include <distoptim/optim/registry.h>
#include <distoptim/rpc/api.h>
#include <distoptim/rpc/detail/rref_calls.h>
#include <distoptim/rpc/errors.h>

#include "optimizer_owner.h"
#include "owner_calls.h"
#include "remote_optimizer.h"

namespace distoptim {
namespace dist_optim {

using detail::note_failure;
using detail::RemoteOptimizer;
using detail::Replies;
using detail::throw_failures;
using detail::throw_if_failed;
using detail::wait_all;
using detail::wait_each;
using detail::waited_method;
using detail::worker_of;

std::vector<detail::OwnerOptimizer> detail::OwnerAccess::owners(
    const DistributedOptimizer& optimizer) {
  std::vector<OwnerOptimizer> out;
  for (const DistributedOptimizer::Owner& owner : optimizer.owners_) {
    out.push_back({owner.worker, owner.positions, owner.optimizer});
  }
  return out;
}

namespace {

// An optimizer's checks of `overrides` of param group `group`, when it refuses them.
void add_group_context(c10::Error& error, size_t group, const optim::OptionBag& overrides,
                       const char* where) {
  error.add_context("DistributedOptimizer: param group " + std::to_string(group) + ": options " +
                    overrides.to_string() + " refused " + where);
}

void check_group_count(size_t mirrored, size_t built) {
  TORCH_CHECK_VALUE(mirrored == built, "DistributedOptimizer: ", mirrored,
                    " param groups, built with ", built,
                    "; groups are fixed at construction (the parameters live on their owners)");
}

std::vector<RemoteParamGroup> one_group(std::vector<rpc::RRef<at::Tensor>> params) {
  std::vector<RemoteParamGroup> groups;
  groups.emplace_back(std::move(params));
  return groups;
}

}  // namespace

DistributedOptimizer::DistributedOptimizer(const std::string& optimizer,
                                           std::vector<rpc::RRef<at::Tensor>> params,
                                           const optim::OptionBag& options)
    : DistributedOptimizer(optimizer, one_group(std::move(params)), options) {}

DistributedOptimizer::DistributedOptimizer(const std::string& optimizer,
                                           std::vector<RemoteParamGroup> groups,
                                           const optim::OptionBag& options)
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                              std::make_unique<optim::AdapterOptions>()),
      optimizer_(optimizer) {
  size_t total = 0;
  for (const RemoteParamGroup& group : groups) total += group.params.size();
  TORCH_CHECK_VALUE(total > 0, "DistributedOptimizer: the parameter list is empty",
                    groups.size() > 1 ? " (in every param group)" : "");
  // The name, the options and every group's overrides are checked here, as every owner would
  // check them, so that a typo is one local error rather than one remote error per owner. This
  // optimizer, over one empty tensor per group, stays to check later changes (check_).
  try {
    check_ = optim::create_optimizer(optimizer, {optim::ParamGroup({at::empty({0})})}, options);
  } catch (c10::Error& error) {
    error.add_context("DistributedOptimizer: refused here, before any owner was asked");
    throw;
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    try {
      if (g == 0) {
        check_->set_group_options(0, groups[0].overrides);
      } else {
        check_->add_param_group(optim::ParamGroup({at::empty({0})}, groups[g].overrides));
      }
    } catch (c10::Error& error) {
      add_group_context(error, g, groups[g].overrides, "here, before any owner was asked");
      throw;
    }
  }
  // The mirror LibTorch's schedulers read and write: no tensors, each group's complete options.
  defaults_ = std::make_unique<optim::AdapterOptions>(check_->defaults());
  for (size_t g = 0; g < groups.size(); ++g) {
    current_.push_back(check_->group_options(g));
    param_groups_.emplace_back(std::vector<at::Tensor>{},
                               std::make_unique<optim::AdapterOptions>(current_.back()));
  }
  // The owners in order of their first parameter, and each one's parameters of each group in
  // list order (positions count across groups, group 0 first).
  std::map<std::string, size_t> owner_index;
  std::vector<std::vector<std::vector<rpc::RRef<at::Tensor>>>> owner_params;
  std::map<const void*, std::pair<size_t, size_t>> seen;  // RRef handle -> position, group
  size_t i = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const rpc::RRef<at::Tensor>& param : groups[g].params) {
      TORCH_CHECK_VALUE(param.defined(), "DistributedOptimizer: params[", i, "] is empty",
                        groups.size() > 1 ? " (param group " + std::to_string(g) + ")" : "");
      const auto [first, fresh] = seen.emplace(param.handle().get(), std::pair{i, g});
      TORCH_CHECK_VALUE(fresh, "DistributedOptimizer: params[", i, "] repeats params[",
                        first->second.first, "] (a parameter of worker '", param.owner().name, "'",
                        groups.size() > 1
                            ? ", in param groups " + std::to_string(first->second.second) +
                                  " and " + std::to_string(g)
                            : "",
                        ")");
      const std::string worker = param.owner().name;
      auto [it, inserted] = owner_index.emplace(worker, owners_.size());
      if (inserted) {
        owners_.push_back({worker, {}, {}, current_, options_generation_, {}, {}});
        owner_params.emplace_back(groups.size());
      }
      owners_[it->second].positions.push_back(static_cast<int64_t>(i));
      owners_[it->second].params.push_back(param);
      owners_[it->second].groups.push_back(g);
      owner_params[it->second][g].push_back(param);
      ++i;
    }
  }
  std::vector<c10::IValue> overrides;
  for (const RemoteParamGroup& group : groups) overrides.push_back(group.overrides.to_ivalue());
  for (size_t k = 0; k < owners_.size(); ++k) {
    owners_[k].optimizer = rpc::remote<RemoteOptimizer>(
        owners_[k].worker, detail::kRemoteOptimizerClass,
        std::tuple{optimizer, owner_params[k], options.to_ivalue(), overrides});
  }
  // Construction errors surface here, each naming its worker; the optimizers that were built
  // are freed with the last reference to them.
  std::exception_ptr first;
  std::string failures;
  for (Owner& owner : owners_) {
    try {
      owner.optimizer.confirm();
    } catch (const std::exception&) {
      note_failure(owner.worker, &first, &failures);
    }
  }
  if (first) {
    owners_.clear();
    throw_failures(first, "construction of '" + optimizer + "'", failures);
  }
}

std::vector<rpc::RRef<at::Tensor>> DistributedOptimizer::parameters() const {
  size_t total = 0;
  for (const Owner& owner : owners_) total += owner.positions.size();
  std::vector<rpc::RRef<at::Tensor>> out(total);
  for (const Owner& owner : owners_) {
    for (size_t j = 0; j < owner.positions.size(); ++j) out[owner.positions[j]] = owner.params[j];
  }
  return out;
}

c10::IValue DistributedOptimizer::changes_for(Owner& owner) const {
  if (owner.applied_generation == options_generation_) return c10::IValue();
  c10::impl::GenericList by_group(c10::AnyType::get());
  bool any = false;
  for (size_t g = 0; g < current_.size(); ++g) {
    const optim::OptionBag changed = current_[g].changes_from(owner.applied[g]);
    any = any || !changed.empty();
    by_group.push_back(changed.to_ivalue());
  }
  if (any) return by_group;
  owner.applied_generation = options_generation_;
  return c10::IValue();
}

void DistributedOptimizer::step(int64_t context_id) {
  check_pending_changes();
  if (outstanding_) {
    step_ahead(context_id);
    return;
  }
  ++steps_taken_;
  std::vector<rpc::RpcFuture<c10::IValue>> steps;
  std::vector<bool> sent_changes(owners_.size(), false);
  // The step's calls name their context as an argument and carry no tensor: sent outside it, so
  // distributed autograd records nothing for them, on either side (as in PyTorch, whose calls
  // without a tensor that requires grad travel plain). Each owner reads the context's gradients
  // where the backward pass left them, none where it never came (gradients_if_reached). Only the
  // sends: a wait in the loop's modes reads its replies without swapping this thread's state.
  {
    const c10::AutoGradMode outside_the_context(false);
    for (Owner& owner : owners_) {
      c10::IValue changes = changes_for(owner);
      sent_changes[steps.size()] = !changes.isNone();
      steps.push_back(
          waited_method(owner.optimizer, "step", rpc::detail::to_values(context_id, changes)));
    }
  }
  Replies replies = wait_each(steps, worker_of(owners_));
  // An owner that failed gets the same changes again next step (setting an option to the value
  // it already has changes nothing).
  for (size_t k = 0; k < owners_.size(); ++k) {
    if (sent_changes[k] && replies.ok[k]) {
      owners_[k].applied = current_;
      owners_[k].applied_generation = options_generation_;
    }
  }
  throw_if_failed(replies, "step(" + std::to_string(context_id) + ")");
}

at::Tensor DistributedOptimizer::step(LossClosure closure) {
  const std::optional<int64_t> context = dist_autograd::current_context_id();
  TORCH_CHECK_VALUE(context.has_value(),
                    "DistributedOptimizer::step(closure): no distributed autograd context is "
                    "current on this thread; make one with a dist_autograd::ContextGuard around "
                    "the forward pass, backward and step, or call step(context_id)");
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  step(*context);
  return loss;
}

optim::OptionBag DistributedOptimizer::group_options(size_t group) const {
  TORCH_CHECK_INDEX(group < param_groups_.size(), "DistributedOptimizer::group_options: param ",
                    "group ", group, " out of range (", param_groups_.size(), " groups)");
  return mirror_options(group);
}

void DistributedOptimizer::set_group_options(size_t group, const optim::OptionBag& changes) {
  TORCH_CHECK_INDEX(group < param_groups_.size(),
                    "DistributedOptimizer::set_group_options: ", "param group ", group,
                    " out of range (", param_groups_.size(), " groups)");
  apply_checked(group, mirror_options(group).merged_with(changes), "by set_group_options");
  mirror_current(group);
}

void DistributedOptimizer::mirror_current(size_t group) {
  // In place, so a reference a user holds to the options stays valid.
  torch::optim::OptimizerParamGroup& mirror = param_groups_[group];
  auto* options =
      mirror.has_options() ? dynamic_cast<optim::AdapterOptions*>(&mirror.options()) : nullptr;
  if (options != nullptr) {
    options->bag() = current_[group];
  } else {
    mirror.set_options(std::make_unique<optim::AdapterOptions>(current_[group]));
  }
}

const optim::OptionBag& DistributedOptimizer::mirror_options(size_t group) const {
  const torch::optim::OptimizerParamGroup& mirror = param_groups_[group];
  const auto* options = mirror.has_options()
                            ? dynamic_cast<const optim::AdapterOptions*>(&mirror.options())
                            : nullptr;
  TORCH_CHECK_VALUE(options != nullptr, "DistributedOptimizer: the options of param group ", group,
                    " are not a distoptim::optim::AdapterOptions (set them through "
                    "set_group_options, set_lr or AdapterOptions::set)");
  TORCH_CHECK_VALUE(mirror.params().empty(), "DistributedOptimizer: param group ", group,
                    " holds tensors; a DistributedOptimizer's parameters are given to its "
                    "constructor, as references to their owners' values");
  return options->bag();
}

void DistributedOptimizer::apply_checked(size_t group, const optim::OptionBag& wanted,
                                         const char* how) const {
  const optim::OptionBag changed = wanted.changes_from(current_[group]);
  if (changed.empty()) return;
  try {
    check_->set_group_options(group, changed);
  } catch (c10::Error& error) {
    add_group_context(error, group, changed, how);
    throw;
  }
  current_[group] = check_->group_options(group);
  ++options_generation_;
}

void DistributedOptimizer::check_pending_changes() const {
  check_group_count(param_groups_.size(), current_.size());
  for (size_t g = 0; g < current_.size(); ++g) {
    apply_checked(g, mirror_options(g), "(changed through param_groups())");
  }
}

DistributedOptimizerStateDict DistributedOptimizer::state_dict() const {
  check_pending_changes();
  if (outstanding_) outstanding_->wait_all();  // every step taken is in the state
  std::vector<rpc::RpcFuture<c10::IValue>> states;
  for (const Owner& owner : owners_) {
    states.push_back(waited_method(owner.optimizer, "state_dict", {}));
  }
  const std::vector<c10::IValue> values = wait_all(states, worker_of(owners_), "state_dict()");
  DistributedOptimizerStateDict dict;
  dict.optimizer = optimizer_;
  for (size_t k = 0; k < owners_.size(); ++k) {
    optim::OptimizerStateDict state = optim::OptimizerStateDict::from_ivalue(values[k]);
    TORCH_INTERNAL_ASSERT(state.param_groups.size() == current_.size());
    // Options set here that this owner has not taken yet (an LR scheduler's latest) belong in
    // the checkpoint: resuming from it must not step with the rate from before.
    for (size_t g = 0; g < current_.size(); ++g) {
      optim::OptionBag& overrides = state.param_groups[g].overrides;
      overrides =
          overrides.merged_with(current_[g].changes_from(state.defaults.merged_with(overrides)));
    }
    dict.owners.push_back({owners_[k].worker, owners_[k].positions, std::move(state)});
  }
  return dict;
}

void DistributedOptimizer::load_state_dict(const DistributedOptimizerStateDict& dict) {
  TORCH_CHECK_VALUE(dict.optimizer == optimizer_, "DistributedOptimizer::load_state_dict: the ",
                    "state is of optimizer '", dict.optimizer, "', this one is '", optimizer_, "'");
  check_group_count(param_groups_.size(), current_.size());
  TORCH_CHECK_VALUE(dict.owners.size() == owners_.size(),
                    "DistributedOptimizer::load_state_dict: ", "the state has ", dict.owners.size(),
                    " owner(s), this optimizer ", owners_.size());
  for (size_t k = 0; k < owners_.size(); ++k) {
    TORCH_CHECK_VALUE(dict.owners[k].worker == owners_[k].worker &&
                          dict.owners[k].positions == owners_[k].positions,
                      "DistributedOptimizer::load_state_dict: owner ", k, " of the state is '",
                      dict.owners[k].worker, "' with parameters ",
                      c10::IntArrayRef(dict.owners[k].positions), ", this optimizer's is '",
                      owners_[k].worker, "' with ", c10::IntArrayRef(owners_[k].positions));
    TORCH_CHECK_VALUE(dict.owners[k].state.param_groups.size() == current_.size(),
                      "DistributedOptimizer::load_state_dict: owner ", k, " ('",
                      dict.owners[k].worker, "') of the state has ",
                      dict.owners[k].state.param_groups.size(), " param group(s), this optimizer ",
                      current_.size());
  }
  // Each group's options after loading: the first owner's (every owner's, for a dict that
  // state_dict() made). Checked here as a whole before anything is sent.
  const optim::OptimizerStateDict& first = dict.owners[0].state;
  std::vector<optim::OptionBag> loaded;
  for (const auto& group : first.param_groups) {
    loaded.push_back(first.defaults.merged_with(group.overrides));
  }
  {
    std::vector<optim::ParamGroup> empty_groups;
    for (const auto& group : first.param_groups) {
      empty_groups.emplace_back(std::vector<at::Tensor>{at::empty({0})}, group.overrides);
    }
    try {
      (void)optim::create_optimizer(optimizer_, std::move(empty_groups), first.defaults);
    } catch (c10::Error& error) {
      error.add_context("DistributedOptimizer::load_state_dict: the options of owner 0 ('" +
                        dict.owners[0].worker + "') of the state, refused here");
      throw;
    }
  }
  flush();  // the steps taken before come first
  std::vector<rpc::RpcFuture<c10::IValue>> loads;
  for (size_t k = 0; k < owners_.size(); ++k) {
    loads.push_back(waited_method(owners_[k].optimizer, "load_state_dict",
                                  rpc::detail::to_values(dict.owners[k].state.to_ivalue())));
  }
  const Replies replies = wait_each(loads, worker_of(owners_));
  for (size_t k = 0; k < owners_.size(); ++k) {
    if (!replies.ok[k]) continue;  // its record of applied options still holds
    const optim::OptimizerStateDict& state = dict.owners[k].state;
    for (size_t g = 0; g < current_.size(); ++g) {
      owners_[k].applied[g] = state.defaults.merged_with(state.param_groups[g].overrides);
    }
  }
  // The loaded options become this optimizer's, whatever owner refused: that is what was asked.
  for (size_t g = 0; g < current_.size(); ++g) {
    apply_checked(g, loaded[g], "when loading the state");
    mirror_current(g);
  }
  ++options_generation_;  // each owner's record changed: compare at the next step
  defaults_ = std::make_unique<optim::AdapterOptions>(first.defaults);
  throw_if_failed(replies, "load_state_dict()");
}

void DistributedOptimizer::save(torch::serialize::OutputArchive& archive) const {
  // The entry the optimizer adapters write, under which torch::load finds it again.
  archive.write(optim::FunctionalOptimizerAdapter::kArchiveKey, state_dict().to_ivalue());
}

void DistributedOptimizer::load(torch::serialize::InputArchive& archive) {
  c10::IValue value;
  TORCH_CHECK_VALUE(archive.try_read(optim::FunctionalOptimizerAdapter::kArchiveKey, value),
                    "DistributedOptimizer::load: the archive has no '",
                    optim::FunctionalOptimizerAdapter::kArchiveKey,
                    "' entry (it was not written by torch::save of a DistributedOptimizer)");
  load_state_dict(DistributedOptimizerStateDict::from_ivalue(value));
}

std::vector<std::string> DistributedOptimizer::owners() const {
  std::vector<std::string> names;
  for (const Owner& owner : owners_) names.push_back(owner.worker);
  return names;
}

c10::IValue DistributedOptimizerStateDict::to_ivalue() const {
  c10::impl::GenericList list(c10::AnyType::get());
  for (const Owner& owner : owners) {
    c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
    entry.insert("worker", owner.worker);
    entry.insert("positions", c10::List<int64_t>(owner.positions));
    entry.insert("state", owner.state.to_ivalue());
    list.push_back(std::move(entry));
  }
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("optimizer", optimizer);
  dict.insert("owners", std::move(list));
  return dict;
}

DistributedOptimizerStateDict DistributedOptimizerStateDict::from_ivalue(const c10::IValue& value) {
  auto field = [](const c10::impl::GenericDict& dict, const char* key, const char* where) {
    auto it = dict.find(key);
    TORCH_CHECK_VALUE(it != dict.end(), "DistributedOptimizerStateDict: ", where, " has no '", key,
                      "'");
    return it->value();
  };
  TORCH_CHECK_TYPE(value.isGenericDict(), "DistributedOptimizerStateDict: expected a dict, got ",
                   value.tagKind());
  const auto dict = value.toGenericDict();
  DistributedOptimizerStateDict out;
  const c10::IValue name = field(dict, "optimizer", "the state");
  TORCH_CHECK_TYPE(name.isString(), "DistributedOptimizerStateDict: 'optimizer' is not a string");
  out.optimizer = name.toStringRef();
  const c10::IValue owners = field(dict, "owners", "the state");
  TORCH_CHECK_TYPE(owners.isList(), "DistributedOptimizerStateDict: 'owners' is not a list");
  for (const c10::IValue& item : owners.toListRef()) {
    TORCH_CHECK_TYPE(item.isGenericDict(), "DistributedOptimizerStateDict: an owner is not a dict");
    const auto entry = item.toGenericDict();
    Owner owner;
    const c10::IValue worker = field(entry, "worker", "an owner");
    const c10::IValue positions = field(entry, "positions", "an owner");
    TORCH_CHECK_TYPE(worker.isString() && positions.isList(),
                     "DistributedOptimizerStateDict: an owner's 'worker' or 'positions' has the "
                     "wrong type");
    owner.worker = worker.toStringRef();
    for (const c10::IValue& position : positions.toListRef()) {
      TORCH_CHECK_TYPE(position.isInt(), "DistributedOptimizerStateDict: a position of '",
                       owner.worker, "' is not an int");
      owner.positions.push_back(position.toInt());
    }
    owner.state = optim::OptimizerStateDict::from_ivalue(field(entry, "state", "an owner"));
    out.owners.push_back(std::move(owner));
  }
  return out;
}

}  // namespace dist_optim
}  // namespace distoptim
