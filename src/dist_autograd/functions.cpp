#include "functions.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

namespace distoptim {
namespace dist_autograd {
namespace detail {

namespace {
torch::autograd::edge_list gradient_edges(const std::vector<at::Tensor>& tensors) {
  torch::autograd::edge_list edges;
  edges.reserve(tensors.size());
  for (const at::Tensor& tensor : tensors) {
    edges.push_back(torch::autograd::impl::gradient_edge(tensor));
  }
  return edges;
}
}  // namespace

SendBackward::SendBackward(int64_t message_id, int peer, const std::vector<at::Tensor>& tensors)
    : Node(gradient_edges(tensors)), message_id_(message_id), peer_(peer) {
  for (const at::Tensor& tensor : tensors) {
    add_input_metadata(tensor);
  }
}

torch::autograd::variable_list SendBackward::apply(torch::autograd::variable_list&& grads) {
  return std::move(grads);
}

RecvBackward::RecvBackward(int64_t context_id, int64_t message_id, int peer,
                           const std::vector<at::Tensor>& tensors)
    : context_id_(context_id), message_id_(message_id), peer_(peer) {
  for (const at::Tensor& tensor : tensors) {
    add_input_metadata(tensor);
  }
}

std::shared_ptr<RecvBackward> RecvBackward::attach(int64_t context_id, int64_t message_id, int peer,
                                                   const std::vector<at::Tensor>& tensors) {
  auto node = std::make_shared<RecvBackward>(context_id, message_id, peer, tensors);
  for (size_t i = 0; i < tensors.size(); ++i) {
    torch::autograd::impl::set_gradient_edge(tensors[i], {node, static_cast<uint32_t>(i)});
  }
  return node;
}

torch::autograd::variable_list RecvBackward::apply(torch::autograd::variable_list&& /*grads*/) {
  TORCH_CHECK(false, "a tensor received over RPC in distributed autograd context ", context_id_,
              " (message ", message_id_,
              ") has its gradient sent back only by distoptim::dist_autograd::backward(), not by "
              "LibTorch's local backward()");
}

}  // namespace detail
}  // namespace dist_autograd
}  // namespace distoptim
