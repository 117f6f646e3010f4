#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <distoptim/comm/process_group.h>
#include <distoptim/data_parallel/join.h>
#include <distoptim/optim/functional_optimizer.h>
#include <distoptim/optim/option_bag.h>

namespace distoptim {
namespace data_parallel {

/// PyTorch's sorted-greedy partition of ZeroRedundancyOptimizer: for parameters given as the
/// element counts of each group (global indices run through the groups in order), the indices
/// each of `world_size` ranks owns, ascending. Group by group, parameters are taken largest
/// first (ties in list order) and each goes to the rank with the fewest elements so far (the
/// lowest such rank on ties). Throws c10::ValueError for world_size < 1 or a negative count.
std::vector<std::vector<int64_t>> zero_partition(
    const std::vector<std::vector<int64_t>>& group_numels, int world_size);

struct ZeroRedundancyOptimizerOptions {
  /// The data-parallel ranks that share the optimizer state; by default the world.
  TORCH_ARG(std::optional<comm::Group>, process_group) = std::nullopt;
  /// Keep each rank's shard of parameters in one flat buffer per dtype, the parameters being
  /// views into it, so a step sends one broadcast per rank and dtype instead of one per
  /// parameter.
  TORCH_ARG(bool, parameters_as_bucket_view) = false;
  /// Run the update inside DDP's backward pass instead of in step(): register
  /// hook_with_zero_step(zero) with the DistributedDataParallel. Each rank updates its
  /// parameters of a bucket as soon as that bucket's gradients are averaged, and broadcasts them
  /// while the next buckets are processed; when backward returns, every replica holds the new
  /// parameters. Unlike PyTorch's, this works on Gloo and updates from the first iteration (the
  /// partition does not depend on DDP's buckets). step() then does nothing;
  /// parameters_as_bucket_view is ignored.
  TORCH_ARG(bool, overlap_with_ddp) = false;
  /// 1 (PyTorch's ZeroRedundancyOptimizer): every rank keeps every parameter's gradient, as a
  /// DistributedDataParallel averages them. 2 (beyond PyTorch; ZeRO stage 2): the optimizer
  /// averages the gradients itself, each one only onto the rank that owns its parameter, in
  /// buckets while backward runs (one c10d reduce per bucket to its owner), and every other rank
  /// frees it at once: after backward a rank holds the gradients of its own parameters only
  /// (about 1/world of them), and at most the buckets in flight of the others' (their memory,
  /// and that of an owner's buckets once zero_grad dropped its gradients, is reused by the next
  /// pass rather than allocated again; a gradient still held keeps its own). Train the plain
  /// module, not a DistributedDataParallel (step() throws c10::ValueError if a gradient of
  /// another rank's parameter is there after backward); clear the gradients (zero_grad) before
  /// every backward pass, since each pass is averaged on its own; a parameter that requires a
  /// gradient but gets none in a pass counts as a zero gradient. Results equal stage 1's with a
  /// DistributedDataParallel to rounding. Not with overlap_with_ddp or join_hook (c10::ValueError).
  TORCH_ARG(int, stage) = 1;
  /// With stage 2: make install_large_block_cache() (large_block_cache.h, its default options)
  /// LibTorch's CPU allocator for the process when constructed, unless it already is. The
  /// gradients stage 2 frees are fresh buffers every pass; at glibc's defaults they stay in
  /// malloc's heap and save nothing, with the cache they are reused or given back. Where another
  /// allocator holds the place, construction warns and goes on. false leaves the allocator alone.
  TORCH_ARG(bool, large_block_cache) = true;
  /// Not in PyTorch: when every rank of the group runs on this host, the parameters are
  /// broadcast after the step (and, under stage 2, the gradients reduced to their owners) through
  /// memory the ranks share rather than Gloo's loopback TCP (comm::share_host_memory: 8 MiB of
  /// /dev/shm per rank). Off, or across hosts, Gloo does it.
  TORCH_ARG(bool, share_host_memory) = true;
};

/// torch.distributed.optim.ZeroRedundancyOptimizer: every rank of a data-parallel group holds
/// all parameters, but the optimizer state of only its share of them (about 1/world of it).
/// `step` updates this rank's share with a local optimizer (ours by registry name or by type
/// through a factory, or a LibTorch torch::optim::Optimizer), then every rank broadcasts its
/// updated parameters so all replicas are identical again; with overlap_with_ddp the same runs
/// inside DDP's backward pass (hook_with_zero_step).
///
/// Partition: PyTorch's sorted-greedy one (group by group, largest parameter first, each to the
/// rank with the fewest elements so far; each parameter wholly owned by one rank), so a rank
/// updates the same parameters as under PyTorch for the same list and world size. Parameters
/// may have different floating dtypes (PyTorch refuses them).
///
/// State dicts are global, keyed by the parameter's index in params() as Python's are:
/// `consolidate_state_dict(to)` gathers every rank's shard on rank `to` only, one rank at a time
/// (PyTorch broadcasts every shard to every rank); `state_dict()` there returns it;
/// `load_state_dict` takes this rank's part of a global dict, so a dict saved under another
/// world size loads too; it loads only when every rank holds the same valid dict.
///
/// Param groups and learning-rate schedules: as PyTorch's, it is a torch::optim::Optimizer.
/// `param_groups()` holds every group with all its parameters (not only this rank's) and the
/// group's options: an optim::AdapterOptions (defaults merged with the group's overrides) when
/// the local optimizer is ours, a copy of the LibTorch optimizer's own group options otherwise.
/// LibTorch's LR schedulers (torch::optim::StepLR, a user's torch::optim::LRScheduler subclass)
/// drive it through them, and so may a user: `zero.param_groups()[0].options().set_lr(0.01)`,
/// or with typed access `zero.set_group_options(0, OptionBag().set("momentum", 0.95))`.
/// Changes take effect at the next step (with overlap_with_ddp, the next backward pass's
/// update), consolidate_state_dict or state_dict read after it. Every rank must hold the same
/// options, as every rank runs the same schedule: each step first compares a SHA-256 of every
/// rank's options (one allgather of a small fixed-size record; with a LibTorch local optimizer
/// only the learning rates are compared) and checks this rank's changes, and on a mismatch or
/// a refused value every rank throws the same c10::ValueError naming the ranks that differ or
/// the refused option, before any rank changes anything.
///
/// Thread safety: not synchronized; one thread drives an instance. Collective: construction,
/// step, add_param_group, consolidate_state_dict, load_state_dict and load_state_dict_from_file
/// must be called by every rank of the group in the same order; they fail after the group's
/// timeout when a rank does not. Errors: bad input throws c10::ValueError naming the argument
/// (and rank), before anything changes.
class ZeroRedundancyOptimizer : public torch::optim::Optimizer, public Joinable {
 public:
  /// Builds one of our optimizers over this rank's share of the groups (each group keeps its
  /// overrides; groups where the rank owns nothing stay, empty). Example:
  ///   [](std::vector<optim::ParamGroup> groups) {
  ///     return std::make_unique<optim::Adam>(std::move(groups), optim::AdamOptions().lr(0.01));
  ///   }
  using LocalOptimizerFactory = std::function<std::unique_ptr<optim::FunctionalOptimizer>(
      std::vector<optim::ParamGroup> shard)>;
  /// Builds a LibTorch optimizer over this rank's share of the parameters (maybe none):
  ///   [](std::vector<at::Tensor> shard) {
  ///     return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(0.01));
  ///   }
  using LibTorchOptimizerFactory =
      std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> shard)>;

  /// The local optimizer by registry name ("adam", a user's registered one, ...) with `defaults`
  /// (PyTorch's optimizer_class and **defaults).
  ZeroRedundancyOptimizer(std::vector<optim::ParamGroup> groups, const std::string& optimizer,
                          const optim::OptionBag& defaults = {},
                          ZeroRedundancyOptimizerOptions options = {});
  ZeroRedundancyOptimizer(std::vector<at::Tensor> params, const std::string& optimizer,
                          const optim::OptionBag& defaults = {},
                          ZeroRedundancyOptimizerOptions options = {});
  /// The same from a typed options struct, as LibTorch's optimizers take theirs; the options'
  /// type names the optimizer (its `kOptimizer`: SGDOptions "sgd", AdamOptions "adam", ...; a
  /// user's own struct declares the name it registered):
  ///   ZeroRedundancyOptimizer zero(model->parameters(),
  ///                                optim::AdamOptions(1e-3).betas({0.9, 0.98}));
  template <class Options, class = decltype(Options::kOptimizer)>
  ZeroRedundancyOptimizer(std::vector<optim::ParamGroup> groups, const Options& defaults,
                          ZeroRedundancyOptimizerOptions options = {})
      : ZeroRedundancyOptimizer(std::move(groups), std::string(Options::kOptimizer),
                                optim::options_to_bag(defaults), std::move(options)) {}
  template <class Options, class = decltype(Options::kOptimizer)>
  ZeroRedundancyOptimizer(std::vector<at::Tensor> params, const Options& defaults,
                          ZeroRedundancyOptimizerOptions options = {})
      : ZeroRedundancyOptimizer(std::move(params), std::string(Options::kOptimizer),
                                optim::options_to_bag(defaults), std::move(options)) {}
  /// The local optimizer by type, from a factory (see LocalOptimizerFactory).
  ZeroRedundancyOptimizer(std::vector<optim::ParamGroup> groups,
                          const LocalOptimizerFactory& make_local,
                          ZeroRedundancyOptimizerOptions options = {});
  /// A LibTorch torch::optim::Optimizer as the local optimizer. Training works as with ours
  /// (step, add_param_group without overrides, overlap_with_ddp); state dicts do not: LibTorch
  /// keys optimizer state by tensor address, so consolidate_state_dict, state_dict and
  /// load_state_dict throw c10::ValueError.
  ZeroRedundancyOptimizer(std::vector<at::Tensor> params,
                          const LibTorchOptimizerFactory& make_local,
                          ZeroRedundancyOptimizerOptions options = {});
  ~ZeroRedundancyOptimizer();

  /// Runs `closure` (if any, with grad mode on) and returns its loss, then updates this rank's
  /// parameters from their `.grad` (a parameter without one is skipped) and synchronizes all
  /// parameters across the ranks. With overlap_with_ddp, only runs the closure (and warns once):
  /// the DDP hook has done the update.
  at::Tensor step(LossClosure closure = nullptr) override;
  /// The same with explicit gradients: one per parameter of params(), undefined to skip; only
  /// this rank's entries are read.
  void step(const std::vector<at::Tensor>& gradients);
  /// Sets every parameter's `.grad` to undefined (set_to_none; PyTorch 1.13's
  /// ZeroRedundancyOptimizer zeroes by default, PyTorch 2 sets to none) or zero, in place:
  /// gradients that are views of a DistributedDataParallel's buckets (gradient_as_bucket_view)
  /// stay views. Call it on the ZeroRedundancyOptimizer: LibTorch's
  /// torch::optim::Optimizer::zero_grad() (through a base reference) detaches in place, which
  /// such views refuse.
  void zero_grad(bool set_to_none = true);

  /// Adds a group (repartitioning; parameters already present keep their rank). Collective.
  /// Groups are added here only: one appended to param_groups() through the base class makes
  /// the next step throw.
  void add_param_group(const optim::ParamGroup& group);

  /// The number of param groups.
  size_t num_param_groups() const;
  /// Group `group`'s options as the next step will use them (param_groups()'s, as a bag; with a
  /// LibTorch local optimizer, its "lr" alone).
  optim::OptionBag group_options(size_t group) const;
  /// Changes some of group `group`'s options from the next step on, on this rank: every rank
  /// must make the same change. Checked here against the local optimizer (c10::IndexError for a
  /// group out of range, c10::ValueError naming a refused option; nothing changes then); with
  /// a LibTorch local optimizer only "lr" can be set this way.
  void set_group_options(size_t group, const optim::OptionBag& changes);

  /// torch::save(zero, path): on a rank holding a consolidated state (consolidate_state_dict),
  /// writes state_dict() as the optimizer adapters do (optim::FunctionalOptimizerAdapter's
  /// kArchiveKey); elsewhere throws c10::ValueError as state_dict() does. torch::load(zero,
  /// path): collective, loads as load_state_dict does (every rank its own copy). Prefer
  /// load_state_dict_from_file: a rank whose file cannot be opened fails inside torch::load
  /// before it reaches the collective, and the others then fail after the group's timeout.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  /// Gathers the whole optimizer state on rank `to` (a rank of the group). Collective.
  void consolidate_state_dict(int to = 0);
  /// The state last consolidated on this rank; throws c10::ValueError if there is none.
  optim::OptimizerStateDict state_dict() const;
  /// Loads this rank's part of a global state dict. Collective: every rank checks the whole of
  /// its own copy (optimizer, groups, indices, state names and shapes, options) and hashes it
  /// (SHA-256 of its values, not of the tensors' memory layout), then the ranks exchange their
  /// results, and each loads its part only when every rank's check passed and all digests are
  /// equal. Otherwise every rank throws the same c10::ValueError and no rank changes anything:
  ///   ZeroRedundancyOptimizer.load_state_dict: rank 2 cannot load the state dict: state
  ///   'exp_avg' of parameter 1 has shape [6], the parameter [5]; nothing was loaded on any rank
  ///   ZeroRedundancyOptimizer.load_state_dict: ranks disagree on the state dict: rank 2 differs
  ///   from rank 0 (SHA-256 1f0c...  on rank 2, 9ab2... on ranks 0, 1); nothing was loaded ...
  /// A failing rank's own error text travels with it (its first 1024 bytes). Ranks whose
  /// digest differs are named against the digest most ranks hold (on a tie, the one of the
  /// lowest rank). A rank that does not call it makes the others throw
  /// distoptim::DistributedError after the group's timeout, having loaded nothing.
  void load_state_dict(const optim::OptimizerStateDict& dict);
  /// Reads the dict at `path` (optim::load_state_dict_file; each rank its own path or copy) and
  /// loads it as load_state_dict does. Use it rather than load_state_dict_file followed by
  /// load_state_dict: a rank whose file is missing, truncated or malformed still takes part,
  /// so every rank throws the same c10::ValueError naming that rank, its path and its reading
  /// error (`rank 2 cannot load the state dict: reading 'PATH' failed: ...`), and nothing is
  /// loaded anywhere, instead of that rank alone throwing while the others load and go on.
  void load_state_dict_from_file(const std::string& path);

  /// All parameters, groups concatenated (the indices of state dicts).
  const std::vector<at::Tensor>& params() const;
  /// For each rank of the group, the indices (into params()) of the parameters it updates.
  const std::vector<std::vector<int64_t>>& partition() const;
  /// The local optimizer over this rank's parameters. A LibTorch one is seen through an
  /// optim::LibTorchOptimizerAdapter (name() "libtorch", no state dicts).
  const optim::FunctionalOptimizer& local_optimizer() const;
  /// The LibTorch local optimizer, or null when the local optimizer is ours.
  torch::optim::Optimizer* libtorch_local_optimizer() const;
  const comm::Group& process_group() const;

  /// Joinable (see join.h; list it after the DistributedDataParallel): a joined rank still
  /// updates its share of the parameters, from the average of the training ranks' gradients
  /// that DDP's join hook leaves in `.grad`, and joins the parameter broadcasts.
  std::unique_ptr<JoinHook> join_hook(const JoinHookOptions& options) override;
  c10::Device join_device() const override { return c10::Device(c10::kCPU); }
  const comm::Group& join_process_group() const override;

 private:
  friend std::unique_ptr<c10d::CommHookInterface> hook_with_zero_step(
      ZeroRedundancyOptimizer& zero, std::unique_ptr<c10d::CommHookInterface> hook);
  // Fills the base class's param_groups() and defaults() from the local optimizer.
  void expose_param_groups();

  struct Impl;
  class StepHook;       // the hook of hook_with_zero_step
  class ShardJoinHook;  // what join_hook returns
  std::unique_ptr<Impl> impl_;
};

/// PyTorch's hook_with_zero_step: a DDP communication hook that reduces each bucket with `hook`
/// (allreduce_hook() over zero's group when null) and runs `zero`'s update as part of the
/// backward pass (see ZeroRedundancyOptimizerOptions::overlap_with_ddp). Register it with the
/// DistributedDataParallel whose parameters `zero` optimizes:
///
///   ZeroRedundancyOptimizer zero(model->parameters(), "adam", {{"lr", 0.01}},
///                                ZeroRedundancyOptimizerOptions().overlap_with_ddp(true));
///   ddp.register_comm_hook(hook_with_zero_step(zero));
///   ddp.forward(x).sum().backward();   // parameters updated and synchronized
///
/// `zero` must outlive the DDP's backward passes. Throws c10::ValueError if `zero` was built
/// without overlap_with_ddp; a backward pass throws c10::ValueError naming the parameter when
/// a DDP parameter is not one of zero's, or one of zero's is in no bucket.
std::unique_ptr<c10d::CommHookInterface> hook_with_zero_step(
    ZeroRedundancyOptimizer& zero, std::unique_ptr<c10d::CommHookInterface> hook = nullptr);

}  // namespace data_parallel
}  // namespace distoptim
