#include <distoptim/optim/adadelta.h>

#include "update_common.h"

namespace distoptim {
namespace optim {

namespace {

using kernels::Algorithm;
using kernels::UpdateTask;

// items[i].operands: param, grad, square_avg, acc_delta.
void run_adadelta(const std::vector<detail::UpdateItem>& items, const AdadeltaOptions& o) {
  uint32_t flags = 0;
  if (o.maximize()) flags |= kernels::kMaximize;
  if (o.weight_decay() != 0) flags |= kernels::kWeightDecay;
  kernels::UpdateBatch batch;
  for (const auto& item : items) {
    const at::Tensor& p = *item.operands[0];
    UpdateTask& task =
        batch.add(kernels::select_kernel(Algorithm::kAdadelta, p.scalar_type(), flags),
                  item.operands, item.num_operands);
    kernels::AdadeltaParams& args = task.params.adadelta;
    args.weight_decay = o.weight_decay();
    args.rho = o.rho();
    args.one_minus_rho = 1 - o.rho();
    args.eps = o.eps();
    args.lr = o.lr();
  }
  batch.run();
}

}  // namespace

namespace functional {
void adadelta(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
              const std::vector<at::Tensor>& square_avgs, const std::vector<at::Tensor>& acc_deltas,
              const AdadeltaOptions& options) {
  options.validate();
  detail::check_lists("functional::adadelta", params, grads,
                      {{"square_avgs", &square_avgs}, {"acc_deltas", &acc_deltas}});
  const auto items = detail::items_from_lists(params, grads, {&square_avgs, &acc_deltas});
  run_adadelta(items, options);
}
}  // namespace functional

Adadelta::Adadelta(std::vector<ParamGroup> groups, const AdadeltaOptions& defaults)
    : TypedFunctionalOptimizer("adadelta", {"square_avg", "acc_delta"}, defaults) {
  defaults.validate();
  for (const auto& g : groups) add_param_group(g);
}

void Adadelta::update(size_t group, const std::vector<ParamUpdate>& updates) {
  std::vector<detail::UpdateItem> items;
  items.reserve(updates.size());
  for (const auto& u : updates) items.push_back(detail::stateful_item(u, {{0}, {1}}));
  run_adadelta(items, options(group));
}

}  // namespace optim
}  // namespace distoptim
