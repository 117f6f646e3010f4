#include <distoptim/dist_autograd/context.h>

#include <chrono>
#include <mutex>
#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <distoptim/comm/errors.h>
#include <distoptim/dist_autograd/detail/gradients.h>
#include <distoptim/dist_autograd/detail/release_hold.h>
#include <distoptim/rpc/api.h>

#include "context.h"
#include "engine.h"
#include "recorder.h"

namespace distoptim {
namespace dist_autograd {

namespace {

std::shared_ptr<detail::Context> find_context(int64_t context_id, const char* where) {
  auto context = detail::Container::instance().find(context_id);
  TORCH_CHECK_VALUE(context != nullptr, where, ": could not find distributed autograd context ",
                    context_id, " on this worker");
  return context;
}

// Contexts whose release waits for tokens of hold_release: how many tokens live, and whether
// their guard is gone (so the last token releases them).
struct ReleaseHolds {
  struct Held {
    int tokens = 0;
    bool guard_gone = false;
  };
  std::mutex mutex;
  std::unordered_map<int64_t, Held> contexts;
};

ReleaseHolds& release_holds() {
  static auto* holds = new ReleaseHolds;  // never destroyed: tokens may end at exit
  return *holds;
}

void release_here_and_everywhere(int64_t context_id) {
  if (auto context = detail::Container::instance().release(context_id)) {
    detail::release_everywhere(context);
  }
}

}  // namespace

ContextGuard::ContextGuard() : previous_(detail::current_context()) {
  detail::install();
  const int me = rpc::get_worker_info().id;  // DistributedError when no agent runs
  id_ = detail::Container::instance().create(me)->id();
  detail::current_context() = id_;
}

ContextGuard::~ContextGuard() {
  detail::current_context() = previous_;
  {
    ReleaseHolds& holds = release_holds();
    std::lock_guard<std::mutex> lock(holds.mutex);
    auto held = holds.contexts.find(id_);
    if (held != holds.contexts.end()) {
      held->second.guard_gone = true;  // the last token releases it
      return;
    }
  }
  release_here_and_everywhere(id_);
}

namespace detail {

std::shared_ptr<BackwardPass> start_backward(int64_t context_id,
                                             const std::vector<at::Tensor>& roots,
                                             bool retain_graph, const char* where) {
  auto context = find_context(context_id, where);
  TORCH_CHECK_VALUE(!roots.empty(), where, ": no roots given");
  torch::autograd::edge_list edges;
  torch::autograd::variable_list grads;
  for (size_t i = 0; i < roots.size(); ++i) {
    const at::Tensor& root = roots[i];
    TORCH_CHECK_VALUE(root.defined(), where, ": roots[", i, "] is undefined");
    TORCH_CHECK_VALUE(root.requires_grad(), where, ": roots[", i,
                      "] does not require grad (requires_grad not set on root)");
    TORCH_CHECK_VALUE(root.numel() == 1, where, ": roots[", i, "] must be a scalar, has shape ",
                      root.sizes());
    edges.push_back(torch::autograd::impl::gradient_edge(root));
    grads.push_back(at::ones_like(root, at::MemoryFormat::Contiguous));
  }
  auto pass = context->begin_pass(retain_graph, rpc::get_worker_info().id);
  DISTOPTIM_CHECK_WITH(DistributedError, pass != nullptr, where,
                       ": a backward pass already runs on context ", context_id);
  pass->start(edges, std::move(grads));
  return pass;
}

std::shared_ptr<void> hold_release(int64_t context_id) {
  (void)find_context(context_id, "hold_release");
  ReleaseHolds& holds = release_holds();
  {
    std::lock_guard<std::mutex> lock(holds.mutex);
    ++holds.contexts[context_id].tokens;
  }
  // A token without an object: only its deleter matters, run when the last copy ends.
  return std::shared_ptr<void>(nullptr, [context_id](void*) {
    ReleaseHolds& holds = release_holds();
    bool release = false;
    {
      std::lock_guard<std::mutex> lock(holds.mutex);
      auto held = holds.contexts.find(context_id);
      if (--held->second.tokens > 0) return;
      release = held->second.guard_gone;
      holds.contexts.erase(held);
    }
    if (release) release_here_and_everywhere(context_id);
  });
}

ReachedGradients gradients_if_reached(int64_t context_id) {
  if (auto context = Container::instance().find_unreleased(context_id)) {
    return context->reached_gradients();
  }
  return ReachedGradients();
}

}  // namespace detail

void backward(int64_t context_id, const std::vector<at::Tensor>& roots, bool retain_graph) {
  const std::chrono::milliseconds timeout = rpc::get_rpc_timeout();
  std::optional<std::chrono::steady_clock::time_point> deadline;
  if (timeout.count() > 0) deadline = std::chrono::steady_clock::now() + timeout;
  auto pass = detail::start_backward(context_id, roots, retain_graph, "dist_autograd::backward");
  if (!rpc::detail::wait_future(*pass->done(), deadline)) {
    const std::string waiting = pass->waiting_for();
    auto error = TimeoutError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                              "dist_autograd::backward on context " + std::to_string(context_id) +
                                  " did not finish within " + std::to_string(timeout.count()) +
                                  " ms; waiting for " + waiting);
    pass->fail(std::make_exception_ptr(error));
    throw error;
  }
  pass->done()->waitAndThrow();
}

c10::Dict<at::Tensor, at::Tensor> get_gradients(int64_t context_id) {
  return find_context(context_id, "dist_autograd::get_gradients")->gradients();
}

std::optional<int64_t> current_context_id() { return detail::current_context(); }

size_t context_count() { return detail::Container::instance().size(); }

std::map<std::string, int64_t> get_debug_info() {
  const auto contexts = detail::Container::instance().all();
  int64_t passes = 0;
  for (const auto& context : contexts) passes += context->running_pass() ? 1 : 0;
  return {{"num_autograd_contexts", static_cast<int64_t>(contexts.size())},
          {"num_current_backward_passes", passes}};
}

}  // namespace dist_autograd
}  // namespace distoptim
