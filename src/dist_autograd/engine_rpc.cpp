// The engine's side of the wire: the internal RPCs through which a backward pass starts on a
// worker and its gradients arrive there, and the release of a context on every worker it reached.
// The interceptor that records the send/recv pairs these serve is recorder.cpp.

#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>
#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>
#include <distoptim/rpc/api.h>
#include <distoptim/rpc/detail/internal_registry.h>
#include <distoptim/rpc/rref.h>
#include <distoptim/rpc/values.h>

#include "context.h"
#include "engine.h"

namespace distoptim {
namespace dist_autograd {
namespace detail {
namespace {

// The answer to a message of pass `pass_id`: the pass's completion if this message started it
// here, else at once.
c10::intrusive_ptr<c10::ivalue::Future> answer(const std::shared_ptr<BackwardPass>& pass,
                                               bool started) {
  if (started) return pass->done();
  auto now = c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
  now->markCompleted(c10::IValue());
  return now;
}

std::shared_ptr<Context> context_of_message(int64_t context_id) {
  std::shared_ptr<Context> context = Container::instance().find(context_id);
  TORCH_CHECK_VALUE(context != nullptr, "distributed autograd: no context ", context_id,
                    " on this worker (released, or never reached it)");
  return context;
}

c10::intrusive_ptr<c10::ivalue::Future> on_gradients(int64_t context_id, int64_t pass_id,
                                                     bool retain_graph, int64_t message_id,
                                                     std::vector<int64_t> slots,
                                                     std::vector<at::Tensor> grads) {
  std::shared_ptr<Context> context = context_of_message(context_id);
  bool started = false;
  std::shared_ptr<BackwardPass> pass = context->pass_for(pass_id, retain_graph, &started);
  TORCH_CHECK_VALUE(pass != nullptr, "distributed autograd: gradients of context ", context_id,
                    " for pass ", pass_id, ", which has finished on this worker");
  if (started) pass->start({}, {});
  pass->receive(message_id, slots, std::move(grads));
  return answer(pass, started);
}

c10::intrusive_ptr<c10::ivalue::Future> on_begin(int64_t context_id, int64_t pass_id,
                                                 bool retain_graph) {
  std::shared_ptr<Context> context = context_of_message(context_id);
  bool started = false;
  std::shared_ptr<BackwardPass> pass = context->pass_for(pass_id, retain_graph, &started);
  if (!pass) return answer(nullptr, false);  // this worker's part of that pass is done
  if (started) pass->start({}, {});
  return answer(pass, started);
}

// RRef<at::Tensor>::backward with a context id, on the owner: the pass starts from the value
// and the caller's answer goes when it is done (no thread waits meanwhile).
c10::intrusive_ptr<c10::ivalue::Future> on_rref_backward(const rpc::RRef<c10::IValue>& rref,
                                                         int64_t context_id, bool retain_graph) {
  const c10::IValue value = rref.local_value();
  TORCH_CHECK_VALUE(value.isTensor(), "RRef::backward: the value of ",
                    rpc::detail::describe_rref(rref.handle()), " is not a tensor but ",
                    value.tagKind());
  return start_backward(context_id, {value.toTensor()}, retain_graph, "RRef::backward")->done();
}

}  // namespace

void release_everywhere(const std::shared_ptr<Context>& context, int except) {
  if (auto pass = context->running_pass()) {
    pass->fail(std::make_exception_ptr(
        DistributedError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                         "distributed autograd: context " + std::to_string(context->id()) +
                             " was released during a backward pass")));
  }
  int me = -1;
  try {
    me = rpc::get_worker_info().id;
  } catch (const std::exception&) {
    return;  // no agent: nothing to tell
  }
  for (int worker : context->workers()) {
    if (worker == me || worker == except) continue;
    try {
      // Not waited for: a worker that is gone has dropped the context with its creator's loss.
      rpc::rpc_async_values(worker, kReleaseFunction,
                            {c10::IValue(context->id()), c10::IValue(me)});
    } catch (const std::exception&) {
    }
  }
}

void register_engine_functions() {
  rpc::detail::register_internal_function(
      kGradientsFunction, [](std::vector<c10::IValue> args) -> c10::IValue {
        TORCH_CHECK_TYPE(args.size() == 6, "takes 6 arguments");
        return on_gradients(rpc::from_value<int64_t>(args[0], "the context id"),
                            rpc::from_value<int64_t>(args[1], "the pass id"),
                            rpc::from_value<bool>(args[2], "retain_graph"),
                            rpc::from_value<int64_t>(args[3], "the message id"),
                            rpc::from_value<std::vector<int64_t>>(args[4], "the gradients' slots"),
                            rpc::from_value<std::vector<at::Tensor>>(args[5], "the gradients"));
      });
  rpc::detail::register_internal_function(
      kBeginFunction, [](std::vector<c10::IValue> args) -> c10::IValue {
        TORCH_CHECK_TYPE(args.size() == 3, "takes 3 arguments");
        return on_begin(rpc::from_value<int64_t>(args[0], "the context id"),
                        rpc::from_value<int64_t>(args[1], "the pass id"),
                        rpc::from_value<bool>(args[2], "retain_graph"));
      });
  rpc::detail::register_internal_function(
      rpc::detail::kRRefBackward, [](std::vector<c10::IValue> args) -> c10::IValue {
        TORCH_CHECK_TYPE(args.size() == 3, "takes 3 arguments");
        return on_rref_backward(rpc::from_value<rpc::RRef<c10::IValue>>(args[0], "the RRef"),
                                rpc::from_value<int64_t>(args[1], "the context id"),
                                rpc::from_value<bool>(args[2], "retain_graph"));
      });
  rpc::detail::register_internal_function(
      kReleaseFunction, [](std::vector<c10::IValue> args) -> c10::IValue {
        TORCH_CHECK_TYPE(args.size() == 2, "takes 2 arguments");
        const auto id = rpc::from_value<int64_t>(args[0], "the context id");
        const auto from = rpc::from_value<int64_t>(args[1], "the sender");
        if (auto context = Container::instance().release(id)) {
          release_everywhere(context, static_cast<int>(from));
        }
        return c10::IValue();
      });
}

}  // namespace detail
}  // namespace dist_autograd
}  // namespace distoptim
