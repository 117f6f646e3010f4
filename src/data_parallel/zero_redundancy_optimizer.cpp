#include <distoptim/data_parallel/zero_redundancy_optimizer.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <unordered_map>
#include <unordered_set>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize.h>

#include <distoptim/comm/errors.h>
#include <distoptim/data_parallel/comm_hooks.h>
#include <distoptim/optim/registry.h>

#include "parameter_check.h"
#include "state_dict_agreement.h"

namespace distoptim {
namespace data_parallel {

namespace {

constexpr const char* kName = "ZeroRedundancyOptimizer";
// Tag of the point-to-point messages of consolidate_state_dict.
constexpr int kConsolidateTag = 0x2e50;

std::vector<optim::ParamGroup> single_group(std::vector<at::Tensor> params) {
  return {optim::ParamGroup(std::move(params))};
}

// Checks the parameters of `groups` (and that none is in `existing`) before anything is built.
void check_params(const std::vector<optim::ParamGroup>& groups,
                  const std::vector<at::Tensor>& existing, int global_rank,
                  const std::string& caller) {
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : existing) seen.insert(p.unsafeGetTensorImpl());
  int64_t index = static_cast<int64_t>(existing.size());
  for (const auto& group : groups) {
    for (const auto& p : group.params) {
      TORCH_CHECK_VALUE(p.defined(), caller, ": parameter ", index, " is undefined (rank ",
                        global_rank, ")");
      TORCH_CHECK_VALUE(p.layout() == at::kStrided, caller, ": parameter ", index,
                        " is sparse (layout ", p.layout(),
                        "); only dense parameters are "
                        "supported (rank ",
                        global_rank, ")");
      TORCH_CHECK_VALUE(p.device().is_cpu(), caller, ": parameter ", index, " is on ", p.device(),
                        "; only CPU parameters are supported (rank ", global_rank, ")");
      TORCH_CHECK_VALUE(at::isFloatingType(p.scalar_type()), caller, ": parameter ", index,
                        " has dtype ", p.scalar_type(),
                        "; parameters must be floating point "
                        "(rank ",
                        global_rank, ")");
      TORCH_CHECK_VALUE(seen.insert(p.unsafeGetTensorImpl()).second, caller, ": parameter ", index,
                        " appears more than once (rank ", global_rank, ")");
      ++index;
    }
  }
}

// Waits for a point-to-point message, turning Gloo's failure into one that names the peer.
void wait_for(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout,
              const std::string& what) {
  try {
    work->wait(timeout);
  } catch (const std::exception& e) {
    DISTOPTIM_RETHROW_WITH_CONTEXT(e, what, " failed: ");
  }
}

}  // namespace

std::vector<std::vector<int64_t>> zero_partition(
    const std::vector<std::vector<int64_t>>& group_numels, int world_size) {
  TORCH_CHECK_VALUE(world_size >= 1, "zero_partition: world_size = ", world_size,
                    " must be at least 1");
  std::vector<int64_t> sizes(world_size, 0);
  std::vector<std::vector<int64_t>> partition(world_size);
  int64_t first = 0;
  for (const auto& numels : group_numels) {
    std::vector<int64_t> order(numels.size());
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return numels[a] > numels[b]; });
    std::vector<int> owner(numels.size());
    for (int64_t i : order) {
      TORCH_CHECK_VALUE(numels[i] >= 0, "zero_partition: parameter ", first + i, " has numel ",
                        numels[i]);
      const int rank =
          static_cast<int>(std::min_element(sizes.begin(), sizes.end()) - sizes.begin());
      owner[i] = rank;
      sizes[rank] += numels[i];
    }
    for (size_t i = 0; i < numels.size(); ++i) partition[owner[i]].push_back(first + i);
    first += static_cast<int64_t>(numels.size());
  }
  return partition;
}

namespace {

// The rank owning each parameter (see zero_partition).
std::vector<int> sorted_greedy_owners(const std::vector<at::Tensor>& params,
                                      const std::vector<std::vector<int64_t>>& group_indices,
                                      int world_size) {
  // Groups hold consecutive indices of params, in order.
  std::vector<std::vector<int64_t>> group_numels;
  for (const auto& indices : group_indices) {
    std::vector<int64_t> numels;
    for (int64_t i : indices) numels.push_back(params[i].numel());
    group_numels.push_back(std::move(numels));
  }
  std::vector<int> owner(params.size(), -1);
  const auto partition = zero_partition(group_numels, world_size);
  for (int r = 0; r < world_size; ++r) {
    for (int64_t i : partition[r]) owner[i] = r;
  }
  return owner;
}

}  // namespace

struct ZeroRedundancyOptimizer::Impl {
  comm::Group group;
  bool bucket_view = false;
  std::vector<at::Tensor> params;
  std::vector<std::vector<int64_t>> group_indices;
  std::vector<int> owner;
  // partition[r]: the parameters rank r updates, in params() order; its local optimizer holds
  // them group by group in that order.
  std::vector<std::vector<int64_t>> partition;
  // The local optimizer over this rank's parameters: ours, or else LibTorch's.
  std::unique_ptr<optim::FunctionalOptimizer> local;
  std::unique_ptr<torch::optim::Optimizer> torch_local;
  // With parameters_as_bucket_view: buckets[r] holds rank r's parameters, one flat tensor per
  // dtype.
  std::vector<std::vector<at::Tensor>> buckets;
  std::optional<optim::OptimizerStateDict> consolidated;
  bool overlap_with_ddp = false;

  int my_rank() const { return group.rank(); }

  // Everything but the local optimizer: checks, parameters, partition. Returns this rank's
  // share of `groups`, group by group (empty groups where it owns nothing).
  std::vector<optim::ParamGroup> init(std::vector<optim::ParamGroup> groups,
                                      const ZeroRedundancyOptimizerOptions& options) {
    group = options.process_group().value_or(comm::world());
    TORCH_CHECK_VALUE(group.is_member(), kName,
                      ": this rank is not a member of the process group it was given");
    TORCH_CHECK_VALUE(!groups.empty(), kName, ": no parameter groups given");
    check_params(groups, {}, group.global_rank(group.rank()), kName);
    overlap_with_ddp = options.overlap_with_ddp();
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
    TORCH_CHECK_VALUE(!params.empty(), kName, ": got an empty parameter list");
    check_same_parameters_across_ranks(group, params, kName);
    owner = sorted_greedy_owners(params, group_indices, group.size());
    partition = partition_of(owner);
    std::vector<optim::ParamGroup> local_groups;
    for (size_t g = 0; g < groups.size(); ++g) {
      local_groups.emplace_back(owned_in_group(g, my_rank()), groups[g].overrides);
    }
    return local_groups;
  }

  // A user's factory must build the local optimizer over exactly the parameters it was given.
  void check_local_params(size_t count, bool built) const {
    TORCH_CHECK_VALUE(built, kName, ": the local optimizer factory returned null (rank ",
                      group.global_rank(my_rank()), ")");
    TORCH_CHECK_VALUE(count == partition[my_rank()].size(), kName,
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
    std::vector<at::Tensor> local_gradients;
    for (int64_t i : partition[my_rank()]) local_gradients.push_back(gradients[i]);
    local_step(local_gradients);
    sync_params();
  }

  // Steps the local optimizer with one gradient per parameter of partition[my_rank()]
  // (undefined: skip).
  void local_step(const std::vector<at::Tensor>& gradients) {
    if (local != nullptr) {
      local->step(gradients);
      return;
    }
    // LibTorch's optimizers read `.grad`: lend them the gradients for the step, checked first
    // as ours would check them.
    const std::vector<int64_t>& mine = partition[my_rank()];
    for (size_t k = 0; k < mine.size(); ++k) {
      const at::Tensor& g = gradients[k];
      const at::Tensor& p = params[mine[k]];
      if (!g.defined()) continue;
      TORCH_CHECK_VALUE(g.layout() == at::kStrided && g.device() == p.device() &&
                            g.scalar_type() == p.scalar_type() && g.sizes() == p.sizes(),
                        kName, ".step: the gradient of parameter ", mine[k], " is a ",
                        g.scalar_type(), " tensor of shape ", g.sizes(), " on ", g.device(),
                        "; the parameter is ", p.scalar_type(), " of shape ", p.sizes(), " on ",
                        p.device(), " (rank ", group.global_rank(my_rank()), ")");
    }
    std::vector<at::Tensor> saved(mine.size());
    for (size_t k = 0; k < mine.size(); ++k) {
      at::Tensor& p = params[mine[k]];
      saved[k] = p.grad();
      p.mutable_grad() = gradients[k];
    }
    auto restore = [&] {
      for (size_t k = 0; k < mine.size(); ++k) params[mine[k]].mutable_grad() = saved[k];
    };
    try {
      torch_local->step();
    } catch (...) {
      restore();
      throw;
    }
    restore();
  }

  // State dicts are ours: LibTorch's optimizers key their state by tensor address, which does
  // not carry across ranks.
  void require_functional_local(const char* method) const {
    TORCH_CHECK_VALUE(local != nullptr, kName, ".", method,
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
          e, kName, ".step: synchronizing the parameters across the ", group.size(),
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
    const std::string caller = std::string(kName) + ".load_state_dict";
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
    const std::string caller = std::string(kName) + ".load_state_dict";
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
  }

  // Rank r's local state dict in global indices, merged into `global`.
  void merge_local(const optim::OptimizerStateDict& local_dict, int r,
                   optim::OptimizerStateDict& global) const {
    const std::vector<int64_t>& order = partition[r];
    for (const auto& [local_index, state] : local_dict.state) {
      TORCH_CHECK_VALUE(local_index >= 0 && local_index < static_cast<int64_t>(order.size()), kName,
                        ".consolidate_state_dict: rank ", group.global_rank(r),
                        " sent state for its parameter ", local_index, " but owns ", order.size());
      global.state[order[local_index]] = state;
    }
  }
};

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<at::Tensor> params,
                                                 const std::string& optimizer,
                                                 const optim::OptionBag& defaults,
                                                 ZeroRedundancyOptimizerOptions options)
    : ZeroRedundancyOptimizer(single_group(std::move(params)), optimizer, defaults,
                              std::move(options)) {}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<optim::ParamGroup> groups,
                                                 const std::string& optimizer,
                                                 const optim::OptionBag& defaults,
                                                 ZeroRedundancyOptimizerOptions options)
    : impl_(std::make_unique<Impl>()) {
  const auto local_groups = impl_->init(std::move(groups), options);
  // Also checks the options, on every rank alike (a rank owning nothing gets empty groups).
  impl_->local = optim::create_optimizer(optimizer, local_groups, defaults);
  impl_->build_buckets();
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<optim::ParamGroup> groups,
                                                 const LocalOptimizerFactory& make_local,
                                                 ZeroRedundancyOptimizerOptions options)
    : impl_(std::make_unique<Impl>()) {
  TORCH_CHECK_VALUE(make_local != nullptr, kName, ": the local optimizer factory is empty");
  auto local_groups = impl_->init(std::move(groups), options);
  impl_->local = make_local(std::move(local_groups));
  impl_->check_local_params(impl_->local != nullptr ? impl_->local->params().size() : 0,
                            impl_->local != nullptr);
  impl_->build_buckets();
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<at::Tensor> params,
                                                 const LibTorchOptimizerFactory& make_local,
                                                 ZeroRedundancyOptimizerOptions options)
    : impl_(std::make_unique<Impl>()) {
  TORCH_CHECK_VALUE(make_local != nullptr, kName, ": the local optimizer factory is empty");
  auto local_groups = impl_->init(single_group(std::move(params)), options);
  impl_->torch_local = make_local(std::move(local_groups[0].params));
  impl_->check_local_params(
      impl_->torch_local != nullptr ? impl_->torch_local->parameters().size() : 0,
      impl_->torch_local != nullptr);
  impl_->build_buckets();
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

void ZeroRedundancyOptimizer::step() {
  if (impl_->overlap_with_ddp) {
    TORCH_WARN_ONCE(kName,
                    ".step() does nothing with overlap_with_ddp: the update runs in the "
                    "DDP hook (hook_with_zero_step); leave step() out of the training loop");
    return;
  }
  step(impl_->shard_gradients_from_grad());
}

void ZeroRedundancyOptimizer::step(const std::vector<at::Tensor>& gradients) {
  Impl& s = *impl_;
  if (s.overlap_with_ddp) {
    TORCH_WARN_ONCE(kName,
                    ".step() does nothing with overlap_with_ddp: the update runs in the "
                    "DDP hook (hook_with_zero_step); leave step() out of the training loop");
    return;
  }
  TORCH_CHECK_VALUE(gradients.size() == s.params.size(), kName, ".step: got ", gradients.size(),
                    " gradients for ", s.params.size(), " parameters");
  Join::notify_join_context(*this);
  s.step_and_sync(gradients);
}

// A joined rank's part in ZeRO's iterations: it still owns its share of the parameters, so it
// updates them from `.grad` (where DDP's join hook puts the training ranks' average) and joins
// the broadcasts. With overlap_with_ddp, DDP's join hook runs hook_with_zero_step, which does
// all of it.
class ZeroRedundancyOptimizer::ShardJoinHook : public JoinHook {
 public:
  explicit ShardJoinHook(Impl& state) : s_(state) {}
  void main_hook() override {
    if (!s_.overlap_with_ddp) s_.step_and_sync(s_.shard_gradients_from_grad());
  }

 private:
  Impl& s_;
};

std::unique_ptr<JoinHook> ZeroRedundancyOptimizer::join_hook(const JoinHookOptions&) {
  return std::make_unique<ShardJoinHook>(*impl_);
}

const comm::Group& ZeroRedundancyOptimizer::join_process_group() const { return impl_->group; }

void ZeroRedundancyOptimizer::zero_grad(bool set_to_none) {
  for (auto& p : impl_->params) {
    if (!p.grad().defined()) continue;
    if (set_to_none) {
      p.mutable_grad() = at::Tensor();
    } else {
      p.mutable_grad().detach_();
      p.mutable_grad().zero_();
    }
  }
}

void ZeroRedundancyOptimizer::add_param_group(const optim::ParamGroup& group) {
  Impl& s = *impl_;
  TORCH_CHECK_VALUE(s.local != nullptr || group.overrides.empty(), kName,
                    ".add_param_group: the group overrides options (", group.overrides.to_string(),
                    "), which a LibTorch local optimizer cannot "
                    "take from an OptionBag; its groups take the optimizer's defaults");
  check_params({group}, s.params, s.group.global_rank(s.my_rank()),
               std::string(kName) + ".add_param_group");
  check_same_parameters_across_ranks(s.group, group.params,
                                     std::string(kName) + ".add_param_group");
  // The partition is built group by group, so the parameters already there keep their rank.
  std::vector<at::Tensor> params = s.params;
  std::vector<int64_t> indices;
  for (const auto& p : group.params) {
    indices.push_back(static_cast<int64_t>(params.size()));
    params.push_back(p);
  }
  auto group_indices = s.group_indices;
  group_indices.push_back(indices);
  const std::vector<int> owner = sorted_greedy_owners(params, group_indices, s.group.size());
  std::vector<at::Tensor> mine;
  for (int64_t i : indices) {
    if (owner[i] == s.my_rank()) mine.push_back(params[i]);
  }
  if (s.local != nullptr) {
    s.local->add_param_group(optim::ParamGroup(mine, group.overrides));  // checks the options
  } else {
    s.torch_local->add_param_group(torch::optim::OptimizerParamGroup(mine));
  }
  s.params = std::move(params);
  s.group_indices = std::move(group_indices);
  s.owner = owner;
  s.partition = s.partition_of(s.owner);
  s.build_buckets();
}

void ZeroRedundancyOptimizer::consolidate_state_dict(int to) {
  Impl& s = *impl_;
  s.require_functional_local("consolidate_state_dict");
  TORCH_CHECK_VALUE(to >= 0 && to < s.group.size(), kName, ".consolidate_state_dict: to = ", to,
                    " is not a rank of the group (size ", s.group.size(), ")");
  const auto& pg = s.group.process_group();
  const optim::OptimizerStateDict local_dict = s.local->state_dict();
  if (s.my_rank() != to) {
    const std::vector<char> bytes = torch::pickle_save(local_dict.to_ivalue());
    std::vector<at::Tensor> size = {at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong)};
    std::vector<at::Tensor> payload = {at::empty({static_cast<int64_t>(bytes.size())}, at::kByte)};
    std::copy(bytes.begin(), bytes.end(), static_cast<char*>(payload[0].data_ptr()));
    const std::string what =
        c10::str(kName, ".consolidate_state_dict(to=", to, "): sending this rank's shard to rank ",
                 s.group.global_rank(to));
    wait_for(pg->send(size, to, kConsolidateTag), s.group.timeout(), what);
    wait_for(pg->send(payload, to, kConsolidateTag), s.group.timeout(), what);
    return;
  }
  optim::OptimizerStateDict global;
  global.optimizer = s.local->name();
  global.defaults = s.local->defaults();
  for (size_t g = 0; g < s.group_indices.size(); ++g) {
    global.param_groups.push_back({s.group_indices[g], s.local->group_overrides(g)});
  }
  s.merge_local(local_dict, s.my_rank(), global);
  // One foreign shard at a time: received, merged, and freed before the next.
  for (int r = 0; r < s.group.size(); ++r) {
    if (r == to) continue;
    const std::string what = c10::str(kName, ".consolidate_state_dict(to=", to,
                                      "): receiving the shard of rank ", s.group.global_rank(r));
    std::vector<at::Tensor> size = {at::empty({1}, at::kLong)};
    wait_for(pg->recv(size, r, kConsolidateTag), s.group.timeout(), what);
    std::vector<at::Tensor> payload = {at::empty({size[0].item<int64_t>()}, at::kByte)};
    wait_for(pg->recv(payload, r, kConsolidateTag), s.group.timeout(), what);
    const char* data = static_cast<const char*>(payload[0].data_ptr());
    s.merge_local(optim::OptimizerStateDict::from_ivalue(
                      torch::pickle_load(std::vector<char>(data, data + payload[0].numel()))),
                  r, global);
  }
  s.consolidated = std::move(global);
}

optim::OptimizerStateDict ZeroRedundancyOptimizer::state_dict() const {
  const Impl& s = *impl_;
  TORCH_CHECK_VALUE(s.consolidated.has_value(), kName,
                    ".state_dict: the optimizer state has not "
                    "been consolidated on rank ",
                    s.group.global_rank(s.my_rank()),
                    "; call consolidate_state_dict(to=", s.my_rank(), ") on all ranks first");
  return *s.consolidated;
}

void ZeroRedundancyOptimizer::load_state_dict(const optim::OptimizerStateDict& dict) {
  impl_->load_agreed(&dict, {});
}

void ZeroRedundancyOptimizer::load_state_dict_from_file(const std::string& path) {
  impl_->require_functional_local("load_state_dict_from_file");
  optim::OptimizerStateDict dict;
  std::string error;
  try {
    dict = optim::load_state_dict_file(path);
  } catch (const std::exception& e) {
    error = c10::str("reading '", path, "' failed: ", error_text(e));
  }
  impl_->load_agreed(error.empty() ? &dict : nullptr, error);
}

const std::vector<at::Tensor>& ZeroRedundancyOptimizer::params() const { return impl_->params; }

const std::vector<std::vector<int64_t>>& ZeroRedundancyOptimizer::partition() const {
  return impl_->partition;
}

const optim::FunctionalOptimizer& ZeroRedundancyOptimizer::local_optimizer() const {
  impl_->require_functional_local("local_optimizer");
  return *impl_->local;
}

torch::optim::Optimizer* ZeroRedundancyOptimizer::libtorch_local_optimizer() const {
  return impl_->torch_local.get();
}

const comm::Group& ZeroRedundancyOptimizer::process_group() const { return impl_->group; }

// The DDP hook of overlap_with_ddp. Buckets arrive in index order on the autograd thread; each is
// reduced by the base hook at once. When the last one arrives, bucket by bucket: wait for its
// reduction, update this rank's parameters of it, and start the broadcasts of its parameters
// from their owners (one per owner: each bucket has one dtype), so the broadcasts of a bucket
// overlap the updates of the next. Backward returns once every broadcast has arrived.
class ZeroRedundancyOptimizer::StepHook : public c10d::CommHookInterface {
 public:
  StepHook(Impl& state, std::unique_ptr<c10d::CommHookInterface> base)
      : s_(state), base_(std::move(base)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    if (pending_.empty()) index_ = s_.index_of_param();
    Pending pending;
    const at::Tensor buffer = bucket.getBufferRef();
    const std::vector<at::Tensor> gradients = bucket.getGradients();
    const std::vector<at::Tensor> bucket_params = bucket.getParameters();
    for (size_t k = 0; k < bucket_params.size(); ++k) {
      const auto found = index_.find(bucket_params[k].unsafeGetTensorImpl());
      TORCH_CHECK_VALUE(found != index_.end(), kName, " (hook_with_zero_step): parameter ", k,
                        " of DDP bucket ", bucket.getIndex(), " (shape ", bucket_params[k].sizes(),
                        ") is not a parameter of this "
                        "ZeroRedundancyOptimizer; it must optimize every parameter of the DDP "
                        "(rank ",
                        s_.group.global_rank(s_.my_rank()), ")");
      pending.indices.push_back(found->second);
      // Where the parameter's gradient sits in the flat bucket.
      pending.offsets.push_back(gradients[k].storage_offset() - buffer.storage_offset());
    }
    pending.reduced = base_->runHook(bucket);
    pending_.push_back(std::move(pending));
    const auto result = pending_.back().reduced;
    if (bucket.isLast()) {
      std::vector<Pending> buckets = std::move(pending_);
      pending_.clear();
      update_and_broadcast(buckets);
    }
    return result;
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    return base_->parseHookResult(result);
  }

 private:
  struct Pending {
    std::vector<int64_t> indices;
    std::vector<int64_t> offsets;
    c10::intrusive_ptr<c10::ivalue::Future> reduced;
  };

  void update_and_broadcast(const std::vector<Pending>& buckets) {
    const int me = s_.my_rank();
    const auto& pg = s_.group.process_group();
    // partition[me] is the local optimizer's parameter order.
    std::vector<int64_t> local_index(s_.params.size(), -1);
    for (size_t k = 0; k < s_.partition[me].size(); ++k) local_index[s_.partition[me][k]] = k;
    std::vector<bool> seen(s_.params.size(), false);

    struct Receive {
      std::vector<int64_t> indices;
      at::Tensor flat;
    };
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<Receive> receives;
    at::NoGradGuard no_grad;
    for (const Pending& bucket : buckets) {
      bucket.reduced->wait();
      if (bucket.reduced->hasError()) {
        DISTOPTIM_THROW(DistributedError, kName,
                        " (hook_with_zero_step): reducing a gradient "
                        "bucket failed: ",
                        bucket.reduced->tryRetrieveErrorMessage());
      }
      const at::Tensor reduced = base_->parseHookResult(bucket.reduced->value());
      std::vector<at::Tensor> local_gradients(s_.partition[me].size());
      bool any = false;
      for (size_t k = 0; k < bucket.indices.size(); ++k) {
        const int64_t i = bucket.indices[k];
        seen[i] = true;
        if (s_.owner[i] != me) continue;
        const at::Tensor& p = s_.params[i];
        local_gradients[local_index[i]] =
            reduced.narrow(0, bucket.offsets[k], p.numel()).view(p.sizes());
        any = true;
      }
      if (any) s_.local_step(local_gradients);
      for (int r = 0; r < s_.group.size(); ++r) {
        std::vector<int64_t> owned;
        int64_t total = 0;
        for (int64_t i : bucket.indices) {
          if (s_.owner[i] != r || s_.params[i].numel() == 0) continue;
          owned.push_back(i);
          total += s_.params[i].numel();
        }
        if (owned.empty()) continue;
        at::Tensor flat;
        if (r == me) {
          std::vector<at::Tensor> pieces;
          for (int64_t i : owned) pieces.push_back(s_.params[i].detach().reshape({-1}));
          flat = at::cat(pieces);
        } else {
          flat = at::empty({total}, s_.params[owned[0]].options());
          receives.push_back({owned, flat});
        }
        c10d::BroadcastOptions options;
        options.rootRank = r;
        options.timeout = s_.group.timeout();
        std::vector<at::Tensor> one = {flat};
        works.push_back(pg->broadcast(one, options));
      }
    }
    for (size_t i = 0; i < s_.params.size(); ++i) {
      TORCH_CHECK_VALUE(seen[i], kName, " (hook_with_zero_step): parameter ", i, " (shape ",
                        s_.params[i].sizes(),
                        ") is in no DDP bucket; the DDP must hold every "
                        "parameter of the ZeroRedundancyOptimizer");
    }
    try {
      for (auto& work : works) work->wait(s_.group.timeout());
    } catch (const std::exception& e) {
      DISTOPTIM_RETHROW_WITH_CONTEXT(e, kName,
                                     " (hook_with_zero_step): broadcasting the updated "
                                     "parameters failed on rank ",
                                     s_.group.global_rank(me), ": ");
    }
    for (const Receive& receive : receives) {
      int64_t offset = 0;
      for (int64_t i : receive.indices) {
        at::Tensor& p = s_.params[i];
        p.detach().copy_(receive.flat.narrow(0, offset, p.numel()).view(p.sizes()));
        offset += p.numel();
      }
    }
  }

  Impl& s_;
  std::unique_ptr<c10d::CommHookInterface> base_;
  std::unordered_map<const c10::TensorImpl*, int64_t> index_;
  std::vector<Pending> pending_;
};

std::unique_ptr<c10d::CommHookInterface> hook_with_zero_step(
    ZeroRedundancyOptimizer& zero, std::unique_ptr<c10d::CommHookInterface> hook) {
  ZeroRedundancyOptimizer::Impl& s = *zero.impl_;
  TORCH_CHECK_VALUE(s.overlap_with_ddp,
                    "hook_with_zero_step: the ZeroRedundancyOptimizer was "
                    "built with overlap_with_ddp = false; build it with "
                    "ZeroRedundancyOptimizerOptions().overlap_with_ddp(true)");
  if (hook == nullptr) hook = allreduce_hook(s.group);
  return std::make_unique<ZeroRedundancyOptimizer::StepHook>(s, std::move(hook));
}

}  // namespace data_parallel
}  // namespace distoptim
