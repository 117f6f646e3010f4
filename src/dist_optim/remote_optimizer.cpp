#include "remote_optimizer.h"

#include <mutex>

#include <c10/util/Exception.h>

#include <distoptim/dist_autograd/context.h>
#include <distoptim/optim/registry.h>
#include <distoptim/rpc/api.h>
#include <distoptim/rpc/classes.h>
#include <distoptim/rpc/detail/internal_registry.h>
#include <distoptim/rpc/row_guard.h>

namespace distoptim {
namespace dist_optim {
namespace detail {

namespace {

// The local values of `groups`, each with its overrides. Parameters are numbered across groups,
// as the owner's optimizer numbers them.
std::vector<optim::ParamGroup> local_groups(
    const std::vector<std::vector<rpc::RRef<at::Tensor>>>& groups,
    const std::vector<c10::IValue>& overrides) {
  TORCH_CHECK_VALUE(groups.size() == overrides.size(), "DistributedOptimizer: ", groups.size(),
                    " param groups with ", overrides.size(), " sets of overrides");
  std::vector<optim::ParamGroup> out;
  size_t i = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<at::Tensor> values;
    values.reserve(groups[g].size());
    for (const rpc::RRef<at::Tensor>& param : groups[g]) {
      TORCH_CHECK_VALUE(param.is_owner(), "DistributedOptimizer: parameter ", i, " (",
                        param.owner().name, "'s) reached the optimizer of worker '",
                        rpc::get_worker_info().name, "'");
      values.push_back(param.local_value());
      TORCH_CHECK_VALUE(values.back().requires_grad() && values.back().is_leaf(),
                        "DistributedOptimizer: parameter ", i, " on worker '",
                        rpc::get_worker_info().name,
                        "' is not a leaf tensor that requires grad, so no gradient reaches it");
      ++i;
    }
    out.emplace_back(std::move(values), optim::OptionBag::from_ivalue(overrides[g]));
  }
  return out;
}

}  // namespace

RemoteOptimizer::RemoteOptimizer(std::string optimizer,
                                 std::vector<std::vector<rpc::RRef<at::Tensor>>> groups,
                                 c10::IValue options, std::vector<c10::IValue> overrides)
    : optimizer_(optim::create_optimizer(optimizer, local_groups(groups, overrides),
                                         optim::OptionBag::from_ivalue(options))) {}

void RemoteOptimizer::step(int64_t context_id, c10::IValue changes) {
  // Lock order: this optimizer's mutex, then the tensors' locks (row_guard.h).
  std::lock_guard<std::mutex> lock(mutex_);
  // All or nothing: the step's gradients are read here, under its lock, before anything changes.
  // A step whose trainer was lost before this point finds its context released (the trainer's
  // contexts go with it) and fails having changed nothing, options included; one that got its
  // gradients is applied whole, whatever becomes of its caller meanwhile. A context the backward
  // pass never brought here has no gradients for this owner: a step of nothing.
  const c10::Dict<at::Tensor, at::Tensor> all =
      dist_autograd::detail::gradients_if_reached(context_id);
  std::vector<at::Tensor> gradients;
  gradients.reserve(optimizer_->params().size());
  for (const at::Tensor& param : optimizer_->params()) {
    auto it = all.find(param);
    gradients.push_back(it == all.end() ? at::Tensor() : it->value());
  }
  if (!changes.isNone()) {
    TORCH_CHECK_TYPE(changes.isList(), "DistributedOptimizer: option changes must be a list, got ",
                     changes.tagKind());
    const c10::ArrayRef<c10::IValue> by_group = changes.toListRef();
    TORCH_CHECK_VALUE(by_group.size() == optimizer_->num_param_groups(),
                      "DistributedOptimizer: ", "option changes for ", by_group.size(),
                      " param groups, the optimizer of '", rpc::get_worker_info().name, "' has ",
                      optimizer_->num_param_groups());
    // Every group's bag is decoded before any is set. The caller checked them as this optimizer
    // does; a group set again with the same values (after a failed step) is unchanged.
    std::vector<optim::OptionBag> bags;
    bags.reserve(by_group.size());
    for (const c10::IValue& bag : by_group) bags.push_back(optim::OptionBag::from_ivalue(bag));
    for (size_t g = 0; g < bags.size(); ++g) {
      if (!bags[g].empty()) optimizer_->set_group_options(g, bags[g]);
    }
  }
  if (!optimizer_->updates_only_gradient_rows(gradients)) {
    rpc::InPlaceUpdateGuard no_reply_reads_meanwhile;
    optimizer_->step(gradients);
    return;
  }
  // Only the rows the sparse gradients name change (parameters and this optimizer's state, which
  // mutex_ guards): other trainers' steps of other rows, and lookups of them, go on meanwhile.
  std::vector<at::Tensor> params, rows;
  for (size_t i = 0; i < gradients.size(); ++i) {
    if (!gradients[i].defined()) continue;
    params.push_back(optimizer_->params()[i]);
    rows.push_back(gradients[i]._indices().select(0, 0));
  }
  rpc::InPlaceRowUpdateGuard no_reply_reads_these_rows_meanwhile(params, rows);
  optimizer_->step(gradients);
}

c10::IValue RemoteOptimizer::state_dict() {
  // Copies of the state (OptimizerStateDict), taken between this optimizer's steps.
  std::lock_guard<std::mutex> lock(mutex_);
  return optimizer_->state_dict().to_ivalue();
}

void RemoteOptimizer::load_state_dict(c10::IValue state) {
  std::lock_guard<std::mutex> lock(mutex_);
  optimizer_->load_state_dict(optim::OptimizerStateDict::from_ivalue(state));
}

namespace {
bool register_remote_optimizer() {
  rpc::detail::register_internal_class<RemoteOptimizer, std::string,
                                       std::vector<std::vector<rpc::RRef<at::Tensor>>>, c10::IValue,
                                       std::vector<c10::IValue>>(kRemoteOptimizerClass);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "step", &RemoteOptimizer::step);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "state_dict",
                                        &RemoteOptimizer::state_dict);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "load_state_dict",
                                        &RemoteOptimizer::load_state_dict);
  return true;
}
}  // namespace

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim

// Registered at start-up, so that an owner which never builds a DistributedOptimizer itself (a
// parameter server) can host one. The linker is told to keep this symbol (CMakeLists.txt).
extern "C" const bool distoptim_dist_optim_registered =  // NOLINT: a C name, kept by the linker
    distoptim::dist_optim::detail::register_remote_optimizer();
