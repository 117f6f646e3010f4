#include <distoptim/data_parallel/zero_redundancy_optimizer.h>

#include <algorithm>
#include <unordered_set>

#include <ATen/ops/full.h>
#include <torch/serialize.h>

#include <distoptim/optim/torch_adapter.h>

#include "gradients.h"
#include "zero_impl.h"

namespace distoptim {
namespace data_parallel {

namespace zero_detail {

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

}  // namespace zero_detail

namespace {

using zero_detail::kName;

// Tag of the point-to-point messages of consolidate_state_dict.
constexpr int kConsolidateTag = 0x2e50;

std::vector<optim::ParamGroup> single_group(std::vector<at::Tensor> params) {
  return {optim::ParamGroup(std::move(params))};
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
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                              std::make_unique<optim::AdapterOptions>()),
      impl_(std::make_unique<Impl>()) {
  const auto local_groups = impl_->init(std::move(groups), options);
  // Also checks the options, on every rank alike (a rank owning nothing gets empty groups).
  impl_->local = optim::create_optimizer(optimizer, local_groups, defaults);
  impl_->build_buckets();
  impl_->build_owner_reduction();
  expose_param_groups();
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<optim::ParamGroup> groups,
                                                 const LocalOptimizerFactory& make_local,
                                                 ZeroRedundancyOptimizerOptions options)
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                              std::make_unique<optim::AdapterOptions>()),
      impl_(std::make_unique<Impl>()) {
  TORCH_CHECK_VALUE(make_local != nullptr, kName, ": the local optimizer factory is empty");
  auto local_groups = impl_->init(std::move(groups), options);
  impl_->local = make_local(std::move(local_groups));
  impl_->check_local_params(impl_->local != nullptr ? impl_->local->params().size() : 0,
                            impl_->local != nullptr);
  impl_->build_buckets();
  impl_->build_owner_reduction();
  expose_param_groups();
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<at::Tensor> params,
                                                 const LibTorchOptimizerFactory& make_local,
                                                 ZeroRedundancyOptimizerOptions options)
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                              std::make_unique<optim::AdapterOptions>()),
      impl_(std::make_unique<Impl>()) {
  TORCH_CHECK_VALUE(make_local != nullptr, kName, ": the local optimizer factory is empty");
  auto local_groups = impl_->init(single_group(std::move(params)), options);
  std::unique_ptr<torch::optim::Optimizer> libtorch = make_local(local_groups[0].params);
  impl_->check_local_params(libtorch != nullptr ? libtorch->parameters().size() : 0,
                            libtorch != nullptr);
  impl_->local = std::make_unique<optim::LibTorchOptimizerAdapter>(std::move(libtorch));
  impl_->build_buckets();
  impl_->build_owner_reduction();
  expose_param_groups();
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

at::Tensor ZeroRedundancyOptimizer::step(LossClosure closure) {
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  step(impl_->overlap_with_ddp ? std::vector<at::Tensor>{} : impl_->shard_gradients_from_grad());
  return loss;
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
  s.check_sharded_gradients();
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
  TORCH_CHECK_VALUE(impl_->stage == 1, kName,
                    ".join_hook: stage = 2 is not supported under Join (a joined rank would have "
                    "to shadow the gradient reductions of backward passes it does not run); use "
                    "stage = 1 with a DistributedDataParallel");
  return std::make_unique<ShardJoinHook>(*impl_);
}

const comm::Group& ZeroRedundancyOptimizer::join_process_group() const { return impl_->group; }

void ZeroRedundancyOptimizer::zero_grad(bool set_to_none) {
  for (const auto& p : impl_->params) clear_gradient(p, set_to_none);
}

void ZeroRedundancyOptimizer::add_param_group(const optim::ParamGroup& group) {
  Impl& s = *impl_;
  TORCH_CHECK_VALUE(s.libtorch_adapter() == nullptr || group.overrides.empty(), kName,
                    ".add_param_group: the group overrides options (", group.overrides.to_string(),
                    "), which a LibTorch local optimizer cannot "
                    "take from an OptionBag; its groups take the optimizer's defaults");
  zero_detail::check_params({group}, s.params, s.group.global_rank(s.my_rank()),
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
  const std::vector<int> owner =
      zero_detail::sorted_greedy_owners(params, group_indices, s.group.size());
  std::vector<at::Tensor> mine;
  for (int64_t i : indices) {
    if (owner[i] == s.my_rank()) mine.push_back(params[i]);
  }
  s.local->add_param_group(optim::ParamGroup(mine, group.overrides));  // checks the options
  s.params = std::move(params);
  s.group_indices = std::move(group_indices);
  s.owner = owner;
  s.partition = s.partition_of(s.owner);
  s.build_buckets();
  s.build_owner_reduction();
  param_groups_.push_back(s.mirror_group(s.group_indices.size() - 1));
}

void ZeroRedundancyOptimizer::consolidate_state_dict(int to) {
  Impl& s = *impl_;
  s.require_functional_local("consolidate_state_dict");
  TORCH_CHECK_VALUE(to >= 0 && to < s.group.size(), kName, ".consolidate_state_dict: to = ", to,
                    " is not a rank of the group (size ", s.group.size(), ")");
  // The dict carries the options the next step would use.
  s.apply_group_options(std::string(kName) + ".consolidate_state_dict", "consolidate_state_dict()");
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

void ZeroRedundancyOptimizer::save(torch::serialize::OutputArchive& archive) const {
  // The entry the optimizer adapters write, so one reader serves both.
  archive.write(optim::FunctionalOptimizerAdapter::kArchiveKey, state_dict().to_ivalue());
}

void ZeroRedundancyOptimizer::load(torch::serialize::InputArchive& archive) {
  impl_->require_functional_local("load");
  optim::OptimizerStateDict dict;
  std::string error;
  try {
    c10::IValue value;
    TORCH_CHECK_VALUE(archive.try_read(optim::FunctionalOptimizerAdapter::kArchiveKey, value),
                      "the archive has no '", optim::FunctionalOptimizerAdapter::kArchiveKey,
                      "' entry (it was not written by torch::save of a ZeroRedundancyOptimizer "
                      "or a distoptim optimizer adapter)");
    dict = optim::OptimizerStateDict::from_ivalue(value);
  } catch (const std::exception& e) {
    error = error_text(e);
  }
  impl_->load_agreed(error.empty() ? &dict : nullptr, error);
}

const std::vector<at::Tensor>& ZeroRedundancyOptimizer::params() const { return impl_->params; }

const std::vector<std::vector<int64_t>>& ZeroRedundancyOptimizer::partition() const {
  return impl_->partition;
}

const optim::FunctionalOptimizer& ZeroRedundancyOptimizer::local_optimizer() const {
  return *impl_->local;
}

torch::optim::Optimizer* ZeroRedundancyOptimizer::libtorch_local_optimizer() const {
  optim::LibTorchOptimizerAdapter* adapter = impl_->libtorch_adapter();
  return adapter != nullptr ? &adapter->optimizer() : nullptr;
}

const comm::Group& ZeroRedundancyOptimizer::process_group() const { return impl_->group; }

}  // namespace data_parallel
}  // namespace distoptim
