#pragma once

// DistributedDataParallel's gradients in its buckets' memory without changing what .grad means.
//
// c10d::Reducer with gradient_as_bucket_view makes each .grad a view of its bucket: backward
// then skips a copy of every gradient out of the buckets, and a gradient kept in .grad skips the
// copy in as well. But those views break what LibTorch users rely on: Optimizer::zero_grad
// detaches in place, which autograd refuses for a view; a gradient set by hand before backward
// is replaced instead of receiving the average; a gradient the user keeps after clearing .grad
// is overwritten by the next backward. This class runs the Reducer in that mode and keeps .grad
// as without it:
// - after each synchronized backward, a bucket view in .grad is swapped for a plain tensor over
//   the same memory (same storage, offset, sizes and strides; not an autograd view);
// - a gradient that was in .grad before the pass and is not such an alias (set by hand, or
//   accumulated under no_sync) is put back into .grad after the pass with the average copied in;
// - an alias the user still holds after taking it out of .grad gets its own copy of its values
//   before the next pass writes the bucket.
// What stays different: a gradient tensor handed out by this class and kept by the user while
// also in .grad shares memory with the bucket, as the same tensor would in .grad without views.

#include <cstddef>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

namespace distoptim {
namespace data_parallel {

class BucketAliasedGradients {
 public:
  explicit BucketAliasedGradients(std::vector<at::Tensor> parameters);
  ~BucketAliasedGradients();
  BucketAliasedGradients(const BucketAliasedGradients&) = delete;
  BucketAliasedGradients& operator=(const BucketAliasedGradients&) = delete;

  /// The gradients as they are before the Reducer (re)builds its bucket views (its constructor,
  /// rebuild_buckets), which copies each defined .grad into its new view and puts the view in
  /// .grad; pass them to after_rebuild.
  std::vector<at::Tensor> before_rebuild() const;
  /// Puts back in .grad what was there before the rebuild: a user's tensor as it was, an alias
  /// of the old bucket pointed at the new one (same tensor, same values).
  void after_rebuild(const std::vector<at::Tensor>& before);

  /// The next backward pass over the parameters is one the Reducer synchronizes.
  void expect_synchronized_pass();

 private:
  class AccumulatorHook;
  struct State;

  std::shared_ptr<State> state_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<torch::autograd::FunctionPreHook*> hooks_;
};

}  // namespace data_parallel
}  // namespace distoptim
