#include <distoptim/data_parallel/distributed_data_parallel.h>

#include <algorithm>
#include <atomic>
#include <string>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/default_comm_hooks.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <distoptim/comm/errors.h>
#include <distoptim/data_parallel/gradient_store.h>

#include "bucket_aliased_gradients.h"
#include "parameter_check.h"
#include "store_sync.h"

namespace distoptim {
namespace data_parallel {

namespace {

// PyTorch's DDP: the first bucket is small so the first allreduce starts early in backward
// (dist._DEFAULT_FIRST_BUCKET_BYTES), and module states are broadcast in 250 MiB pieces.
constexpr int64_t kFirstBucketBytes = int64_t{1} << 20;
constexpr size_t kBroadcastBucketBytes = size_t{250} << 20;

// How a rank runs a forward, as the ranks tell each other before it (a joined rank says
// nothing: 0).
enum SyncMode : int {
  kToGrad = 1,      // gradients are synchronized in .grad, by the Reducer during backward
  kToStore = 2,     // in a GradientStore (a distributed autograd context), after backward
  kNotSyncing = 3,  // no_sync() or no grad: nothing is synchronized
};

}  // namespace

struct GradientSync::Impl {
  DistributedDataParallelOptions options;
  comm::Group group;
  std::vector<at::Tensor> parameters;
  std::vector<at::Tensor> buffers;
  // Shared only with the first backward of a static graph (queue_delayed_reduction).
  std::shared_ptr<c10d::Reducer> reducer;
  // Synchronizing forwards so far (PyTorch's num_iterations): a static graph's first is
  // reduced after its backward.
  int64_t iterations = 0;
  // Set unless the user asked for gradient_as_bucket_view, find_unused_parameters or
  // static_graph: the
  // Reducer then runs with bucket views all the same, and this keeps .grad plain tensors.
  std::unique_ptr<BucketAliasedGradients> aliases;
  // torch's require_backward_grad_sync (false inside no_sync) and require_forward_param_sync
  // (buffers are broadcast before a forward only after a synchronized one).
  bool sync_gradients = true;
  bool sync_buffers_next = true;
  bool has_comm_hook = false;
  // Whether every synchronizing forward exchanges where each rank's gradients go (see the
  // constructor).
  bool exchange_modes = false;
  // The store this forward's gradients go to, between before_forward and after_forward.
  std::shared_ptr<GradientStore> forward_store;
  // Alive while a synchronization queued on a store has not run: lets a second forward into a
  // store before the first one's backward fail, as the Reducer fails it for .grad.
  std::weak_ptr<std::atomic<bool>> store_sync_pending;
  // Expires with this object: a synchronization queued on a store checks it first.
  std::shared_ptr<bool> alive = std::make_shared<bool>(true);

  int global_rank() const { return group.global_rank(group.rank()); }

  // After the first synchronized backward, buckets are rebuilt in the order gradients actually
  // became ready (rank 0's order, so all ranks agree).
  void rebuild_buckets() {
    if (aliases == nullptr) {
      reducer->rebuild_buckets();
      return;
    }
    const std::vector<at::Tensor> before = aliases->before_rebuild();
    if (reducer->rebuild_buckets()) aliases->after_rebuild(before);
  }

  // Every rank says how it runs this forward; a group whose ranks put gradients in different
  // places (a distributed autograd context on some, .grad on others) fails on every rank here,
  // before any gradient is reduced. `mode` 0: a joined rank, which says nothing.
  void exchange_sync_mode(int mode) const {
    std::vector<at::Tensor> modes = {at::zeros({group.size()})};
    modes[0][group.rank()] = static_cast<float>(mode);
    c10d::AllreduceOptions options;
    options.timeout = group.timeout();
    group.process_group()->allreduce(modes, options)->wait(group.timeout());
    std::vector<int> to_grad, to_store;
    for (int r = 0; r < group.size(); ++r) {
      const int m = static_cast<int>(modes[0][r].item<float>());
      if (m == kToGrad) to_grad.push_back(group.global_rank(r));
      if (m == kToStore) to_store.push_back(group.global_rank(r));
    }
    TORCH_CHECK_VALUE(
        to_grad.empty() || to_store.empty(), "DistributedDataParallel.forward (on rank ",
        global_rank(), "): rank(s) ", c10::Join(", ", to_store),
        " run forward inside a distributed autograd context and rank(s) ", c10::Join(", ", to_grad),
        " outside one; every rank of the group must do the same (inside a context gradients are "
        "averaged in the context, outside in .grad)");
  }

  // A static graph's first synchronized backward: once it reaches the outputs, the Reducer's
  // delayed reduction of every bucket is queued to run when the pass ends (what PyTorch's
  // _DDPSink does), since the Reducer reduces nothing during that pass.
  void queue_delayed_reduction(const std::vector<at::Tensor>& outputs) {
    TORCH_CHECK_VALUE(
        std::any_of(outputs.begin(), outputs.end(),
                    [](const at::Tensor& t) { return t.requires_grad(); }),
        "DistributedDataParallel (rank ", global_rank(),
        "): static_graph needs the first forward to return a tensor that requires grad (alone, "
        "in a vector or in a tuple), whose backward reduces the gradients");
    auto queued = std::make_shared<std::atomic<bool>>(false);
    const std::weak_ptr<c10d::Reducer> weak = reducer;
    for (const at::Tensor& output : outputs) {
      if (!output.requires_grad()) continue;
      output.register_hook([queued, weak](const at::Tensor&) {
        if (queued->exchange(true)) return;
        torch::autograd::Engine::get_default_engine().queue_callback([weak] {
          if (auto reducer = weak.lock()) reducer->delay_all_reduce();
        });
      });
    }
  }

  // Queues the averaging of this forward's gradients in `store` on the next backward pass into
  // it: each bucket as soon as the pass has accumulated all its gradients there, the rest at
  // the end of the local pass, which completes once every average is back in `store`.
  void queue_store_sync(const std::shared_ptr<GradientStore>& store) {
    auto pending = std::make_shared<std::atomic<bool>>(true);
    auto sync = std::make_shared<StoreSync>(store, *reducer, has_comm_hook, group.size(),
                                            global_rank(), std::weak_ptr<bool>(alive));
    for (const at::Tensor& param : parameters) {
      store->add_gradient_listener(
          param, [sync, impl = param.unsafeGetTensorImpl()] { sync->gradient_ready(impl); });
    }
    store->add_backward_callback([sync, pending] {
      pending->store(false);
      return sync->finish();
    });
    store_sync_pending = pending;
  }

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
  if (s.options.share_host_memory()) s.group = comm::share_host_memory(s.group);
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

  // Gradients can go elsewhere than .grad only in a program with a GradientStore provider (one
  // that links the distributed autograd layer). Only then does every synchronizing forward
  // exchange where each rank's gradients go: agreed here once, so that every rank makes the same
  // collectives, and the iterations of a program without distributed autograd make exactly the
  // collectives they made before.
  {
    std::vector<at::Tensor> flag = {at::full({1}, has_gradient_store_provider() ? 1.0f : 0.0f)};
    c10d::AllreduceOptions max;
    max.reduceOp = c10d::ReduceOp::MAX;
    max.timeout = s.group.timeout();
    pg->allreduce(flag, max)->wait(s.group.timeout());
    s.exchange_modes = flag[0].item<float>() > 0;
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
  // Gradients in the buckets' memory save a copy of every gradient out of the buckets per
  // backward (and, for a gradient kept in .grad, the copy in). Without find_unused_parameters
  // (whose gradients PyTorch's Reducer treats differently with views) that holds by default,
  // .grad keeping its meaning (bucket_aliased_gradients.h).
  if (!s.options.gradient_as_bucket_view() && !s.options.find_unused_parameters() &&
      !s.options.static_graph()) {
    s.aliases = std::make_unique<BucketAliasedGradients>(s.parameters);
  }
  const std::vector<at::Tensor> grads_before =
      s.aliases != nullptr ? s.aliases->before_rebuild() : std::vector<at::Tensor>{};
  s.reducer = std::make_shared<c10d::Reducer>(
      s.parameters, std::move(bucket_indices), std::move(bucket_limits), pg,
      std::vector<bool>(s.parameters.size(), false), bucket_bytes,
      s.options.find_unused_parameters(),
      s.options.gradient_as_bucket_view() || s.aliases != nullptr,
      std::unordered_map<size_t, std::string>{}, std::min(kFirstBucketBytes, bucket_bytes));
  if (s.aliases != nullptr) s.aliases->after_rebuild(grads_before);
  if (s.options.static_graph()) {
    s.reducer->set_static_graph();
    if (s.options.find_unused_parameters()) {
      TORCH_WARN(
          "You passed find_unused_parameters=true to DistributedDataParallel, "
          "`_set_static_graph` will detect unused parameters automatically, so you do not "
          "need to set find_unused_parameters=true, just be sure these unused parameters "
          "will not change during training loop while calling `_set_static_graph`.");
    }
  }
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
  const bool syncing = grad_enabled && s.sync_gradients;
  // Inside a distributed autograd context (or another GradientStore), gradients are averaged
  // where the backward pass puts them, after it: the Reducer's hooks stay idle and .grad
  // untouched.
  std::shared_ptr<GradientStore> store = syncing ? current_gradient_store() : nullptr;
  if (store != nullptr) {
    TORCH_CHECK_VALUE(
        !join_config().enable, "DistributedDataParallel.forward (rank ", s.global_rank(),
        "): inside ", store->name(),
        " under a Join; Join is supported only outside distributed autograd contexts");
    TORCH_CHECK_VALUE(!s.options.find_unused_parameters() || s.options.static_graph(),
                      "DistributedDataParallel.forward (rank ", s.global_rank(),
                      "): find_unused_parameters = true inside ", store->name(),
                      " is not supported");
    auto pending = s.store_sync_pending.lock();
    TORCH_CHECK_VALUE(pending == nullptr || !pending->load(),
                      "DistributedDataParallel.forward (rank ", s.global_rank(), ") inside ",
                      store->name(),
                      ": the previous forward's gradients were not reduced yet; run the backward "
                      "pass of each forward before the next forward (or release its context)");
  }
  if (syncing && store == nullptr) {
    s.reducer->prepare_for_forward();
    ++s.iterations;
  }
  // Under a Join: count this rank as training; the count is the divisor if asked. Its failure
  // says what it means itself.
  if (auto work = Join::notify_join_context(*this)) {
    s.reducer->set_forward_pass_work_handle(
        work, join_config().hook_options.divide_by_initial_world_size());
  }
  try {
    // Under a Join every forward says how it runs, so that joined ranks can shadow it.
    if (s.exchange_modes && (syncing || join_config().enable)) {
      s.exchange_sync_mode(!syncing ? kNotSyncing : store != nullptr ? kToStore : kToGrad);
    }
    if (grad_enabled) s.rebuild_buckets();
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
  s.forward_store = std::move(store);
}

// A joined rank's part in DistributedDataParallel's iterations (see GradientSync::join_hook).
class GradientSync::ReplicaJoinHook : public JoinHook {
 public:
  explicit ReplicaJoinHook(Impl& state) : s_(state) {}

  void main_hook() override {
    if (s_.exchange_modes) s_.exchange_sync_mode(0);
    s_.rebuild_buckets();
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
  TORCH_CHECK_VALUE(!impl_->options.static_graph(),
                    "DistributedDataParallel::join_hook: static_graph = true is not supported "
                    "under Join");
  return std::make_unique<ReplicaJoinHook>(*impl_);
}

void GradientSync::after_forward(const std::vector<at::Tensor>& outputs) {
  Impl& s = *impl_;
  std::shared_ptr<GradientStore> store = std::move(s.forward_store);
  if (at::GradMode::is_enabled() && s.sync_gradients) {
    s.sync_buffers_next = true;
    if (store != nullptr) {
      s.queue_store_sync(store);
    } else if (s.options.find_unused_parameters() && !s.options.static_graph()) {
      TORCH_CHECK_VALUE(!outputs.empty(),
                        "DistributedDataParallel: find_unused_parameters needs "
                        "forward to return a tensor, a vector or a tuple of tensors");
      s.reducer->prepare_for_backward(outputs);
    } else {
      if (s.options.static_graph() && s.iterations == 1) s.queue_delayed_reduction(outputs);
      s.reducer->prepare_for_backward({});
      if (s.aliases != nullptr) s.aliases->expect_synchronized_pass();
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
  impl_->has_comm_hook = true;
}

void GradientSync::register_builtin_comm_hook(BuiltinCommHook hook) {
  impl_->reducer->register_builtin_comm_hook(hook == BuiltinCommHook::kFp16Compress
                                                 ? c10d::BuiltinCommHookType::FP16_COMPRESS
                                                 : c10d::BuiltinCommHookType::ALLREDUCE);
  impl_->has_comm_hook = true;
}

const comm::Group& GradientSync::process_group() const { return impl_->group; }

const std::vector<at::Tensor>& GradientSync::parameters() const { return impl_->parameters; }

}  // namespace data_parallel
}  // namespace distoptim
