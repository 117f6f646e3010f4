#pragma once

// The two autograd nodes a recorded RPC adds to the graph. A message carrying tensors that
// require grad gets a SendBackward on the side that sent it (its next edges lead to the sent
// tensors' own gradient edges) and a RecvBackward on the side that received it (the received
// tensors' grad_fn). In the backward pass the gradients reaching a RecvBackward travel to the
// sender's SendBackward of the same message id, which hands them on to its next edges.

#include <cstdint>
#include <string>
#include <vector>

#include <torch/csrc/autograd/function.h>

namespace distoptim {
namespace dist_autograd {
namespace detail {

class SendBackward : public torch::autograd::Node {
 public:
  /// `tensors`: the sent tensors that require grad, in message order.
  SendBackward(int64_t message_id, int peer, const std::vector<at::Tensor>& tensors);

  /// The gradients of the sent tensors pass on unchanged.
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;
  std::string name() const override { return "distoptim::dist_autograd::SendBackward"; }

  int64_t message_id() const { return message_id_; }
  int peer() const { return peer_; }

 private:
  int64_t message_id_;
  int peer_;
};

class RecvBackward : public torch::autograd::Node {
 public:
  RecvBackward(int64_t context_id, int64_t message_id, int peer,
               const std::vector<at::Tensor>& tensors);
  /// A node whose inputs are the gradients of `tensors` (received, detached from any graph),
  /// which it becomes the grad_fn of.
  static std::shared_ptr<RecvBackward> attach(int64_t context_id, int64_t message_id, int peer,
                                              const std::vector<at::Tensor>& tensors);

  /// Reached by LibTorch's local engine (loss.backward() instead of dist_autograd::backward):
  /// an error that says so.
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;
  std::string name() const override { return "distoptim::dist_autograd::RecvBackward"; }

  int64_t context_id() const { return context_id_; }
  int64_t message_id() const { return message_id_; }
  int peer() const { return peer_; }

 private:
  int64_t context_id_;
  int64_t message_id_;
  int peer_;
};

}  // namespace detail
}  // namespace dist_autograd
}  // namespace distoptim
