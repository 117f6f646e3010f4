#pragma once

// ZeRO stage 2's gradient reduction: every gradient goes to the rank that owns its parameter
// only, bucket by bucket while backward runs, and is freed everywhere else.

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <distoptim/comm/process_group.h>

namespace distoptim {
namespace data_parallel {
namespace zero_detail {

// Hooks the gradient accumulator of every parameter that requires a gradient. As backward
// produces a parameter's gradient, the hook copies it into the flat bucket of its owner's
// parameters (one bucket per owner, dtype and kBucketBytes, in the order backward reaches them),
// divided by the world size, and frees the parameter's .grad. A complete bucket is sent to its
// owner with one c10d reduce (SUM; Gloo in c10d 1.13 has no reduce-scatter), buckets launched in
// the same fixed order on every rank. At the end of backward (an autograd engine callback) the
// remaining buckets go (a parameter that got no gradient counts as zeros), every reduce is
// waited for, and the owner's parameters get their averaged gradient as views into its bucket;
// other ranks keep no gradient for them. Buckets of other owners give their memory back as soon
// as their reduce completes; backward waits when more than kMaxOthersInFlight are still going.
//
// Memory is reused rather than allocated per pass: freshly allocated buffers cost page faults,
// and glibc's malloc, once it has freed one such buffer, serves the next from its heap and keeps
// what is freed there (resident, so stage 2's freed gradients would not lower the peak). An
// owner's bucket is used again by the next pass when nothing but this class holds it any more
// (zero_grad set the gradients to none; a gradient still held, or kept to accumulate, gets a new
// bucket). Other owners' buckets take their memory from a few spare buffers, as many as were in
// flight at once, each returned when its reduce completes.
//
// Gradients accumulate over backward passes as in stage 1 (no zero_grad between them): the owner
// of a parameter already holding an averaged gradient keeps it aside when the next pass starts
// (a pre-hook on the accumulators, before any gradient is accumulated), so that what each rank
// sends is that pass's gradient alone, and adds it back to the new average at the end.
//
// Thread safety: confined to the thread running backward (the hooks and the callback run there);
// construction and destruction on the thread that owns the ZeroRedundancyOptimizer, not during a
// backward pass. Errors: a failed or timed-out reduce throws from backward() (DistributedError
// naming the owner); a sparse gradient throws c10::ValueError from backward().
class OwnerReduction {
 public:
  // PyTorch DDP's default bucket_cap_mb.
  static constexpr int64_t kBucketBytes = 25 * 1024 * 1024;
  // Buckets of other owners whose reduce may still be running while backward goes on.
  static constexpr size_t kMaxOthersInFlight = 4;

  OwnerReduction(comm::Group group, const std::vector<at::Tensor>& params,
                 const std::vector<int>& owner);
  ~OwnerReduction();
  OwnerReduction(const OwnerReduction&) = delete;
  OwnerReduction& operator=(const OwnerReduction&) = delete;

  // Whether a backward pass reduced gradients since the last call (which clears it).
  bool take_reduced() {
    const bool reduced = reduced_;
    reduced_ = false;
    return reduced;
  }

 private:
  struct Bucket {
    int owner = 0;
    std::vector<int64_t> indices;  // into params_
    std::vector<int64_t> offsets;  // of each parameter in flat
    int64_t numel = 0;
    at::TensorOptions options;
    // This rank's bucket: the last pass's `flat`, used again once nothing else holds it.
    at::Tensor kept;
    // Per backward pass.
    int64_t missing = 0;  // parameters whose gradient has not arrived
    at::Tensor flat;
    at::Tensor spare;  // another owner's bucket: the spare buffer under `flat`
    c10::intrusive_ptr<c10d::Work> work;
  };

  void on_pass_start();
  void on_gradient(int64_t index);
  // Puts the gradients kept aside back on their parameters (a pass that failed).
  void restore_carried();
  void take_gradient(int64_t index);
  static int64_t bytes_of(const Bucket& bucket);
  // Memory for `bucket.flat`, contents undefined.
  void allocate(Bucket& bucket);
  // Another owner's bucket whose reduce completed (or never ran): its buffer is free again.
  void return_spare(Bucket& bucket);
  void launch_ready_buckets();
  void launch(Bucket& bucket);
  void release_completed();
  void wait_for(Bucket& bucket);
  void finish_backward();
  void finish_reductions();
  void reset_backward();

  comm::Group group_;
  std::vector<at::Tensor> params_;
  std::vector<Bucket> buckets_;  // in launch order
  std::vector<int64_t> bucket_of_;
  int64_t spare_bytes_ = 0;         // the largest bucket of another owner
  std::vector<at::Tensor> spares_;  // free buffers of spare_bytes_ bytes
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  std::vector<const torch::autograd::FunctionPreHook*> pre_hooks_;  // one per accumulator
  // Per backward pass.
  bool in_backward_ = false;
  size_t next_launch_ = 0;
  std::vector<bool> arrived_;
  std::vector<at::Tensor> carried_;  // owned parameters' gradients before this pass
  bool reduced_ = false;
};

// Makes the large block cache LibTorch's CPU allocator unless it is already (stage 2's
// ZeroRedundancyOptimizerOptions::large_block_cache); warns, and leaves the allocator, where
// another holds the place.
void install_large_block_cache_once();

}  // namespace zero_detail
}  // namespace data_parallel
}  // namespace distoptim
