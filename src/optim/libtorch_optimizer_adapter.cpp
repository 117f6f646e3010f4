#include <distoptim/optim/libtorch_optimizer_adapter.h>

#include <c10/util/Exception.h>

namespace distoptim {
namespace optim {

namespace {

constexpr const char* kName = "libtorch";

std::unique_ptr<torch::optim::Optimizer> not_null(
    std::unique_ptr<torch::optim::Optimizer> optimizer) {
  TORCH_CHECK_VALUE(optimizer != nullptr, "LibTorchOptimizerAdapter: optimizer is null");
  return optimizer;
}

}  // namespace

LibTorchOptimizerAdapter::LibTorchOptimizerAdapter(
    std::unique_ptr<torch::optim::Optimizer> optimizer)
    : FunctionalOptimizer(kName, {}, OptionBag()), optimizer_(not_null(std::move(optimizer))) {
  for (const auto& group : optimizer_->param_groups()) {
    add_param_group(ParamGroup(group.params()));
  }
  mirroring_ = false;
}

void LibTorchOptimizerAdapter::check_options(const OptionBag& resolved) const {
  TORCH_CHECK_VALUE(resolved.items().empty(), kName, ": options (", resolved.to_string(),
                    ") cannot be given in an OptionBag to a LibTorch optimizer; set them on the "
                    "torch::optim::Optimizer, whose groups take its defaults");
}

void LibTorchOptimizerAdapter::on_group_options(size_t /*group*/, const OptionBag& /*resolved*/) {}

void LibTorchOptimizerAdapter::on_group_added(size_t group) {
  if (mirroring_) return;
  std::vector<at::Tensor> params;
  for (int64_t i : group_param_indices(group)) params.push_back(this->params()[i]);
  optimizer_->add_param_group(torch::optim::OptimizerParamGroup(params));
}

void LibTorchOptimizerAdapter::check_portable_state(const char* method) const {
  TORCH_CHECK_VALUE(false, kName, ".", method,
                    ": a LibTorch torch::optim::Optimizer keys its state by tensor address, "
                    "which cannot be gathered, resharded or loaded elsewhere; save the LibTorch "
                    "optimizer itself (torch::save)");
}

void LibTorchOptimizerAdapter::update(size_t /*group*/,
                                      const std::vector<ParamUpdate>& /*updates*/) {
  // apply_updates steps every group at once, as LibTorch's step() does.
  TORCH_INTERNAL_ASSERT(false, "LibTorchOptimizerAdapter::update is never called");
}

void LibTorchOptimizerAdapter::apply_updates(
    const std::vector<std::vector<ParamUpdate>>& by_group) {
  const std::vector<at::Tensor>& all = params();
  std::vector<at::Tensor> lent(all.size());
  bool any = false;
  for (const auto& updates : by_group) {
    for (const ParamUpdate& u : updates) lent[u.index] = *u.grad;
    any = any || !updates.empty();
  }
  if (!any) return;  // As for every FunctionalOptimizer: no gradient, no step.
  std::vector<at::Tensor> saved(all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    at::Tensor param = all[i];  // shares the TensorImpl: .grad is the parameter's own
    saved[i] = param.grad();
    param.mutable_grad() = lent[i];
  }
  auto give_back = [&] {
    for (size_t i = 0; i < all.size(); ++i) {
      at::Tensor param = all[i];
      param.mutable_grad() = saved[i];
    }
  };
  try {
    optimizer_->step();
  } catch (...) {
    give_back();
    throw;
  }
  give_back();
}

}  // namespace optim
}  // namespace distoptim
