#pragma once

// One worker's part of one distributed backward pass over a context.
//
// Every worker reached runs its part of the graph once: the pass counts, for every node it can
// reach from its roots (the initiator's loss tensors, and every SendBackward of the context,
// each of which awaits one message), how many gradients it will get, and runs a node only once
// all of them are in. Each SendBackward gets exactly one message per pass, because every worker
// that holds the matching RecvBackward takes part: a pass that starts sends "begin" to the
// peers of its SendBackwards, and a RecvBackward the pass cannot reach tells its peer at once
// that no gradient will come (pytorch#27643: an unused remote result must not hang backward).
// Gradients that are all undefined skip a node's work and travel on as "none".
//
// The message that starts a pass on a worker is answered when that worker's part is done and
// every message it sent was answered; every other message is answered at once. These answers
// form a tree rooted at the initiator, so when backward() returns, every worker reached is done.
// No thread waits for a peer meanwhile: nodes run on whichever thread delivered their last input.

#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>

#include <distoptim/rpc/detail/reassigned_rows.h>

#include "functions.h"

namespace distoptim {
namespace dist_autograd {
namespace detail {

class Context;
class BackwardPass;

/// Names of the internal RPCs a pass sends.
constexpr const char* kGradientsFunction = "__distoptim.dist_autograd.gradients";
constexpr const char* kBeginFunction = "__distoptim.dist_autograd.begin";
constexpr const char* kReleaseFunction = "__distoptim.dist_autograd.release";
constexpr const char* kInternalPrefix = "__distoptim.dist_autograd.";

/// Registers the internal RPCs through which passes start and gradients arrive on this worker,
/// and contexts are released (engine_rpc.cpp). Once per process, at start-up (recorder.h's
/// install).
void register_engine_functions();

/// Checks `roots` (scalars that require grad), begins a pass on this worker's copy of the context
/// and starts it; the caller waits on the pass's done() (api.cpp, and RRef::backward's handler).
/// Errors (c10::ValueError, DistributedError if a pass runs) name `where`.
std::shared_ptr<BackwardPass> start_backward(int64_t context_id,
                                             const std::vector<at::Tensor>& roots,
                                             bool retain_graph, const char* where);

/// Fails the context's running pass and tells every worker it reached, except `except`, to
/// release it (they tell theirs). Does not wait.
void release_everywhere(const std::shared_ptr<Context>& context, int except = -1);

class BackwardPass : public std::enable_shared_from_this<BackwardPass> {
 public:
  BackwardPass(std::shared_ptr<Context> context, int64_t id, bool retain_graph);

  int64_t id() const { return id_; }
  bool retain_graph() const { return retain_graph_; }
  /// Completes (None) when this worker's part is done and every message it sent was answered;
  /// fails with the first error of the pass.
  const c10::intrusive_ptr<c10::ivalue::Future>& done() const { return done_; }

  /// Counts the dependencies from `roots` (fed with `root_grads`) and every SendBackward of the
  /// context, tells peers, and runs what is ready. Once, right after construction.
  void start(const torch::autograd::edge_list& roots, torch::autograd::variable_list root_grads);
  /// A peer's gradients for the SendBackward `message_id`: `grads[i]` for its input `slots[i]`;
  /// slots not named get none. c10::ValueError for a message id or gradient that does not fit.
  void receive(int64_t message_id, const std::vector<int64_t>& slots,
               std::vector<at::Tensor> grads);
  /// Ends the pass with `error` (done() fails); later messages of it are ignored.
  void fail(std::exception_ptr error);
  /// Fails the pass if it still waits for gradients from `peer`, which is gone.
  void peer_lost(int peer, const std::string& peer_name);
  /// What the pass still waits for, for a timeout's message.
  std::string waiting_for() const;
  /// The failure of the answer to message `number` (a timeout, a lost peer) with what that
  /// message was in front: the rpc layer's own text names only the pass's internal function.
  std::exception_ptr explain_failed_answer(std::exception_ptr error, uint64_t number) const;

 private:
  struct Pending {
    std::shared_ptr<torch::autograd::Node> node;
    int dependencies = 0;
    torch::autograd::variable_list inputs;
  };
  struct Delivery {
    torch::autograd::Edge edge;
    at::Tensor grad;
  };
  // A message to send once the mutex is released.
  struct Outgoing {
    int peer;
    std::string function;
    std::vector<c10::IValue> args;
    std::string what;
  };

  // A gradients message that came before the pass had started.
  struct Early {
    int64_t message_id;
    std::vector<int64_t> slots;
    std::vector<at::Tensor> grads;
  };

  // With mutex_ held.
  void accept(int64_t message_id, const std::vector<int64_t>& slots, std::vector<at::Tensor> grads);
  std::exception_ptr accept_early();
  void deliver(const torch::autograd::Edge& edge, at::Tensor grad);
  bool finish_if_done();
  Outgoing gradients_message(const RecvBackward& recv,
                             const torch::autograd::variable_list& grads) const;
  // Without mutex_ held.
  void run_ready();
  void execute(const std::shared_ptr<torch::autograd::Node>& node,
               torch::autograd::variable_list inputs, std::vector<Delivery>* deliveries,
               std::vector<Outgoing>* outgoing);
  void send(std::vector<Outgoing> messages);
  void complete();
  // Runs the context's pass callbacks (taken once the last node here has run).
  void run_callbacks(
      std::vector<std::function<c10::intrusive_ptr<c10::ivalue::Future>()>> callbacks);

  const std::shared_ptr<Context> context_;
  const int64_t id_;
  const bool retain_graph_;
  const c10::intrusive_ptr<c10::ivalue::Future> done_;
  // Taken before any node runs here: the rows a table hands to new keys from then on may be
  // named by the gradients this pass accumulates (Context::accumulate).
  const std::shared_ptr<const rpc::detail::ReassignedRowsPin> reassigned_rows_pin_;

  mutable std::mutex mutex_;
  std::unordered_map<torch::autograd::Node*, Pending> nodes_;
  std::map<int64_t, std::shared_ptr<SendBackward>> sends_waiting_;  // by message id
  std::deque<std::pair<std::shared_ptr<torch::autograd::Node>, torch::autograd::variable_list>>
      ready_;
  size_t nodes_left_ = 0;
  std::vector<Early> early_;
  std::map<uint64_t, std::string> unanswered_;  // messages sent and not answered, by number
  uint64_t sent_ = 0;
  bool running_ = false;  // a thread runs ready nodes
  bool started_ = false;
  bool finished_ = false;
  // The context's gradient listeners, taken when the pass starts; read-only after.
  std::unordered_map<const c10::TensorImpl*, std::vector<std::function<void()>>> listeners_;
  bool callbacks_taken_ = false;  // the context's pass callbacks were taken (after the last node)
  size_t callbacks_pending_ = 0;  // ... and these have not completed
};

}  // namespace detail
}  // namespace dist_autograd
}  // namespace distoptim
