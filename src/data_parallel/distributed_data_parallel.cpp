#include <distoptim/data_parallel/distributed_data_parallel.h>

#include <algorithm>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/default_comm_hooks.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

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

  void broadcast_buffers() {
    if (!buffers.empty()) c10d::broadcast_coalesced(group.process_group(), buffers, kBroadcastBucketBytes, 0);
  }
};

GradientSync::GradientSync(const torch::nn::Module& module, DistributedDataParallelOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.group = options.process_group().value_or(comm::world());
  TORCH_CHECK_VALUE(s.group.is_member(), "DistributedDataParallel: this rank is not a member of "
                    "the process group it was given");
  TORCH_CHECK_VALUE(options.bucket_cap_mb() > 0, "DistributedDataParallel: bucket_cap_mb = ",
                    options.bucket_cap_mb(), "; must be positive");
  for (const auto& p : module.parameters()) {
    if (p.requires_grad()) s.parameters.push_back(p);
  }
  TORCH_CHECK_VALUE(!s.parameters.empty(), "DistributedDataParallel: the module has no parameter "
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
  if (at::GradMode::is_enabled() && s.sync_gradients) s.reducer->prepare_for_forward();
  // After the first synchronized backward, buckets are rebuilt in the order gradients actually
  // became ready (rank 0's order, so all ranks agree).
  if (at::GradMode::is_enabled()) s.reducer->rebuild_buckets();
  if (s.sync_buffers_next && s.options.broadcast_buffers()) s.broadcast_buffers();
}

void GradientSync::after_forward(const std::vector<at::Tensor>& outputs) {
  Impl& s = *impl_;
  if (at::GradMode::is_enabled() && s.sync_gradients) {
    s.sync_buffers_next = true;
    if (s.options.find_unused_parameters()) {
      TORCH_CHECK_VALUE(!outputs.empty(), "DistributedDataParallel: find_unused_parameters needs "
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
