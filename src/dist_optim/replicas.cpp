// replicate_steps (replicas.h): the trainer's side, which names each replicated parameter's copy
// and tells each primary's optimizer where to send its steps.

#include <distoptim/dist_optim/replicas.h>

#include <map>
#include <set>
#include <utility>

#include <c10/util/Exception.h>

#include <distoptim/rpc/api.h>
#include <distoptim/rpc/detail/rref_calls.h>

#include "owner_calls.h"
#include "step_mirror.h"

namespace distoptim {
namespace dist_optim {

void replicate_steps(DistributedOptimizer& optimizer,
                     const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                     const std::vector<rpc::RemoteModuleBase*>& modules,
                     const ReplicaOptions& options) {
  for (size_t t = 0; t < tables.size(); ++t) {
    TORCH_CHECK_VALUE(tables[t] != nullptr, "replicate_steps: tables[", t, "] is null");
  }
  for (size_t m = 0; m < modules.size(); ++m) {
    TORCH_CHECK_VALUE(modules[m] != nullptr, "replicate_steps: modules[", m, "] is null");
  }
  // The key of every parameter the tables and modules hold, by its reference's id.
  std::map<std::string, std::string> key_of;
  for (const rpc::ShardedEmbeddingBag* table : tables) {
    const std::vector<rpc::RRef<at::Tensor>> shards = table->remote_parameters();
    for (size_t s = 0; s < shards.size(); ++s) {
      key_of[rpc::detail::rref_global_id(shards[s].handle())] = table->shard_key(s);
    }
  }
  for (const rpc::RemoteModuleBase* module : modules) {
    const std::vector<rpc::RRef<at::Tensor>> params = module->owner_parameters();
    for (size_t j = 0; j < params.size(); ++j) {
      key_of[rpc::detail::rref_global_id(params[j].handle())] =
          module->module_key() + "/" + std::to_string(j);
    }
  }

  const std::vector<detail::OwnerOptimizer> owners = detail::OwnerAccess::owners(optimizer);
  const std::vector<rpc::RRef<at::Tensor>> params = optimizer.parameters();
  std::set<std::string> owner_names;
  for (const detail::OwnerOptimizer& owner : owners) owner_names.insert(owner.worker);
  for (const auto& [primary, backup] : options.backups()) {
    TORCH_CHECK_VALUE(owner_names.count(primary) > 0, "replicate_steps: a backup ('", backup,
                      "') for worker '", primary,
                      "', which owns none of the optimizer's parameters");
    TORCH_CHECK_VALUE(primary != backup, "replicate_steps: worker '", primary,
                      "' cannot be its own backup");
  }
  // Every key first, so that a parameter without one refuses the whole call.
  std::vector<const detail::OwnerOptimizer*> replicated;
  std::vector<std::vector<std::string>> keys;
  for (const detail::OwnerOptimizer& owner : owners) {
    if (options.backups().count(owner.worker) == 0) continue;
    std::vector<std::string> owner_keys;
    for (const int64_t position : owner.positions) {
      auto it = key_of.find(rpc::detail::rref_global_id(params[position].handle()));
      TORCH_CHECK_VALUE(it != key_of.end(), "replicate_steps: parameter ", position,
                        " of the optimizer (on worker '", owner.worker,
                        "', replicated) is no given table's shard and no given module's");
      owner_keys.push_back(it->second);
    }
    replicated.push_back(&owner);
    keys.push_back(std::move(owner_keys));
  }
  const std::string trainer = rpc::get_worker_info().name;
  std::vector<rpc::RpcFuture<c10::IValue>> calls;
  for (size_t k = 0; k < replicated.size(); ++k) {
    calls.push_back(detail::waited_method(replicated[k]->optimizer, "set_backup",
                                          {c10::IValue(options.backups().at(replicated[k]->worker)),
                                           rpc::to_value(keys[k]), c10::IValue(trainer)}));
  }
  detail::wait_all(
      calls, [&replicated](size_t k) -> const std::string& { return replicated[k]->worker; },
      "replicate_steps");
}

std::vector<std::string> replica_keys(const std::string& backup, const std::string& primary) {
  return detail::mirrored_keys(backup, primary);
}

at::Tensor replica_copy(const std::string& backup, const std::string& primary,
                        const std::string& key) {
  return detail::mirrored_copy(backup, primary, key);
}

}  // namespace dist_optim
}  // namespace distoptim
