#pragma once

// DistributedDataParallel's averaging of one forward's gradients in a GradientStore (a
// distributed autograd context) instead of .grad.

#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <distoptim/data_parallel/gradient_store.h>

namespace distoptim {
namespace data_parallel {

/// The Reducer's buckets, division and comm hook, over the gradients a backward pass accumulates
/// in a store instead of .grad, in buffers of its own (never the Reducer's, which .grad may
/// alias). A bucket goes as soon as the store holds all its gradients and every earlier bucket
/// went, so every rank launches them in the same order while the backward pass still runs;
/// finish() launches the rest at the end of the local pass (a missing gradient counts as zeros,
/// as in the Reducer) and returns a future that completes once every average is back in the
/// store.
///
/// Thread safety: gradient_ready and finish may be called from any thread (the backward pass's);
/// one mutex guards the counts. The Reducer must outlive it while `alive` holds; once `alive`
/// expired, both throw.
class StoreSync : public std::enable_shared_from_this<StoreSync> {
 public:
  StoreSync(std::shared_ptr<GradientStore> store, c10d::Reducer& reducer, bool has_comm_hook,
            int group_size, int rank, std::weak_ptr<bool> alive);

  /// The store has the whole gradient of `param` for this pass (once per parameter).
  void gradient_ready(const c10::TensorImpl* param);
  /// Launches what is left; the future completes when every average is in the store, or fails
  /// naming the bucket, the store and the rank.
  c10::intrusive_ptr<c10::ivalue::Future> finish();

 private:
  void launch_ready();  // with mutex_ held
  void write_back(size_t bucket, const c10::IValue& reduced);

  const std::shared_ptr<GradientStore> store_;
  c10d::Reducer& reducer_;
  const bool has_comm_hook_;
  const int rank_;
  const std::weak_ptr<bool> alive_;
  at::Tensor scale_;
  std::vector<c10d::GradBucket> buckets_;
  const c10::intrusive_ptr<c10::ivalue::Future> done_;

  std::mutex mutex_;
  std::vector<size_t> waiting_;                                   // guarded by mutex_
  std::unordered_map<const c10::TensorImpl*, size_t> bucket_of_;  // guarded by mutex_
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> reduced_;  // guarded by mutex_
  bool finishing_ = false;                                        // guarded by mutex_
};

}  // namespace data_parallel
}  // namespace distoptim
