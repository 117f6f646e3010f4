#include "remote_optimizer.h"

#include <mutex>

#include <c10/util/Exception.h>

#include <distoptim/dist_autograd/context.h>
#include <distoptim/optim/registry.h>
#include <distoptim/rpc/api.h>
#include <distoptim/rpc/classes.h>
#include <distoptim/rpc/detail/internal_registry.h>

namespace distoptim {
namespace dist_optim {
namespace detail {

namespace {

// Serializes the steps of every DistributedOptimizer in this process: two trainers may have built
// two optimizers over the same tensors.
std::mutex& step_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::vector<at::Tensor> local_values(const std::vector<rpc::RRef<at::Tensor>>& params) {
  std::vector<at::Tensor> values;
  values.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK_VALUE(params[i].is_owner(), "DistributedOptimizer: parameter ", i, " (",
                      params[i].owner().name, "'s) reached the optimizer of worker '",
                      rpc::get_worker_info().name, "'");
    values.push_back(params[i].local_value());
    TORCH_CHECK_VALUE(values.back().requires_grad() && values.back().is_leaf(),
                      "DistributedOptimizer: parameter ", i, " on worker '",
                      rpc::get_worker_info().name,
                      "' is not a leaf tensor that requires grad, so no gradient reaches it");
  }
  return values;
}

}  // namespace

RemoteOptimizer::RemoteOptimizer(std::string optimizer, std::vector<rpc::RRef<at::Tensor>> params,
                                 c10::IValue options)
    : optimizer_(optim::create_optimizer(optimizer, {optim::ParamGroup(local_values(params))},
                                         optim::OptionBag::from_ivalue(options))) {}

void RemoteOptimizer::step(int64_t context_id) {
  const c10::Dict<at::Tensor, at::Tensor> all = dist_autograd::get_gradients(context_id);
  std::vector<at::Tensor> gradients;
  gradients.reserve(optimizer_->params().size());
  for (const at::Tensor& param : optimizer_->params()) {
    auto it = all.find(param);
    gradients.push_back(it == all.end() ? at::Tensor() : it->value());
  }
  std::lock_guard<std::mutex> lock(step_mutex());
  rpc::InPlaceUpdateGuard no_reply_reads_meanwhile;
  optimizer_->step(gradients);
}

c10::IValue RemoteOptimizer::state_dict() {
  std::lock_guard<std::mutex> lock(step_mutex());
  return optimizer_->state_dict().to_ivalue();
}

void RemoteOptimizer::load_state_dict(c10::IValue state) {
  std::lock_guard<std::mutex> lock(step_mutex());
  optimizer_->load_state_dict(optim::OptimizerStateDict::from_ivalue(state));
}

namespace {
bool register_remote_optimizer() {
  rpc::detail::register_internal_class<RemoteOptimizer, std::string,
                                       std::vector<rpc::RRef<at::Tensor>>, c10::IValue>(
      kRemoteOptimizerClass);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "step", &RemoteOptimizer::step);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "state_dict",
                                        &RemoteOptimizer::state_dict);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "load_state_dict",
                                        &RemoteOptimizer::load_state_dict);
  return true;
}
}  // namespace

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim

// Registered at start-up, so that an owner which never builds a DistributedOptimizer itself (a
// parameter server) can host one. The linker is told to keep this symbol (CMakeLists.txt).
extern "C" const bool distoptim_dist_optim_registered =  // NOLINT: a C name, kept by the linker
    distoptim::dist_optim::detail::register_remote_optimizer();
