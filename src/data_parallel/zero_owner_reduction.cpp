// ZeRO stage 2: gradients reduced to their parameters' owners during backward (see
// zero_owner_reduction.h).
#include "zero_owner_reduction.h"

#include <algorithm>
#include <functional>
#include <map>
#include <utility>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <distoptim/comm/errors.h>
#include <distoptim/data_parallel/large_block_cache.h>

#include "after_backward.h"

namespace distoptim {
namespace data_parallel {
namespace zero_detail {

namespace {

// Runs `start` before an accumulator adds anything to its parameter's gradient.
class PassStartHook : public torch::autograd::FunctionPreHook {
 public:
  explicit PassStartHook(std::function<void()> start) : start_(std::move(start)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    start_();
    return grads;
  }

 private:
  std::function<void()> start_;
};

}  // namespace

int64_t OwnerReduction::bytes_of(const Bucket& bucket) {
  return bucket.numel * static_cast<int64_t>(bucket.options.dtype().itemsize());
}

OwnerReduction::OwnerReduction(comm::Group group, const std::vector<at::Tensor>& params,
                               const std::vector<int>& owner)
    : group_(std::move(group)), params_(params), bucket_of_(params.size(), -1) {
  // Backward reaches the parameters roughly last to first: each owner's buckets are filled in
  // that order, and all buckets launch in the order of their last parameter, so the first to
  // fill goes first.
  std::map<std::pair<int, at::ScalarType>, Bucket> open;
  std::vector<Bucket> built;
  for (int64_t i = static_cast<int64_t>(params.size()) - 1; i >= 0; --i) {
    const at::Tensor& p = params[i];
    if (!p.requires_grad() || p.numel() == 0) continue;
    const auto key = std::make_pair(owner[i], p.scalar_type());
    auto found = open.find(key);
    if (found != open.end() &&
        (found->second.numel + p.numel()) * p.element_size() > kBucketBytes) {
      built.push_back(std::move(found->second));
      open.erase(found);
      found = open.end();
    }
    if (found == open.end()) {
      Bucket bucket;
      bucket.owner = owner[i];
      bucket.options = p.options().requires_grad(false);
      found = open.emplace(key, std::move(bucket)).first;
    }
    Bucket& bucket = found->second;
    bucket.indices.push_back(i);
    bucket.offsets.push_back(bucket.numel);
    bucket.numel += p.numel();
  }
  for (auto& [key, bucket] : open) built.push_back(std::move(bucket));
  std::stable_sort(built.begin(), built.end(), [](const Bucket& a, const Bucket& b) {
    return a.indices.front() > b.indices.front();
  });
  buckets_ = std::move(built);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    for (int64_t i : buckets_[b].indices) bucket_of_[i] = static_cast<int64_t>(b);
    if (buckets_[b].owner != group_.rank()) {
      spare_bytes_ = std::max(spare_bytes_, bytes_of(buckets_[b]));
    }
  }
  reset_backward();
  // The gradient accumulator lives as long as someone holds it: keep it, with our hook.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (bucket_of_[i] < 0) continue;
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    const auto index = static_cast<int64_t>(i);
    const uintptr_t key =
        accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
            [this, index](const torch::autograd::variable_list& outputs,
                          const torch::autograd::variable_list&) {
              on_gradient(index);
              return outputs;
            }));
    auto pre_hook = std::make_unique<PassStartHook>([this] { on_pass_start(); });
    pre_hooks_.push_back(pre_hook.get());
    accumulator->add_pre_hook(std::move(pre_hook));
    accumulators_.push_back(std::move(accumulator));
    hook_keys_.push_back(key);
  }
}

OwnerReduction::~OwnerReduction() {
  for (size_t k = 0; k < accumulators_.size(); ++k) {
    accumulators_[k]->del_post_hook(hook_keys_[k]);
    // Node has no del_pre_hook: take ours out of its list.
    auto& hooks = accumulators_[k]->pre_hooks();
    hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                               [&](const auto& hook) { return hook.get() == pre_hooks_[k]; }),
                hooks.end());
  }
}

void OwnerReduction::reset_backward() {
  in_backward_ = false;
  next_launch_ = 0;
  arrived_.assign(params_.size(), false);
  carried_.assign(params_.size(), at::Tensor());
  for (Bucket& bucket : buckets_) {
    bucket.missing = static_cast<int64_t>(bucket.indices.size());
    bucket.flat = at::Tensor();
    // A reduce that failed may still use its buffer: that one is not reused.
    bucket.spare = at::Tensor();
    bucket.work.reset();
  }
}

void OwnerReduction::allocate(Bucket& bucket) {
  if (bucket.owner == group_.rank()) {
    // Views of it live on as gradients (and in `carried_`) until zero_grad drops them.
    if (!bucket.kept.defined() || bucket.kept.storage().use_count() != 1) {
      bucket.kept = at::empty({bucket.numel}, bucket.options);
    }
    bucket.flat = bucket.kept;
    return;
  }
  if (spares_.empty()) {
    bucket.spare = at::empty({spare_bytes_}, bucket.options.dtype(at::kByte));
  } else {
    bucket.spare = std::move(spares_.back());
    spares_.pop_back();
  }
  bucket.flat =
      bucket.spare.narrow(0, 0, bytes_of(bucket)).view(bucket.options.dtype().toScalarType());
}

void OwnerReduction::return_spare(Bucket& bucket) {
  bucket.work.reset();
  // Moved from, `spare` is left undefined.
  if (bucket.spare.defined()) spares_.push_back(std::move(bucket.spare));
}

void OwnerReduction::on_pass_start() {
  if (in_backward_) return;
  in_backward_ = true;
  // Runs on this thread when the backward pass ends, before backward() returns, after every
  // callback queued during the pass: a DistributedDataParallel wrongly run on the same
  // parameters finalizes its gradients first, and step() finds and refuses them.
  queue_after_pass_callbacks([this] { finish_backward(); });
  // Gradients this rank holds from earlier passes (its own parameters' averages) are kept aside:
  // each rank must send this pass's gradient alone.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (bucket_of_[i] >= 0 && buckets_[bucket_of_[i]].owner == group_.rank() &&
        params_[i].grad().defined()) {
      carried_[i] = params_[i].grad();
      params_[i].mutable_grad() = at::Tensor();
    }
  }
}

void OwnerReduction::on_gradient(int64_t index) {
  try {
    take_gradient(index);
  } catch (...) {
    // A failed backward pass runs no callback: the next pass starts afresh.
    restore_carried();
    reset_backward();
    throw;
  }
}

void OwnerReduction::restore_carried() {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (carried_[i].defined()) params_[i].mutable_grad() = std::move(carried_[i]);
  }
}

void OwnerReduction::take_gradient(int64_t index) {
  at::Tensor& p = params_[index];
  const at::Tensor grad = p.grad();
  // Only a second backward through a retained graph brings the same parameter twice before the
  // end of a pass; the engine's callback closes each pass.
  if (arrived_[index] || !grad.defined()) return;
  TORCH_CHECK_VALUE(grad.layout() == at::kStrided, "ZeroRedundancyOptimizer (stage 2): parameter ",
                    index, " got a sparse gradient; stage 2 reduces dense gradients only (rank ",
                    group_.global_rank(group_.rank()), ")");
  at::NoGradGuard no_grad;
  Bucket& bucket = buckets_[bucket_of_[index]];
  // Every slot is written before the bucket goes (a gradient, or zeros in launch): no fill.
  if (!bucket.flat.defined()) allocate(bucket);
  const size_t k =
      std::find(bucket.indices.begin(), bucket.indices.end(), index) - bucket.indices.begin();
  // Divided as it is copied in (one pass over it, not two), before the sum as DDP's allreduce
  // hook divides, so that the result rounds as stage 1's.
  at::Tensor slot = bucket.flat.narrow(0, bucket.offsets[k], p.numel()).view(p.sizes());
  at::div_out(slot, grad, group_.size());
  p.mutable_grad() = at::Tensor();
  arrived_[index] = true;
  --bucket.missing;
  launch_ready_buckets();
  release_completed();
}

void OwnerReduction::launch_ready_buckets() {
  // Every rank launches in the same order, whatever order its gradients came in.
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].missing == 0) {
    launch(buckets_[next_launch_++]);
  }
}

void OwnerReduction::launch(Bucket& bucket) {
  if (!bucket.flat.defined()) {
    allocate(bucket);
    bucket.flat.zero_();
  } else if (bucket.missing > 0) {
    for (size_t k = 0; k < bucket.indices.size(); ++k) {
      if (!arrived_[bucket.indices[k]]) {
        bucket.flat.narrow(0, bucket.offsets[k], params_[bucket.indices[k]].numel()).zero_();
      }
    }
  }
  c10d::ReduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  options.rootRank = bucket.owner;
  options.timeout = group_.timeout();
  std::vector<at::Tensor> tensors = {bucket.flat};
  bucket.work = group_.process_group()->reduce(tensors, options);
  // Another owner's bucket: the reduce holds it until it completes; nothing else needs it.
  if (bucket.owner != group_.rank()) bucket.flat = at::Tensor();
}

void OwnerReduction::release_completed() {
  // A completed reduce of another owner's bucket still holds its tensor: drop it now. Failures
  // are kept for wait_for to report. Past kMaxOthersInFlight such buckets, backward waits for
  // the oldest, so that a slow network does not let them pile up to all the others' gradients.
  std::vector<Bucket*> in_flight;
  for (size_t b = 0; b < next_launch_; ++b) {
    Bucket& bucket = buckets_[b];
    if (bucket.owner == group_.rank() || !bucket.work) continue;
    if (bucket.work->isCompleted() && bucket.work->isSuccess()) {
      return_spare(bucket);
    } else {
      in_flight.push_back(&bucket);
    }
  }
  for (size_t k = 0; k + kMaxOthersInFlight < in_flight.size(); ++k) {
    wait_for(*in_flight[k]);
    return_spare(*in_flight[k]);
  }
}

void OwnerReduction::wait_for(Bucket& bucket) {
  try {
    bucket.work->wait(group_.timeout());
  } catch (const std::exception& e) {
    DISTOPTIM_RETHROW_WITH_CONTEXT(
        e, "ZeroRedundancyOptimizer (stage 2): reducing the gradients of rank ",
        group_.global_rank(bucket.owner), "'s parameters failed on rank ",
        group_.global_rank(group_.rank()),
        " (every rank must run the same backward passes; a rank that does not, or died, makes "
        "the others fail after the group's timeout of ",
        group_.timeout().count(), " ms): ");
  }
}

void OwnerReduction::finish_backward() {
  try {
    finish_reductions();
  } catch (...) {
    restore_carried();
    reset_backward();
    throw;
  }
}

void OwnerReduction::finish_reductions() {
  const int me = group_.rank();
  // Gradients that never came (parameters this pass did not use) count as zeros.
  for (; next_launch_ < buckets_.size(); ++next_launch_) launch(buckets_[next_launch_]);
  for (Bucket& bucket : buckets_) {
    if (bucket.work) wait_for(bucket);
  }
  for (Bucket& bucket : buckets_) {
    if (bucket.owner != me) return_spare(bucket);
  }
  at::NoGradGuard no_grad;
  for (Bucket& bucket : buckets_) {
    if (bucket.owner != me) continue;
    for (size_t k = 0; k < bucket.indices.size(); ++k) {
      const int64_t i = bucket.indices[k];
      at::Tensor& p = params_[i];
      p.mutable_grad() = bucket.flat.narrow(0, bucket.offsets[k], p.numel()).view(p.sizes());
      if (carried_[i].defined()) p.mutable_grad().add_(carried_[i]);
    }
  }
  reset_backward();
  reduced_ = true;
}

void install_large_block_cache_once() {
  if (large_block_cache_installed()) return;
  try {
    install_large_block_cache();
  } catch (const c10::Error& e) {
    TORCH_WARN_ONCE(
        "ZeroRedundancyOptimizer (stage 2): the large block cache was not installed (",
        e.what_without_backtrace(),
        "); the gradients stage 2 frees may stay in malloc's heap rather than be saved");
  }
}

}  // namespace zero_detail
}  // namespace data_parallel
}  // namespace distoptim
