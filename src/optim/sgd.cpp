#include <distoptim/optim/sgd.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/StringUtil.h>

#include "update_common.h"

namespace distoptim {
namespace optim {

namespace {

using kernels::Algorithm;
using kernels::UpdateTask;

uint32_t sgd_flags(const SGDOptions& o) {
  uint32_t flags = 0;
  if (o.maximize()) flags |= kernels::kMaximize;
  if (o.weight_decay() != 0) flags |= kernels::kWeightDecay;
  if (o.momentum() != 0) flags |= kernels::kSgdMomentum;
  if (o.nesterov()) flags |= kernels::kSgdNesterov;
  return flags;
}

kernels::SgdParams sgd_params(const SGDOptions& o) {
  kernels::SgdParams args;
  args.lr = o.lr();
  args.weight_decay = o.weight_decay();
  args.momentum = o.momentum();
  args.one_minus_dampening = 1 - o.dampening();
  return args;
}

// One SGD step over parameters whose momentum buffers (when momentum != 0) may still be
// undefined: those are created here and filled by the kernel's first-step variant, so the
// first step too is a single pass.
void run_sgd(const std::vector<const at::Tensor*>& params,
             const std::vector<const at::Tensor*>& grads, const std::vector<at::Tensor*>& buffers,
             const SGDOptions& o) {
  const bool momentum = o.momentum() != 0;
  const uint32_t flags = sgd_flags(o);
  const kernels::SgdParams args = sgd_params(o);
  kernels::UpdateBatch batch;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = *params[i];
    uint32_t item_flags = flags;
    const at::Tensor* operands[3] = {&p, grads[i], buffers[i]};
    int num_operands = 2;
    if (momentum) {
      if (!buffers[i]->defined()) {
        *buffers[i] = detail::new_state_buffer(p);
        item_flags |= kernels::kSgdFirstStep;
      }
      num_operands = 3;
    }
    UpdateTask& task =
        batch.add(kernels::select_kernel(Algorithm::kSgd, p.scalar_type(), item_flags), operands,
                  num_operands);
    task.params.sgd = args;
  }
  batch.run();
}

}  // namespace

namespace functional {
void sgd(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
         std::vector<at::Tensor>& momentum_buffers, const SGDOptions& options) {
  options.validate();
  detail::check_lists("functional::sgd", params, grads, {});
  TORCH_CHECK_VALUE(momentum_buffers.size() == params.size(),
                    "functional::sgd: ", momentum_buffers.size(), " momentum_buffers for ",
                    params.size(), " params");
  std::vector<const at::Tensor*> p(params.size()), g(params.size());
  std::vector<at::Tensor*> b(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    p[i] = &params[i];
    g[i] = &grads[i];
    b[i] = &momentum_buffers[i];
  }
  run_sgd(p, g, b, options);
}
}  // namespace functional

SGD::SGD(std::vector<ParamGroup> groups, const SGDOptions& defaults)
    : TypedFunctionalOptimizer("sgd", {"momentum_buffer"}, defaults) {
  defaults.validate();
  for (const auto& g : groups) add_param_group(g);
}

void SGD::update(size_t group, const std::vector<ParamUpdate>& updates) {
  const SGDOptions& o = options(group);
  const bool momentum = o.momentum() != 0;
  detail::KernelChoice kernel(Algorithm::kSgd, sgd_flags(o));
  detail::KernelChoice first_step_kernel(Algorithm::kSgd, sgd_flags(o) | kernels::kSgdFirstStep);
  const kernels::SgdParams args = sgd_params(o);
  for (const auto& u : updates) {
    // A momentum buffer created now (zeros) is set to the gradient by the first-step variant.
    const bool first_step = momentum && !u.state->buffers[0].defined();
    // SGD's state has no step count, as in torch.optim.
    UpdateTask& task =
        detail::add_stateful_task(step_cache(), u, first_step ? first_step_kernel : kernel,
                                  {{momentum ? 0 : -1}}, /*count_step=*/false);
    task.params.sgd = args;
  }
}

std::string SGD::sparse_gradient_refusal(size_t group) const {
  const SGDOptions& o = options(group);
  if (o.weight_decay() == 0) return "";
  return c10::str("sgd does not support sparse gradients with weight_decay=", o.weight_decay(),
                  " (neither does PyTorch)");
}

void SGD::update_sparse(size_t group, const std::vector<ParamUpdate>& updates) {
  const SGDOptions& o = options(group);
  for (const auto& u : updates) {
    at::Tensor param = *u.param;
    if (o.momentum() == 0) {
      // torch.optim.SGD's param.add_(d_p, alpha=-lr) with d_p sparse: only the named rows.
      param.add_(*u.grad, o.maximize() ? o.lr() : -o.lr());
      continue;
    }
    // Momentum decays every row, so the update is dense whatever the gradient.
    at::Tensor grad = u.grad->to_dense();
    if (o.maximize()) grad.neg_();
    at::Tensor& buffer = u.state->buffers[0];
    if (!buffer.defined()) {
      buffer = detail::new_state_buffer(param);
      buffer.copy_(grad);
    } else {
      buffer.mul_(o.momentum()).add_(grad, 1 - o.dampening());
    }
    param.add_(o.nesterov() ? grad.add(buffer, o.momentum()) : buffer, -o.lr());
  }
}

}  // namespace optim
}  // namespace distoptim
