#pragma once

// Distributed autograd (torch.distributed.autograd): gradients that flow back along the RPCs a
// forward pass made.
//
//   distoptim::dist_autograd::ContextGuard context;      // with dist_autograd.context() as id:
//   at::Tensor remote_out = rpc_sync<at::Tensor>("ps", "forward", std::tuple{input});
//   at::Tensor loss = (remote_out * local_weight).sum();
//   distoptim::dist_autograd::backward(context.id(), {loss});
//   auto grads = distoptim::dist_autograd::get_gradients(context.id());  // here; each worker
//                                                                         // reads its own
//
// Inside a context, every RPC (rpc_sync/rpc_async, remote() arguments, to_here() results, RRef
// method calls) records, on both sides, a send/recv pair for the tensors in it that require
// grad, in both directions; the worker that receives a call joins the caller's context while it
// runs the call (nested calls are recorded too). Under a no-grad guard nothing is recorded and
// the context does not travel. backward() runs this worker's part of the graph and sends
// gradients along each recorded pair; every worker reached runs its part once, with all the
// gradients it will get, and backward returns when every one of them is done. Leaf gradients
// accumulate in each worker's copy of the context, never in `.grad`.
//
// Threading: a context is current on the thread that made it (ContextGuard); other threads may
// use its id with backward() and get_gradients(). backward() on one context at a time.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>

namespace distoptim {
namespace dist_autograd {

/// A distributed autograd context, current on this thread while the guard lives (contexts nest:
/// the previous one is current again afterwards). Its id is `worker_id << 48 | n`, unique across
/// the group. Destroying the guard releases the context here and, asynchronously, on every worker
/// it reached (including their gradients and any of its messages still queued); a message of a
/// released context that arrives later is refused, never recorded in a new one.
/// Throws DistributedError when no RPC agent runs.
class ContextGuard {
 public:
  ContextGuard();
  ~ContextGuard();
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

  int64_t id() const { return id_; }

 private:
  int64_t id_;
  std::optional<int64_t> previous_;
};

/// The distributed backward pass (PyTorch's FAST mode): `roots` are scalars that require grad;
/// their gradients start at 1. Runs the local graph, sends gradients along each send/recv pair of
/// the context, and returns once every worker reached has run its part (each node once, with the
/// sum of its gradients). retain_graph=false frees the graph's saved tensors on every worker as
/// it goes, so a second backward through it fails, as in PyTorch.
///
/// Only the worker that created the context runs backward on it. A remote result the loss never
/// used costs nothing: its owner is told no gradient will come. Bounded by the RPC timeout
/// (rpc::get_rpc_timeout(); 0: no bound): past it, TimeoutError naming the workers whose
/// gradients never arrived. Errors: c10::ValueError for an unknown context, a context created on
/// another worker, or a bad root (naming its index); DistributedError if a backward already runs
/// on the context; any worker's failure as RemoteError / PeerLostError naming it.
void backward(int64_t context_id, const std::vector<at::Tensor>& roots, bool retain_graph = false);

/// The gradients accumulated in this worker's copy of the context, keyed by leaf tensor (the
/// same tensor objects that hold the parameters). c10::ValueError for an unknown context.
c10::Dict<at::Tensor, at::Tensor> get_gradients(int64_t context_id);

/// The id of this thread's current context, if any.
std::optional<int64_t> current_context_id();

/// How many contexts this worker holds (its own and those it joined). For tests and monitoring.
size_t context_count();

/// PyTorch's dist_autograd._get_debug_info(): "num_autograd_contexts" (context_count()) and
/// "num_current_backward_passes" (passes running on this worker now, started here or reaching it
/// from another worker). A snapshot; for tests and monitoring.
std::map<std::string, int64_t> get_debug_info();

}  // namespace dist_autograd
}  // namespace distoptim
