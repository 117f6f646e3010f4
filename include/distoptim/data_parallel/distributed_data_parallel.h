#pragma once

#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>

#include <torch/csrc/distributed/c10d/comm.hpp>

#include <distoptim/comm/process_group.h>
#include <distoptim/data_parallel/detail/collect_tensors.h>
#include <distoptim/data_parallel/join.h>

namespace distoptim {
namespace data_parallel {

/// torch.nn.parallel.DistributedDataParallel's options, named and defaulted as in PyTorch 1.13.
struct DistributedDataParallelOptions {
  /// The group that averages gradients; by default the world (comm::world()).
  TORCH_ARG(std::optional<comm::Group>, process_group) = std::nullopt;
  /// Gradients are allreduced in buckets of about this many MiB (the first bucket: 1 MiB), each
  /// launched as soon as its gradients are ready, while backward still runs.
  TORCH_ARG(double, bucket_cap_mb) = 25;
  /// Broadcast rank 0's buffers (batch-norm statistics, ...) before every forward.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Walk the graph from the outputs after each forward to find parameters that take no part
  /// in it, so their buckets still complete. Needs forward to return tensors.
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// Gradients become views into the allreduce buckets, as in PyTorch. Not needed for speed:
  /// with it off (the default) and find_unused_parameters off, gradients live in the buckets'
  /// memory all the same (no copy of the averaged buckets back into `.grad`, one set of gradients
  /// in memory), but `.grad` holds plain tensors over that memory and keeps the meaning it has
  /// without DDP: LibTorch's torch::optim::Optimizer::zero_grad() works, a gradient kept after
  /// clearing `.grad` keeps its values, and one set by hand before backward stays `.grad` and
  /// receives the average (docs/data_parallel.md). On, `.grad` is the view itself, with
  /// PyTorch's caveats: Optimizer::zero_grad() throws (it detaches in place, which autograd
  /// refuses for a view), a kept gradient is overwritten by the next backward, and one set by hand
  /// is replaced by the view instead of receiving the average.
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  /// The graph is the same every iteration (PyTorch's static_graph): the first synchronized
  /// backward finds the parameters that take no part (their gradients stay undefined, as with
  /// find_unused_parameters, without walking the graph every iteration) and averages every
  /// bucket once it has ended; later ones average each bucket as soon as it is ready, counting
  /// a parameter whose gradient arrives several times per backward (a reentrant backward, as
  /// activation checkpointing makes) once all have. A parameter unused in the first iteration
  /// and used later fails that backward with PyTorch's error ("Your training graph has changed
  /// in this iteration ..."). find_unused_parameters beside it is ignored, with PyTorch's
  /// warning. Not under Join (c10::ValueError, as find_unused_parameters).
  TORCH_ARG(bool, static_graph) = false;
  /// Not in PyTorch: when every rank of the group runs on this host, the buckets are averaged
  /// (and buffers broadcast) through memory the ranks share rather than Gloo's loopback TCP
  /// (comm::share_host_memory: 8 MiB of /dev/shm per rank, the same averages to rounding).
  /// Off, or across hosts, Gloo does it all.
  TORCH_ARG(bool, share_host_memory) = true;
};

/// The communication hooks LibTorch has built in (c10d::BuiltinCommHookType).
enum class BuiltinCommHook {
  /// Average by allreduce (what no hook does too).
  kAllReduce,
  /// Cast each bucket to float16, allreduce, cast back: half the bytes on the wire.
  kFp16Compress,
};

/// The gradient synchronisation of one model replica, without the module's type: everything
/// of DistributedDataParallel but `forward`. Built on LibTorch's c10d::Reducer.
///
/// Thread safety: one replica is driven by one thread (forward, backward, hooks); the
/// allreduces run on Gloo's threads. Blocking: construction and the buffer broadcast before a
/// forward are collectives of the group (every rank must construct, every rank must forward);
/// they and the gradient allreduces fail after the group's timeout.
/// Errors: construction throws when a rank's parameters differ in number, shape or dtype from
/// rank 0's (c10::Error naming the ranks); a module without trainable parameters is a
/// c10::ValueError.
class GradientSync : public Joinable {
 public:
  GradientSync(const torch::nn::Module& module, DistributedDataParallelOptions options);
  ~GradientSync();
  GradientSync(const GradientSync&) = delete;
  GradientSync& operator=(const GradientSync&) = delete;

  /// Called by DistributedDataParallel::forward around the module's forward.
  void before_forward();
  void after_forward(const std::vector<at::Tensor>& outputs);

  /// While the returned guard lives, backward passes accumulate gradients locally without
  /// synchronizing them (torch's no_sync()); the first backward after it synchronizes the sum.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(GradientSync& sync);
    ~NoSyncGuard();
    NoSyncGuard(NoSyncGuard&& other) noexcept;
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(NoSyncGuard&&) = delete;

   private:
    GradientSync* sync_;
    bool previous_;
  };
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  /// Replaces how each bucket is reduced. Call once, before the first forward (as in PyTorch).
  /// The hook gets every bucket with its flat gradient buffer and returns a future of the
  /// reduced buffer; see post_local_sgd_hook.h for one.
  void register_comm_hook(std::unique_ptr<c10d::CommHookInterface> hook);
  void register_builtin_comm_hook(BuiltinCommHook hook);

  const comm::Group& process_group() const;
  /// The parameters whose gradients are synchronized (those that require grad), in module order.
  const std::vector<at::Tensor>& parameters() const;

  /// Joinable (see join.h). Under a Join, each forward announces that this rank still trains
  /// and buffers are broadcast from a rank still training. A joined rank's hook shadows one
  /// iteration: the bucket rebuild, the buffer broadcast, the gradient allreduces (with zeros,
  /// through the registered comm hook; the averaged result lands in this rank's `.grad`, so a
  /// ZeroRedundancyOptimizer can still update this rank's share), and at the end broadcasts
  /// the parameters and buffers of a last joiner to all. With divide_by_initial_world_size
  /// false, gradients are averaged over the ranks still training (default comm hook only).
  /// find_unused_parameters is not supported under Join (c10::ValueError).
  std::unique_ptr<JoinHook> join_hook(const JoinHookOptions& options) override;
  c10::Device join_device() const override { return c10::Device(c10::kCPU); }
  const comm::Group& join_process_group() const override { return process_group(); }

 private:
  struct Impl;
  class ReplicaJoinHook;  // what join_hook returns
  std::unique_ptr<Impl> impl_;
};

/// torch.nn.parallel.DistributedDataParallel for a LibTorch module: rank 0's parameters and
/// buffers are broadcast at construction, and every backward pass averages the gradients over
/// the process group in buckets launched while backward still runs, so after `backward()` each
/// rank's `.grad` equals the gradient of the mean loss over all ranks' batches.
///
///   auto model = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::ReLU(), ...);
///   DistributedDataParallel ddp(model);           // collective
///   ddp.forward(x).sum().backward();              // gradients averaged over ranks
///
/// `ModuleHolder` is a LibTorch module holder (torch::nn::Linear, Sequential, a TORCH_MODULE of
/// yours) or a std::shared_ptr to a module; `forward` forwards its arguments to the module's.
/// Threading, blocking and errors: as GradientSync.
template <typename ModuleHolder>
class DistributedDataParallel : public GradientSync {
 public:
  explicit DistributedDataParallel(ModuleHolder module, DistributedDataParallelOptions options = {})
      : GradientSync(*module, std::move(options)), module_(std::move(module)) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    before_forward();
    auto output = module_->forward(std::forward<Args>(args)...);
    std::vector<at::Tensor> tensors;
    detail::collect_tensors(output, tensors);
    after_forward(tensors);
    return output;
  }

  ModuleHolder& module() { return module_; }
  const ModuleHolder& module() const { return module_; }

 private:
  ModuleHolder module_;
};

}  // namespace data_parallel
}  // namespace distoptim
