// hook_with_zero_step: ZeroRedundancyOptimizer's update inside DDP's backward pass
// (ZeroRedundancyOptimizerOptions::overlap_with_ddp).
#include <distoptim/data_parallel/comm_hooks.h>

#include "zero_impl.h"

namespace distoptim {
namespace data_parallel {

using zero_detail::kName;

// The DDP hook of overlap_with_ddp. Buckets arrive in index order on the autograd thread; each is
// reduced by the base hook at once. When the last one arrives, bucket by bucket: wait for its
// reduction, update this rank's parameters of it, and start the broadcasts of its parameters
// from their owners (one per parameter, in place), so the broadcasts of a bucket overlap the
// updates of the next. Backward returns once every broadcast has arrived.
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
    s_.apply_group_options(std::string(kName) + " (hook_with_zero_step)", "backward()");
    const int me = s_.my_rank();
    const auto& pg = s_.group.process_group();
    // partition[me] is the local optimizer's parameter order.
    std::vector<int64_t> local_index(s_.params.size(), -1);
    for (size_t k = 0; k < s_.partition[me].size(); ++k) local_index[s_.partition[me][k]] = k;
    std::vector<bool> seen(s_.params.size(), false);

    // A non-contiguous parameter of another owner, received into a contiguous copy.
    struct Receive {
      int64_t index;
      at::Tensor copy;
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
      // Each parameter straight from its owner into every replica: no staging copies, so the
      // overlap costs no memory beyond stage 1's (a non-contiguous one goes through a copy).
      for (const int64_t i : bucket.indices) {
        const at::Tensor& p = s_.params[i];
        if (p.numel() == 0) continue;
        at::Tensor target = p.detach();
        if (!target.is_contiguous()) {
          target = target.contiguous();
          if (s_.owner[i] != me) receives.push_back({i, target});
        }
        c10d::BroadcastOptions options;
        options.rootRank = s_.owner[i];
        options.timeout = s_.group.timeout();
        std::vector<at::Tensor> one = {target};
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
    for (const Receive& receive : receives) s_.params[receive.index].detach().copy_(receive.copy);
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
