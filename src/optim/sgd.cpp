#include <distoptim/optim/sgd.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/StringUtil.h>

#include "sparse_rows.h"
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

// Below this many elements a gradient with repeated rows is applied on the calling thread.
constexpr int64_t kParallelElements = int64_t{1} << 15;

// param.add_(grad, alpha) for a sparse gradient with dense dimensions (an embedding table's),
// as one pass over the named rows with LibTorch's rounding (sparse_rows.h), without its per-row
// calls. Returns false, touching nothing, where LibTorch takes another path (a gradient without
// dense dimensions, non-contiguous operands: its slow path coalesces first), left to add_.
bool add_sparse_rows(at::Tensor& param, const at::Tensor& grad, double alpha) {
  if (grad.sparse_dim() < 1 || grad.dense_dim() < 1 || !param.is_contiguous() ||
      param.numel() == 0 || !grad._values().is_contiguous() ||
      (param.scalar_type() != at::kFloat && param.scalar_type() != at::kDouble)) {
    return false;
  }
  const int64_t nnz = grad._nnz();
  if (nnz == 0) return true;
  const detail::SparseGradientRows rows = detail::gradient_rows(grad);
  const int64_t row_numel = rows.row_numel;
  const int64_t table_rows = param.numel() / row_numel;
  const bool repeats_possible = !grad.is_coalesced() && nnz > 1;
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "sgd", [&] {
    scalar_t* p = param.data_ptr<scalar_t>();
    const scalar_t* v = rows.values.data_ptr<scalar_t>();
    const int64_t* r = rows.rows.data_ptr<int64_t>();
    const auto a = static_cast<scalar_t>(alpha);
    if (!repeats_possible) {
      detail::for_each_row_range(nnz, row_numel, [&](int64_t begin, int64_t end) {
        detail::sgd_rows<scalar_t>(p, v, r, begin, end, row_numel, a, 0, table_rows, true);
      });
      return;
    }
    const int64_t threads = nnz * row_numel < kParallelElements ? 1 : at::get_num_threads();
    if (threads <= 1) {
      detail::sgd_rows<scalar_t>(p, v, r, 0, nnz, row_numel, a, 0, table_rows, true);
      return;
    }
    // Entries of one row land in order: each thread owns a range of rows and reads every index.
    at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
      detail::sgd_rows<scalar_t>(p, v, r, 0, nnz, row_numel, a, table_rows * first / threads,
                                 table_rows * last / threads, false);
    });
  });
  return true;
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
      const double alpha = o.maximize() ? o.lr() : -o.lr();
      if (!add_sparse_rows(param, *u.grad, alpha)) param.add_(*u.grad, alpha);
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
