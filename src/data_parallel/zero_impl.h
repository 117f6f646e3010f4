#pragma once

// ZeroRedundancyOptimizer's state and the helpers its files share: zero_redundancy_optimizer.cpp
// (the optimizer), zero_partition.cpp (which rank updates which parameter),
// zero_param_groups.cpp (the param groups a torch::optim::Optimizer shows, their options agreed
// across the ranks) and zero_step_hook.cpp (the DDP hook of overlap_with_ddp,
// hook_with_zero_step).

#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>
#include <distoptim/data_parallel/zero_redundancy_optimizer.h>
#include <distoptim/optim/libtorch_optimizer_adapter.h>
#include <distoptim/optim/registry.h>

#include "parameter_check.h"
#include "state_dict_agreement.h"
#include "zero_owner_reduction.h"

namespace distoptim {
namespace data_parallel {
namespace zero_detail {

constexpr const char* kName = "ZeroRedundancyOptimizer";

// Checks the parameters of `groups` (and that none is in `existing`) before anything is built.
void check_params(const std::vector<optim::ParamGroup>& groups,
                  const std::vector<at::Tensor>& existing, int global_rank,
                  const std::string& caller);

// The rank owning each parameter (see zero_partition).
std::vector<int> sorted_greedy_owners(const std::vector<at::Tensor>& params,
                                      const std::vector<std::vector<int64_t>>& group_indices,
                                      int world_size);

}  // namespace zero_detail

struct ZeroRedundancyOptimizer::Impl {
  comm::Group group;
  bool bucket_view = false;
  std::vector<at::Tensor> params;
  std::vector<std::vector<int64_t>> group_indices;
  std::vector<int> owner;
  // partition[r]: the parameters rank r updates, in params() order; its local optimizer holds
  // them group by group in that order.
  std::vector<std::vector<int64_t>> partition;
  // The local optimizer over this rank's parameters (a LibTorch one through
  // optim::LibTorchOptimizerAdapter).
  std::unique_ptr<optim::FunctionalOptimizer> local;
  // With parameters_as_bucket_view: buckets[r] holds rank r's parameters, one flat tensor per
  // dtype.
  std::vector<std::vector<at::Tensor>> buckets;
  std::optional<optim::OptimizerStateDict> consolidated;
  bool overlap_with_ddp = false;
  // 1 or 2 (ZeroRedundancyOptimizerOptions::stage); with 2, owner_reduction averages the
  // gradients onto their owners during backward.
  int stage = 1;
  std::unique_ptr<zero_detail::OwnerReduction> owner_reduction;
  // The param groups as LibTorch sees them: the torch::optim::Optimizer base's param_groups_ of
  // the optimizer holding this state. Their options are what a scheduler or the user sets;
  // apply_group_options makes the local optimizer agree with them.
  std::vector<torch::optim::OptimizerParamGroup>* mirror = nullptr;

  // Param group options (zero_param_groups.cpp).
  // The options the local optimizer runs for group g, as the mirror shows them.
  std::unique_ptr<torch::optim::OptimizerOptions> local_group_options(size_t g) const;
  // Group g as the mirror holds it: all its parameters, local_group_options(g).
  torch::optim::OptimizerParamGroup mirror_group(size_t g) const;
  // The options a new mirror group starts from (the base class's defaults()).
  std::unique_ptr<torch::optim::OptimizerOptions> default_options() const;
  // Replaces the mirror's options of group g with those the local optimizer runs.
  void refresh_mirror_options(size_t g);
  // The mirror's options of group g as a bag (with a LibTorch local optimizer, its "lr").
  optim::OptionBag wanted_options(size_t g) const;
  // The options the local optimizer runs for group g (as wanted_options words them).
  optim::OptionBag current_options(size_t g) const;
  // Throws what applying `changes` to group g would throw, changing nothing.
  void check_group_change(size_t g, const optim::OptionBag& changes) const;
  // Collective: checks every group's wanted options on this rank, makes sure every rank holds
  // the same (agree_on_state_dict over their SHA-256), then applies the changes locally. On a
  // refusal or a mismatch every rank throws the same c10::ValueError, `caller` first, and
  // nothing changes. `call` is what every rank must call (for the error of a missing rank).
  void apply_group_options(const std::string& caller, const std::string& call);

  int my_rank() const { return group.rank(); }

  // Everything but the local optimizer: checks, parameters, partition. Returns this rank's
  // share of `groups`, group by group (empty groups where it owns nothing).
  std::vector<optim::ParamGroup> init(std::vector<optim::ParamGroup> groups,
                                      const ZeroRedundancyOptimizerOptions& options) {
    group = options.process_group().value_or(comm::world());
    TORCH_CHECK_VALUE(group.is_member(), zero_detail::kName,
                      ": this rank is not a member of the process group it was given");
    TORCH_CHECK_VALUE(!groups.empty(), zero_detail::kName, ": no parameter groups given");
    zero_detail::check_params(groups, {}, group.global_rank(group.rank()), zero_detail::kName);
    overlap_with_ddp = options.overlap_with_ddp();
    stage = options.stage();
    TORCH_CHECK_VALUE(stage == 1 || stage == 2, zero_detail::kName, ": stage = ", stage,
                      "; must be 1 (optimizer state sharded) or 2 (gradients too)");
    TORCH_CHECK_VALUE(stage == 1 || !overlap_with_ddp, zero_detail::kName,
                      ": stage = 2 cannot be combined with overlap_with_ddp = true: stage 2 "
                      "averages the gradients itself, without a DistributedDataParallel, while "
                      "overlap_with_ddp runs the update in a DistributedDataParallel's comm hook");
    // With overlap, parameters travel in DDP's buckets: no views of our own.
    bucket_view = options.parameters_as_bucket_view() && !overlap_with_ddp;
    for (const auto& g : groups) {
      std::vector<int64_t> indices;
      for (const auto& p : g.params) {
        indices.push_back(static_cast<int64_t>(params.size()));
        params.push_back(p);
      }
      group_indices.push_back(std::move(indices));
    }
    TORCH_CHECK_VALUE(!params.empty(), zero_detail::kName, ": got an empty parameter list");
    check_same_parameters_across_ranks(group, params, zero_detail::kName);
    if (options.share_host_memory()) group = comm::share_host_memory(group);
    owner = zero_detail::sorted_greedy_owners(params, group_indices, group.size());
    partition = partition_of(owner);
    std::vector<optim::ParamGroup> local_groups;
    for (size_t g = 0; g < groups.size(); ++g) {
      local_groups.emplace_back(owned_in_group(g, my_rank()), groups[g].overrides);
    }
    if (stage == 2 && options.large_block_cache()) zero_detail::install_large_block_cache_once();
    return local_groups;
  }

  // A user's factory must build the local optimizer over exactly the parameters it was given.
  void check_local_params(size_t count, bool built) const {
    TORCH_CHECK_VALUE(built, zero_detail::kName,
                      ": the local optimizer factory returned null (rank ",
                      group.global_rank(my_rank()), ")");
    TORCH_CHECK_VALUE(count == partition[my_rank()].size(), zero_detail::kName,
                      ": the local optimizer factory built an optimizer over ", count,
                      " parameters; it must hold the ", partition[my_rank()].size(),
                      " it was given (rank ", group.global_rank(my_rank()), ")");
  }

  // One gradient per parameter: this rank's from `.grad`, the others undefined.
  std::vector<at::Tensor> shard_gradients_from_grad() const {
    std::vector<at::Tensor> gradients(params.size());
    for (int64_t i : partition[my_rank()]) gradients[i] = params[i].grad();
    return gradients;
  }

  // Updates this rank's parameters from `gradients` (one per parameter; only this rank's are
  // read), then every rank's are broadcast from their owners.
  void step_and_sync(const std::vector<at::Tensor>& gradients) {
    apply_group_options(std::string(zero_detail::kName) + ".step", "step()");
    std::vector<at::Tensor> local_gradients;
    for (int64_t i : partition[my_rank()]) local_gradients.push_back(gradients[i]);
    local_step(local_gradients);
    sync_params();
  }

  // Steps the local optimizer with one gradient per parameter of partition[my_rank()]
  // (undefined: skip).
  void local_step(const std::vector<at::Tensor>& gradients) { local->step(gradients); }

  // The LibTorch optimizer behind the local one, or null when the local optimizer is ours.
  optim::LibTorchOptimizerAdapter* libtorch_adapter() const {
    return dynamic_cast<optim::LibTorchOptimizerAdapter*>(local.get());
  }

  // State dicts are ours: LibTorch's optimizers key their state by tensor address, which does
  // not carry across ranks.
  void require_functional_local(const char* method) const {
    TORCH_CHECK_VALUE(libtorch_adapter() == nullptr, zero_detail::kName, ".", method,
                      ": needs a distoptim optimizer (by registry name or factory) as the local "
                      "optimizer; this one runs a LibTorch torch::optim::Optimizer, whose state "
                      "is keyed by tensor address and cannot be gathered or resharded");
  }

  // The index in params() of each parameter, by identity (for the DDP hook's buckets).
  std::unordered_map<const c10::TensorImpl*, int64_t> index_of_param() const {
    std::unordered_map<const c10::TensorImpl*, int64_t> index;
    for (size_t i = 0; i < params.size(); ++i) index[params[i].unsafeGetTensorImpl()] = i;
    return index;
  }

  std::vector<std::vector<int64_t>> partition_of(const std::vector<int>& owners) const {
    std::vector<std::vector<int64_t>> out(group.size());
    for (const auto& indices : group_indices) {
      for (int64_t i : indices) out[owners[i]].push_back(i);
    }
    return out;
  }

  // Rank r's parameters of group g: the ParamGroup its local optimizer holds.
  std::vector<at::Tensor> owned_in_group(size_t g, int r) const {
    std::vector<at::Tensor> out;
    for (int64_t i : group_indices[g]) {
      if (owner[i] == r) out.push_back(params[i]);
    }
    return out;
  }

  void build_buckets() {
    buckets.assign(group.size(), {});
    if (!bucket_view) return;
    at::NoGradGuard no_grad;
    for (int r = 0; r < group.size(); ++r) {
      std::map<at::ScalarType, std::vector<int64_t>> by_dtype;
      for (int64_t i : partition[r]) by_dtype[params[i].scalar_type()].push_back(i);
      for (const auto& [dtype, indices] : by_dtype) {
        int64_t total = 0;
        for (int64_t i : indices) total += params[i].numel();
        if (total == 0) continue;
        at::Tensor bucket = at::empty({total}, params[indices[0]].options());
        int64_t offset = 0;
        for (int64_t i : indices) {
          at::Tensor& p = params[i];
          const int64_t n = p.numel();
          if (n == 0) continue;
          at::Tensor slot = bucket.narrow(0, offset, n);
          slot.copy_(p.detach().reshape({-1}));
          p.set_data(slot.view(p.sizes()));
          offset += n;
        }
        buckets[r].push_back(bucket);
      }
    }
  }

  // With stage 2, hooks every parameter's gradient (again, after the partition changed).
  void build_owner_reduction() {
    owner_reduction.reset();
    if (stage == 2) {
      owner_reduction = std::make_unique<zero_detail::OwnerReduction>(group, params, owner);
    }
  }

  // Stage 2: after a backward pass this rank holds no gradient of another rank's parameter; one
  // there was written after the reduction (a DistributedDataParallel's, or the user's). Checked
  // before anything changes.
  void check_sharded_gradients() {
    if (owner_reduction == nullptr || !owner_reduction->take_reduced()) return;
    for (size_t i = 0; i < params.size(); ++i) {
      TORCH_CHECK_VALUE(owner[i] == my_rank() || !params[i].grad().defined(), zero_detail::kName,
                        ".step (stage 2): parameter ", i, ", owned by rank ",
                        group.global_rank(owner[i]), ", has a gradient on rank ",
                        group.global_rank(my_rank()),
                        " after backward; stage 2 averages the gradients onto their owners "
                        "itself, so train the plain module, not a DistributedDataParallel, and "
                        "set no .grad between backward and step");
    }
  }

  // Every rank sends the parameters it updated to all others.
  void sync_params() {
    const auto& pg = group.process_group();
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int r = 0; r < group.size(); ++r) {
      c10d::BroadcastOptions options;
      options.rootRank = r;
      options.timeout = group.timeout();
      std::vector<at::Tensor> sources;
      if (bucket_view) {
        sources = buckets[r];
      } else {
        for (int64_t i : partition[r]) {
          if (params[i].numel() > 0) sources.push_back(params[i].detach());
        }
      }
      for (auto& t : sources) {
        std::vector<at::Tensor> one = {t};
        works.push_back(pg->broadcast(one, options));
      }
    }
    try {
      for (auto& w : works) w->wait(group.timeout());
    } catch (const std::exception& e) {
      DISTOPTIM_RETHROW_WITH_CONTEXT(
          e, zero_detail::kName, ".step: synchronizing the parameters across the ", group.size(),
          " ranks of the group failed on rank ", group.global_rank(my_rank()),
          " (every rank must call step(); a rank that does not, or died, makes the others fail "
          "after the group's timeout of ",
          group.timeout().count(), " ms): ");
    }
  }

  // Checks a global state dict against this optimizer, as every rank must (so a bad dict fails
  // on all ranks alike), and returns this rank's part in the local optimizer's indices, checked
  // by it too. Changes nothing.
  optim::OptimizerStateDict local_part(const optim::OptimizerStateDict& dict) const {
    const std::string caller = std::string(zero_detail::kName) + ".load_state_dict";
    TORCH_CHECK_VALUE(dict.optimizer == local->name(), caller, ": the state dict is of optimizer '",
                      dict.optimizer, "', this one runs '", local->name(), "'");
    TORCH_CHECK_VALUE(dict.param_groups.size() == group_indices.size(), caller,
                      ": the state dict has ", dict.param_groups.size(),
                      " param groups, the optimizer ", group_indices.size());
    for (size_t g = 0; g < group_indices.size(); ++g) {
      TORCH_CHECK_VALUE(dict.param_groups[g].param_indices == group_indices[g], caller,
                        ": param group ", g, " holds other parameters (",
                        dict.param_groups[g].param_indices.size(), " in the state dict, ",
                        group_indices[g].size(), " here)");
    }
    const auto& names = local->state_names();
    for (const auto& [index, state] : dict.state) {
      TORCH_CHECK_INDEX(index >= 0 && index < static_cast<int64_t>(params.size()), caller,
                        ": state for parameter ", index, " but the optimizer has ", params.size());
      for (const auto& [name, tensor] : state.buffers) {
        TORCH_CHECK_VALUE(std::find(names.begin(), names.end(), name) != names.end(), caller,
                          ": unknown state '", name, "' for parameter ", index);
        TORCH_CHECK_VALUE(tensor.defined() && tensor.sizes() == params[index].sizes(), caller,
                          ": state '", name, "' of parameter ", index, " has shape ",
                          tensor.defined() ? tensor.sizes() : at::IntArrayRef{}, ", the parameter ",
                          params[index].sizes());
      }
    }
    optim::OptimizerStateDict local_dict;
    local_dict.optimizer = dict.optimizer;
    local_dict.defaults = dict.defaults;
    std::vector<int64_t> local_index_of(params.size(), -1);
    int64_t next = 0;
    for (size_t g = 0; g < group_indices.size(); ++g) {
      optim::OptimizerStateDict::Group local_group{{}, dict.param_groups[g].overrides};
      for (int64_t i : group_indices[g]) {
        if (owner[i] != my_rank()) continue;
        local_index_of[i] = next;
        local_group.param_indices.push_back(next++);
      }
      local_dict.param_groups.push_back(std::move(local_group));
    }
    for (const auto& [index, state] : dict.state) {
      if (local_index_of[index] >= 0) local_dict.state[local_index_of[index]] = state;
    }
    local->check_state_dict(local_dict);
    return local_dict;
  }

  // The collective load: this rank checks `dict` (null when it could not get one, `error`
  // saying why) and hashes it, the ranks agree, and only then does any rank load its part.
  void load_agreed(const optim::OptimizerStateDict* dict, std::string error) {
    require_functional_local("load_state_dict");
    const std::string caller = std::string(zero_detail::kName) + ".load_state_dict";
    StateDictCheck check;
    optim::OptimizerStateDict local_dict;
    if (dict != nullptr) {
      try {
        local_dict = local_part(*dict);
        check.digest = state_dict_digest(*dict);
      } catch (const std::exception& e) {
        error = error_text(e);
        // The other ranks' message starts with the caller already.
        if (error.rfind(caller + ": ", 0) == 0) error.erase(0, caller.size() + 2);
      }
    }
    check.error = std::move(error);
    agree_on_state_dict(group, check, caller);
    // Checked on every rank: only running out of memory can fail now.
    local->load_state_dict(local_dict);
    for (size_t g = 0; g < group_indices.size(); ++g) refresh_mirror_options(g);
  }

  // Rank r's local state dict in global indices, merged into `global`.
  void merge_local(const optim::OptimizerStateDict& local_dict, int r,
                   optim::OptimizerStateDict& global) const {
    const std::vector<int64_t>& order = partition[r];
    for (const auto& [local_index, state] : local_dict.state) {
      TORCH_CHECK_VALUE(local_index >= 0 && local_index < static_cast<int64_t>(order.size()),
                        zero_detail::kName, ".consolidate_state_dict: rank ", group.global_rank(r),
                        " sent state for its parameter ", local_index, " but owns ", order.size());
      global.state[order[local_index]] = state;
    }
  }
};

}  // namespace data_parallel
}  // namespace distoptim
