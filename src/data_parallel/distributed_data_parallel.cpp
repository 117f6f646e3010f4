#include <distoptim/data_parallel/distributed_data_parallel.h>

#include <algorithm>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/full.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/default_comm_hooks.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <distoptim/comm/errors.h>

#include "parameter_check.h"

namespace distoptim {
namespace data_parallel {

namespace {

// PyTorch's DDP: the first bucket is small so the first allreduce starts early in backward
// (dist._DEFAULT_FIRST_BUCKET_BYTES), and module states are broadcast in 250 MiB pieces.
constexpr int64_t kFirstBucketBytes = int64_t{1} << 20;
constexpr size_t kBroadcastBucketBytes = size_t{250} << 20;

}  // namespace

struct GradientSync::Impl {
  DistributedDataParallelOptions options;
  comm::Group group;
  std::vector<at::Tensor> parameters;
  std::vector<at::Tensor> buffers;
  std::unique_ptr<c10d::Reducer> reducer;
  // torch's require_backward_grad_sync (false inside no_sync) and require_forward_param_sync
  // (buffers are broadcast before a forward only after a synchronized one).
  bool sync_gradients = true;
  bool sync_buffers_next = true;

  void broadcast_buffers(int root = 0) {
    if (!buffers.empty()) {
      c10d::broadcast_coalesced(group.process_group(), buffers, kBroadcastBucketBytes, root);
    }
  }

  // The highest group rank for which `candidate` holds on any rank (PyTorch's
  // _find_common_rank): under Join, where rank 0 may have stopped training.
  int common_rank(bool candidate) const {
    std::vector<at::Tensor> rank = {
        at::full({1}, candidate ? static_cast<float>(group.rank()) : -1.0f)};
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::MAX;
    options.timeout = group.timeout();
    group.process_group()->allreduce(rank, options)->wait(group.timeout());
    const int chosen = static_cast<int>(rank[0].item<float>());
    TORCH_CHECK(chosen >= 0, "DistributedDataParallel (Join): no rank qualifies as the source");
    return chosen;
  }

  // Tells joined ranks whether this iteration synchronizes gradients (not waited for).
  c10::intrusive_ptr<c10d::Work> announce_gradient_sync(bool sync) const {
    std::vector<at::Tensor> flag = {at::full({1}, sync ? 1.0f : 0.0f)};
    c10d::AllreduceOptions options;
    options.timeout = group.timeout();
    return group.process_group()->allreduce(flag, options);
  }
};

GradientSync::GradientSync(const torch::nn::Module& module, DistributedDataParallelOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.group = options.process_group().value_or(comm::world());
  TORCH_CHECK_VALUE(s.group.is_member(),
                    "DistributedDataParallel: this rank is not a member of "
                    "the process group it was given");
  TORCH_CHECK_VALUE(options.bucket_cap_mb() > 0,
                    "DistributedDataParallel: bucket_cap_mb = ", options.bucket_cap_mb(),
                    "; must be positive");
  for (const auto& p : module.parameters()) {
    if (p.requires_grad()) s.parameters.push_back(p);
  }
  TORCH_CHECK_VALUE(!s.parameters.empty(),
                    "DistributedDataParallel: the module has no parameter "
                    "that requires a gradient");
  for (size_t i = 0; i < s.parameters.size(); ++i) {
    const at::Tensor& p = s.parameters[i];
    TORCH_CHECK_VALUE(p.device().is_cpu() && p.layout() == at::kStrided,
                      "DistributedDataParallel: parameter ", i, " is on ", p.device(),
                      " with layout ", p.layout(), "; only dense CPU parameters are supported");
  }
  s.buffers = module.buffers();
  s.options = std::move(options);
  const auto& pg = s.group.process_group();

  // Every rank must hold the same model: checked on every rank (naming the rank that differs)
  // before any collective depends on it, then rank 0's values are given to all.
  check_same_parameters_across_ranks(s.group, s.parameters, "DistributedDataParallel");
  {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> states = s.parameters;
    states.insert(states.end(), s.buffers.begin(), s.buffers.end());
    c10d::broadcast_coalesced(pg, states, kBroadcastBucketBytes, 0);
  }

  const auto bucket_bytes = static_cast<int64_t>(s.options.bucket_cap_mb() * 1024 * 1024);
  std::vector<std::vector<size_t>> bucket_indices;
  std::vector<size_t> bucket_limits;
  std::tie(bucket_indices, bucket_limits) = c10d::compute_bucket_assignment_by_size(
      s.parameters,
      {static_cast<size_t>(std::min(kFirstBucketBytes, bucket_bytes)),
       static_cast<size_t>(bucket_bytes)},
      std::vector<bool>(s.parameters.size(), false));
  // Gradients become ready roughly in reverse order of the parameters: reversed buckets make the
  // first ones ready first (as PyTorch does).
  std::reverse(bucket_indices.begin(), bucket_indices.end());
  std::reverse(bucket_limits.begin(), bucket_limits.end());
  s.reducer = std::make_unique<c10d::Reducer>(
      s.parameters, std::move(bucket_indices), std::move(bucket_limits), pg,
      std::vector<bool>(s.parameters.size(), false), bucket_bytes,
      s.options.find_unused_parameters(), s.options.gradient_as_bucket_view(),
      std::unordered_map<size_t, std::string>{}, std::min(kFirstBucketBytes, bucket_bytes));
}

GradientSync::~GradientSync() {
  // c10d::Reducer's destructor may throw (noexcept(false)); ours never does.
  try {
    impl_->reducer.reset();
  } catch (const std::exception&) {
  }
}

void GradientSync::before_forward() {
  Impl& s = *impl_;
  const bool grad_enabled = at::GradMode::is_enabled();
  if (grad_enabled && s.sync_gradients) s.reducer->prepare_for_forward();
  // Under a Join: count this rank as training; the count is the divisor if asked. Its failure
  // says what it means itself.
  if (auto work = Join::notify_join_context(*this)) {
    s.reducer->set_forward_pass_work_handle(
        work, join_config().hook_options.divide_by_initial_world_size());
  }
  try {
    // After the first synchronized backward, buckets are rebuilt in the order gradients
    // actually became ready (rank 0's order, so all ranks agree).
    if (grad_enabled) s.reducer->rebuild_buckets();
    if (s.sync_buffers_next && s.options.broadcast_buffers()) {
      s.broadcast_buffers(join_config().enable ? s.common_rank(true) : 0);
    }
    if (join_config().enable) s.announce_gradient_sync(grad_enabled && s.sync_gradients);
  } catch (const std::exception& e) {
    // Bad input passes as it is; a collective's error names the ranks at fault: say what it
    // means here.
    if (dynamic_cast<const c10::Error*>(&e) != nullptr &&
        dynamic_cast<const DistributedError*>(&e) == nullptr) {
      throw;
    }
    DISTOPTIM_RETHROW_WITH_CONTEXT(
        e,
        "DistributedDataParallel.forward: synchronizing with the other ranks of the group "
        "failed on rank ",
        s.group.global_rank(s.group.rank()),
        " (every rank must run forward and backward equally often, within the group's timeout "
        "of ",
        s.group.timeout().count(), " ms; for uneven inputs use Join): ");
  }
}

// A joined rank's part in DistributedDataParallel's iterations (see GradientSync::join_hook).
class GradientSync::ReplicaJoinHook : public JoinHook {
 public:
  explicit ReplicaJoinHook(Impl& state) : s_(state) {}

  void main_hook() override {
    s_.reducer->rebuild_buckets();
    if (s_.sync_buffers_next && s_.options.broadcast_buffers()) {
      s_.broadcast_buffers(s_.common_rank(false));
    }
    // Does any rank synchronize gradients this iteration (or are all inside no_sync)?
    auto flag = s_.announce_gradient_sync(false);
    flag->wait(s_.group.timeout());
    const bool sync = flag->result().front().item<float>() > 0;
    s_.sync_buffers_next = sync;
    if (!sync) return;
    // One reduction per bucket, as the training ranks' backward makes, with zeros from here.
    std::vector<c10d::GradBucket> buckets = s_.reducer->get_grad_buckets(true);
    std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
    for (auto& bucket : buckets) futures.push_back(s_.reducer->run_comm_hook(bucket));
    at::NoGradGuard no_grad;
    for (size_t b = 0; b < buckets.size(); ++b) {
      futures[b]->wait();
      if (futures[b]->hasError()) {
        try {
          std::rethrow_exception(futures[b]->exception_ptr());
        } catch (const std::exception& e) {
          DISTOPTIM_RETHROW_WITH_CONTEXT(e, "DistributedDataParallel (Join): reducing bucket ", b,
                                         " failed: ");
        }
      }
      const c10::IValue& value = futures[b]->value();
      const at::Tensor reduced = value.isTensor() ? value.toTensor() : value.toTensorVector()[0];
      // The training ranks' averaged gradients, into this rank's .grad.
      const std::vector<at::Tensor> views = buckets[b].getGradients();
      const std::vector<at::Tensor> params = buckets[b].getParameters();
      const int64_t base = buckets[b].getBufferRef().storage_offset();
      for (size_t k = 0; k < params.size(); ++k) {
        at::Tensor p = params[k];
        p.mutable_grad() =
            reduced.narrow(0, views[k].storage_offset() - base, p.numel()).view(p.sizes()).clone();
      }
    }
    s_.reducer->push_rebuilt_params_for_all_indices();
  }

  void post_hook(bool is_last_joiner) override {
    // Ranks that joined earlier hold stale parameters: a last joiner's are everyone's.
    const int root = s_.common_rank(is_last_joiner);
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> states = s_.parameters;
    states.insert(states.end(), s_.buffers.begin(), s_.buffers.end());
    c10d::broadcast_coalesced(s_.group.process_group(), states, kBroadcastBucketBytes, root);
  }

 private:
  Impl& s_;
};

std::unique_ptr<JoinHook> GradientSync::join_hook(const JoinHookOptions&) {
  TORCH_CHECK_VALUE(!impl_->options.find_unused_parameters(),
                    "DistributedDataParallel::join_hook: find_unused_parameters = true is not "
                    "supported under Join");
  return std::make_unique<ReplicaJoinHook>(*impl_);
}

void GradientSync::after_forward(const std::vector<at::Tensor>& outputs) {
  Impl& s = *impl_;
  if (at::GradMode::is_enabled() && s.sync_gradients) {
    s.sync_buffers_next = true;
    if (s.options.find_unused_parameters()) {
      TORCH_CHECK_VALUE(!outputs.empty(),
                        "DistributedDataParallel: find_unused_parameters needs "
                        "forward to return a tensor, a vector or a tuple of tensors");
      s.reducer->prepare_for_backward(outputs);
    } else {
      s.reducer->prepare_for_backward({});
    }
  } else {
    s.sync_buffers_next = false;
  }
}

GradientSync::NoSyncGuard::NoSyncGuard(GradientSync& sync)
    : sync_(&sync), previous_(sync.impl_->sync_gradients) {
  sync.impl_->sync_gradients = false;
}

GradientSync::NoSyncGuard::NoSyncGuard(NoSyncGuard&& other) noexcept
    : sync_(other.sync_), previous_(other.previous_) {
  other.sync_ = nullptr;
}

GradientSync::NoSyncGuard::~NoSyncGuard() {
  if (sync_ != nullptr) sync_->impl_->sync_gradients = previous_;
}

void GradientSync::register_comm_hook(std::unique_ptr<c10d::CommHookInterface> hook) {
  TORCH_CHECK_VALUE(hook != nullptr, "DistributedDataParallel::register_comm_hook: hook is null");
  impl_->reducer->register_comm_hook(std::move(hook));
}

void GradientSync::register_builtin_comm_hook(BuiltinCommHook hook) {
  impl_->reducer->register_builtin_comm_hook(hook == BuiltinCommHook::kFp16Compress
                                                 ? c10d::BuiltinCommHookType::FP16_COMPRESS
                                                 : c10d::BuiltinCommHookType::ALLREDUCE);
}

const comm::Group& GradientSync::process_group() const { return impl_->group; }

const std::vector<at::Tensor>& GradientSync::parameters() const { return impl_->parameters; }

}  // namespace data_parallel
}  // namespace distoptim
