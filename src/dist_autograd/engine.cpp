#include "engine.h"

#include <algorithm>
#include <set>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/input_metadata.h>

#include <distoptim/comm/errors.h>
#include <distoptim/rpc/api.h>

#include "context.h"

namespace distoptim {
namespace dist_autograd {
namespace detail {

namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

std::string worker_name(int id) {
  try {
    return "'" + rpc::get_worker_info(id).name + "'";
  } catch (const std::exception&) {
    return "worker id " + std::to_string(id);
  }
}

// A gradient for input `input_nr` of `node`, brought to the shape and dtype that input had in
// the forward pass, as LibTorch's engine does (a gradient of a broadcast input is summed down).
at::Tensor conform(const Node& node, uint32_t input_nr, at::Tensor grad, const char* from) {
  if (!grad.defined()) {
    return grad;
  }
  const torch::autograd::InputMetadata& metadata = node.input_metadata(input_nr);
  if (!metadata.is_same_shape(grad)) {
    TORCH_CHECK_VALUE(metadata.is_expandable_to_shape(grad), "distributed autograd: ", from,
                      " gives ", node.name(), " an ",
                      metadata.incompatible_shape_error_message(input_nr, grad).str());
    grad = metadata.reduce_grad(grad);
  }
  if (grad.scalar_type() != c10::typeMetaToScalarType(metadata.options().dtype())) {
    grad = grad.to(metadata.options().dtype());
  }
  return grad;
}

bool all_undefined(const variable_list& grads) {
  return std::none_of(grads.begin(), grads.end(), [](const at::Tensor& g) { return g.defined(); });
}

}  // namespace

BackwardPass::BackwardPass(std::shared_ptr<Context> context, int64_t id, bool retain_graph)
    : context_(std::move(context)),
      id_(id),
      retain_graph_(retain_graph),
      done_(c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get())),
      reassigned_rows_pin_(std::make_shared<const rpc::detail::ReassignedRowsPin>()) {}

void BackwardPass::start(const torch::autograd::edge_list& roots, variable_list root_grads) {
  std::vector<Outgoing> outgoing;
  std::exception_ptr early_error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_INTERNAL_ASSERT(!started_, "a backward pass starts once");
    started_ = true;
    listeners_ = context_->take_gradient_listeners();
    // Every node reachable from the roots and the SendBackwards, with the number of edges into it.
    std::vector<Node*> stack;
    auto visit = [&](const std::shared_ptr<Node>& node) -> Pending& {
      auto [it, inserted] = nodes_.try_emplace(node.get());
      if (inserted) {
        it->second.node = node;
        stack.push_back(node.get());
      }
      return it->second;
    };
    for (const Edge& edge : roots) {
      if (edge.is_valid()) ++visit(edge.function).dependencies;
    }
    std::set<int> send_peers;
    for (const auto& send : context_->sends()) {
      ++visit(send).dependencies;  // its one message
      sends_waiting_.emplace(send->message_id(), send);
      send_peers.insert(send->peer());
    }
    while (!stack.empty()) {
      Node* node = stack.back();
      stack.pop_back();
      for (const Edge& edge : node->next_edges()) {
        if (edge.is_valid()) ++visit(edge.function).dependencies;
      }
    }
    nodes_left_ = nodes_.size();
    // A RecvBackward out of reach gets no gradient in this pass: its peer learns so now.
    for (const auto& recv : context_->recvs()) {
      if (nodes_.count(recv.get()) == 0) {
        outgoing.push_back(gradients_message(*recv, {}));
      }
    }
    // The peers holding the RecvBackwards that feed our SendBackwards take part.
    for (int peer : send_peers) {
      outgoing.push_back(
          {peer,
           kBeginFunction,
           {c10::IValue(context_->id()), c10::IValue(id_), c10::IValue(retain_graph_)},
           "the start of the pass on " + worker_name(peer)});
    }
    for (size_t i = 0; i < roots.size(); ++i) {
      if (roots[i].is_valid()) deliver(roots[i], std::move(root_grads[i]));
    }
    early_error = accept_early();
  }
  if (early_error) {
    fail(early_error);
    return;
  }
  send(std::move(outgoing));
  run_ready();
}

void BackwardPass::receive(int64_t message_id, const std::vector<int64_t>& slots,
                           std::vector<at::Tensor> grads) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_) {
      return;
    }
    if (!started_) {
      // Another thread made this pass and is starting it: the message waits for the count.
      early_.push_back({message_id, slots, std::move(grads)});
      return;
    }
    accept(message_id, slots, std::move(grads));
  }
  run_ready();
}

void BackwardPass::accept(int64_t message_id, const std::vector<int64_t>& slots,
                          std::vector<at::Tensor> grads) {
  TORCH_CHECK_VALUE(slots.size() == grads.size(), "distributed autograd: a gradients message of ",
                    "context ", context_->id(), " names ", slots.size(), " slot(s) for ",
                    grads.size(), " gradient(s)");
  auto it = sends_waiting_.find(message_id);
  TORCH_CHECK_VALUE(it != sends_waiting_.end(), "distributed autograd: context ", context_->id(),
                    " has no send awaiting gradients for message ", message_id, " in pass ", id_,
                    " (unknown, or it got them already)");
  const std::shared_ptr<SendBackward> send = it->second;
  variable_list inputs(send->num_inputs());
  for (size_t i = 0; i < slots.size(); ++i) {
    TORCH_CHECK_VALUE(slots[i] >= 0 && static_cast<size_t>(slots[i]) < inputs.size() &&
                          !inputs[slots[i]].defined(),
                      "distributed autograd: a gradients message for message ", message_id,
                      " names slot ", slots[i], " of ", inputs.size(), " (or twice)");
    inputs[slots[i]] =
        conform(*send, static_cast<uint32_t>(slots[i]), std::move(grads[i]), "a gradients message");
  }
  sends_waiting_.erase(it);
  Pending& pending = nodes_.at(send.get());
  pending.inputs = std::move(inputs);
  if (--pending.dependencies == 0) {
    ready_.emplace_back(pending.node, std::move(pending.inputs));
  }
}

std::exception_ptr BackwardPass::accept_early() {
  try {
    for (Early& message : early_) {
      accept(message.message_id, message.slots, std::move(message.grads));
    }
    early_.clear();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

void BackwardPass::deliver(const Edge& edge, at::Tensor grad) {
  Pending& pending = nodes_.at(edge.function.get());
  if (grad.defined()) {
    if (pending.inputs.empty()) {
      pending.inputs.resize(pending.node->num_inputs());
    }
    at::Tensor& slot = pending.inputs.at(edge.input_nr);
    slot = slot.defined() ? add_gradients(slot, grad) : std::move(grad);
  }
  if (--pending.dependencies == 0) {
    variable_list inputs = std::move(pending.inputs);
    inputs.resize(pending.node->num_inputs());
    ready_.emplace_back(pending.node, std::move(inputs));
  }
}

void BackwardPass::run_ready() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (running_) {
    return;  // the thread running nodes picks up what was added
  }
  running_ = true;
  while (!ready_.empty() && !finished_) {
    auto [node, inputs] = std::move(ready_.front());
    ready_.pop_front();
    lock.unlock();
    std::vector<Delivery> deliveries;
    std::vector<Outgoing> outgoing;
    try {
      execute(node, std::move(inputs), &deliveries, &outgoing);
    } catch (...) {
      lock.lock();
      running_ = false;
      lock.unlock();
      fail(std::current_exception());
      return;
    }
    // Counted as unanswered before this node counts as run: the pass cannot finish in between.
    send(std::move(outgoing));
    lock.lock();
    if (finished_) break;
    for (Delivery& delivery : deliveries) {
      deliver(delivery.edge, std::move(delivery.grad));
    }
    --nodes_left_;
  }
  running_ = false;
  // Every node here has run, so every leaf gradient of this worker is in the context: the work
  // queued for the end of the local pass (DistributedDataParallel's reduction) runs now.
  std::vector<Context::PassCallback> callbacks;
  if (!finished_ && nodes_left_ == 0 && !callbacks_taken_) {
    callbacks_taken_ = true;
    callbacks = context_->take_pass_callbacks();
    callbacks_pending_ = callbacks.size();
  }
  const bool complete_now = finish_if_done();
  lock.unlock();
  if (complete_now) complete();
  if (!callbacks.empty()) run_callbacks(std::move(callbacks));
}

void BackwardPass::run_callbacks(std::vector<Context::PassCallback> callbacks) {
  for (auto& callback : callbacks) {
    c10::intrusive_ptr<c10::ivalue::Future> future;
    try {
      c10::AutoGradMode no_grad(false);
      future = callback();
    } catch (...) {
      fail(std::current_exception());
      return;
    }
    future->addCallback([weak = weak_from_this()](c10::ivalue::Future& finished) {
      auto self = weak.lock();
      if (!self) return;
      if (finished.hasError()) {
        self->fail(finished.exception_ptr());
        return;
      }
      bool complete_now;
      {
        std::lock_guard<std::mutex> lock(self->mutex_);
        --self->callbacks_pending_;
        complete_now = self->finish_if_done();
      }
      if (complete_now) self->complete();
    });
  }
}

void BackwardPass::execute(const std::shared_ptr<Node>& node, variable_list inputs,
                           std::vector<Delivery>* deliveries, std::vector<Outgoing>* outgoing) {
  c10::AutoGradMode no_grad(false);
  if (auto* recv = dynamic_cast<RecvBackward*>(node.get())) {
    outgoing->push_back(gradients_message(*recv, inputs));
    return;
  }
  if (auto* accumulate = dynamic_cast<torch::autograd::AccumulateGrad*>(node.get())) {
    if (inputs.size() == 1 && inputs[0].defined()) {
      at::Tensor grad =
          torch::autograd::AccumulateGrad::callHooks(accumulate->variable, std::move(inputs[0]));
      context_->accumulate(accumulate->variable, std::move(grad), reassigned_rows_pin_);
      // The variable's gradient of this pass is complete: the node runs once per pass.
      auto listeners = listeners_.find(accumulate->variable.unsafeGetTensorImpl());
      if (listeners != listeners_.end()) {
        for (const auto& listener : listeners->second) listener();
      }
    }
    return;
  }
  variable_list outputs;
  if (all_undefined(inputs)) {
    // Nothing flows through this node in this pass: skip its work, pass "none" on.
    outputs.resize(node->num_outputs());
    if (!retain_graph_) node->release_variables();
  } else {
    for (const auto& hook : node->pre_hooks()) {
      inputs = (*hook)(inputs);
    }
    const bool post_hooks = !node->post_hooks().empty();
    variable_list inputs_for_hooks = post_hooks ? inputs : variable_list();
    if (!retain_graph_) node->will_release_variables();
    outputs = (*node)(std::move(inputs));
    if (!retain_graph_) node->release_variables();
    for (const auto& hook : node->post_hooks()) {
      outputs = (*hook)(outputs, inputs_for_hooks);
    }
    TORCH_CHECK(outputs.size() == node->num_outputs(), "distributed autograd: ", node->name(),
                " returned ", outputs.size(), " gradient(s) for ", node->num_outputs(),
                " output(s)");
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    const Edge& edge = node->next_edge(i);
    if (!edge.is_valid()) continue;
    deliveries->push_back({edge, conform(*edge.function, edge.input_nr, std::move(outputs[i]),
                                         node->name().c_str())});
  }
}

BackwardPass::Outgoing BackwardPass::gradients_message(const RecvBackward& recv,
                                                       const variable_list& grads) const {
  std::vector<int64_t> slots;
  std::vector<at::Tensor> defined;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].defined()) {
      slots.push_back(static_cast<int64_t>(i));
      defined.push_back(grads[i]);
    }
  }
  return {recv.peer(),
          kGradientsFunction,
          {c10::IValue(context_->id()), c10::IValue(id_), c10::IValue(retain_graph_),
           c10::IValue(recv.message_id()), c10::IValue(c10::List<int64_t>(slots)),
           c10::IValue(c10::List<at::Tensor>(defined))},
          std::string(defined.empty() ? "\"no gradient\"" : "gradients") + " for message " +
              std::to_string(recv.message_id()) + " to " + worker_name(recv.peer())};
}

void BackwardPass::send(std::vector<Outgoing> messages) {
  for (Outgoing& message : messages) {
    uint64_t number;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (finished_) return;
      number = ++sent_;
      unanswered_.emplace(number, message.what);
    }
    c10::intrusive_ptr<c10::ivalue::Future> reply;
    try {
      reply = rpc::rpc_async_values(message.peer, message.function, std::move(message.args));
    } catch (...) {
      fail(std::current_exception());
      return;
    }
    reply->addCallback([weak = weak_from_this(), number](c10::ivalue::Future& answered) {
      auto self = weak.lock();
      if (!self) return;
      if (answered.hasError()) {
        self->fail(self->explain_failed_answer(answered.exception_ptr(), number));
        return;
      }
      bool complete_now;
      {
        std::lock_guard<std::mutex> lock(self->mutex_);
        self->unanswered_.erase(number);
        complete_now = self->finish_if_done();
      }
      if (complete_now) self->complete();
    });
  }
}

bool BackwardPass::finish_if_done() {
  if (finished_ || running_ || !started_ || nodes_left_ > 0 || !unanswered_.empty() ||
      !callbacks_taken_ || callbacks_pending_ > 0) {
    return false;
  }
  finished_ = true;
  return true;
}

void BackwardPass::complete() {
  context_->end_pass(this);
  done_->markCompleted(c10::IValue());
}

void BackwardPass::fail(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_) return;
    finished_ = true;
    ready_.clear();
  }
  context_->end_pass(this);
  done_->setError(std::move(error));
}

void BackwardPass::peer_lost(int peer, const std::string& peer_name) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool waiting =
        std::any_of(sends_waiting_.begin(), sends_waiting_.end(),
                    [&](const auto& entry) { return entry.second->peer() == peer; });
    if (finished_ || !waiting) return;
  }
  fail(std::make_exception_ptr(PeerLostError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                             "distributed autograd: worker '" + peer_name +
                                                 "' was lost before it sent its gradients "
                                                 "of context " +
                                                 std::to_string(context_->id()))));
}

std::exception_ptr BackwardPass::explain_failed_answer(std::exception_ptr error,
                                                       uint64_t number) const {
  std::string what = "message " + std::to_string(number);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = unanswered_.find(number);
    if (it != unanswered_.end()) what = it->second;
  }
  try {
    std::rethrow_exception(error);
  } catch (const DistributedError& e) {
    if (dynamic_cast<const TimeoutError*>(&e) == nullptr &&
        dynamic_cast<const PeerLostError*>(&e) == nullptr) {
      return error;  // a RemoteError, say, already says where and why
    }
    try {
      DISTOPTIM_RETHROW_WITH_CONTEXT(e, "dist_autograd::backward on context ", context_->id(),
                                     ": no answer to ", what, ": ");
    } catch (...) {
      return std::current_exception();
    }
  } catch (...) {
  }
  return error;
}

std::string BackwardPass::waiting_for() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::map<int, int> sends_by_peer;
  for (const auto& [id, send] : sends_waiting_) ++sends_by_peer[send->peer()];
  std::string out;
  for (const auto& [peer, count] : sends_by_peer) {
    out += (out.empty() ? "" : "; ") + std::string("gradients from ") + worker_name(peer) + " (" +
           std::to_string(count) + " message(s))";
  }
  for (const auto& [number, what] : unanswered_) {
    out += (out.empty() ? "" : "; ") + std::string("an answer to ") + what;
  }
  if (callbacks_pending_ > 0) {
    out += (out.empty() ? "" : "; ") + std::to_string(callbacks_pending_) +
           " end-of-pass callback(s) (DistributedDataParallel's gradient reduction)";
  }
  if (nodes_left_ > 0 && out.empty()) {
    out = std::to_string(nodes_left_) + " node(s) still to run";
  }
  return out;
}

}  // namespace detail
}  // namespace dist_autograd
}  // namespace distoptim
