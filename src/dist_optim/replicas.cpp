// replicate_steps (replicas.h): the trainer's side, which names each replicated parameter's copy
// and tells each primary's optimizer where to send its steps.

#include <distoptim/dist_optim/replicas.h>

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include <c10/util/Exception.h>

#include <distoptim/rpc/api.h>
#include <distoptim/rpc/detail/rref_calls.h>

#include "owner_calls.h"
#include "replicated_owners.h"
#include "step_mirror.h"

namespace distoptim {
namespace dist_optim {

namespace detail {

std::vector<ReplicatedOwner> replicated_owners(const DistributedOptimizer& optimizer,
                                               const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                                               const std::vector<rpc::RemoteModuleBase*>& modules,
                                               const std::vector<std::string>& workers,
                                               const char* what) {
  for (size_t t = 0; t < tables.size(); ++t) {
    TORCH_CHECK_VALUE(tables[t] != nullptr, what, ": tables[", t, "] is null");
  }
  for (size_t m = 0; m < modules.size(); ++m) {
    TORCH_CHECK_VALUE(modules[m] != nullptr, what, ": modules[", m, "] is null");
  }
  // The key of every table shard, by its reference's id (a table keeps its references).
  std::map<std::string, std::string> shard_key_of;
  for (const rpc::ShardedEmbeddingBag* table : tables) {
    const std::vector<rpc::RRef<at::Tensor>> shards = table->remote_parameters();
    for (size_t s = 0; s < shards.size(); ++s) {
      shard_key_of[rpc::detail::rref_global_id(shards[s].handle())] = table->shard_key(s);
    }
  }
  const std::vector<OwnerOptimizer> owners = OwnerAccess::owners(optimizer);
  const std::vector<rpc::RRef<at::Tensor>> params = optimizer.parameters();
  std::vector<ReplicatedOwner> out;
  for (const std::string& worker : workers) {
    auto owner = std::find_if(owners.begin(), owners.end(),
                              [&worker](const OwnerOptimizer& o) { return o.worker == worker; });
    TORCH_CHECK_VALUE(owner != owners.end(), what, ": worker '", worker,
                      "' owns none of the optimizer's parameters");
    // The parameters that are no table's shard are, in the optimizer's order, those of the
    // modules on the worker in the order of `modules` (as recovery.h makes them anew).
    std::vector<std::string> module_keys;
    for (const rpc::RemoteModuleBase* module : modules) {
      if (module->remote_device().worker_name != worker) continue;
      const size_t count = module->owner_parameters().size();
      for (size_t j = 0; j < count; ++j) {
        module_keys.push_back(module->module_key() + "/" + std::to_string(j));
      }
    }
    ReplicatedOwner replicated{*owner, {}};
    size_t next_module_key = 0;
    for (const int64_t position : owner->positions) {
      auto it = shard_key_of.find(rpc::detail::rref_global_id(params[position].handle()));
      if (it != shard_key_of.end()) {
        replicated.keys.push_back(it->second);
      } else {
        TORCH_CHECK_VALUE(next_module_key < module_keys.size(), what, ": parameter ", position,
                          " of the optimizer (on worker '", worker,
                          "', replicated) is no given table's shard, and the modules given on "
                          "that worker have ",
                          module_keys.size(), " parameters in all");
        replicated.keys.push_back(module_keys[next_module_key++]);
      }
    }
    TORCH_CHECK_VALUE(next_module_key == module_keys.size(), what,
                      ": the modules given on worker '", worker, "' have ", module_keys.size(),
                      " parameters; the optimizer holds ", next_module_key,
                      " of that worker's that are no table's shard");
    out.push_back(std::move(replicated));
  }
  return out;
}

void load_from_backup(DistributedOptimizer& optimizer,
                      const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                      const std::vector<rpc::RemoteModuleBase*>& modules, const BackupLoad& load) {
  const std::string& worker = load.worker;
  const ReplicatedOwner replicated =
      replicated_owners(optimizer, tables, modules, {worker}, kRecoverFromBackup).at(0);
  const rpc::RRef<RemoteOptimizer>& remote = replicated.owner.optimizer;
  // The parameters loaded: all, or those the load names by key.
  std::vector<int64_t> indices;
  for (size_t i = 0; i < replicated.keys.size(); ++i) {
    if (load.keys.empty() || load.keys.count(replicated.keys[i]) > 0) {
      indices.push_back(static_cast<int64_t>(i));
    }
  }
  auto each_index = [&](const std::string& method, auto args_of) {
    std::vector<rpc::RpcFuture<c10::IValue>> calls;
    for (const int64_t i : indices) calls.push_back(waited_method(remote, method, args_of(i)));
    wait_all(
        calls, [&worker](size_t) -> const std::string& { return worker; }, kRecoverFromBackup);
  };
  try {
    each_index("stage_from_backup", [&](int64_t i) {
      return std::vector<c10::IValue>{
          i, load.backup, load.primary, replicated.keys[i], load.state_owner, load.with_value};
    });
  } catch (...) {
    try {
      each_index("drop_staged", [](int64_t i) { return std::vector<c10::IValue>{i}; });
    } catch (const c10::Error&) {
      // The owner is gone or refuses: what it staged goes with it.
    }
    throw;
  }
  each_index(load.with_value ? "commit_staged" : "commit_staged_state",
             [](int64_t i) { return std::vector<c10::IValue>{i}; });
}

std::vector<std::string> primaries(const DistributedOptimizer& optimizer,
                                   const ReplicaOptions& options) {
  std::set<std::string> owners;
  for (const OwnerOptimizer& owner : OwnerAccess::owners(optimizer)) owners.insert(owner.worker);
  std::vector<std::string> workers;
  for (const auto& [primary, backup] : options.backups()) {
    TORCH_CHECK_VALUE(primary != backup, "replicate_steps: worker '", primary,
                      "' cannot be its own backup");
    // Under hot standby a primary's parts may have moved to its backup: it holds none now.
    if (options.continue_without_backup() && owners.count(primary) == 0) continue;
    workers.push_back(primary);
  }
  return workers;
}

void set_backups(DistributedOptimizer& optimizer,
                 const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                 const std::vector<rpc::RemoteModuleBase*>& modules, const ReplicaOptions& options,
                 bool restored_from_them) {
  const std::vector<std::string> workers = primaries(optimizer, options);
  // Every key first, so that a parameter without one refuses the whole call.
  const std::vector<ReplicatedOwner> replicated =
      replicated_owners(optimizer, tables, modules, workers, "replicate_steps");
  const std::string trainer = rpc::get_worker_info().name;
  std::vector<rpc::RpcFuture<c10::IValue>> calls;
  for (const ReplicatedOwner& r : replicated) {
    calls.push_back(
        waited_method(r.owner.optimizer, "set_backup",
                      {c10::IValue(options.backups().at(r.owner.worker)), rpc::to_value(r.keys),
                       c10::IValue(trainer), c10::IValue(restored_from_them),
                       c10::IValue(options.continue_without_backup())}));
  }
  wait_all(
      calls, [&replicated](size_t k) -> const std::string& { return replicated[k].owner.worker; },
      "replicate_steps");
}

}  // namespace detail

void replicate_steps(DistributedOptimizer& optimizer,
                     const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                     const std::vector<rpc::RemoteModuleBase*>& modules,
                     const ReplicaOptions& options) {
  detail::set_backups(optimizer, tables, modules, options, /*restored_from_them=*/false);
}

void take_over_replicated_state(DistributedOptimizer& optimizer,
                                const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                                const std::vector<rpc::RemoteModuleBase*>& modules,
                                const ReplicaOptions& options, const std::string& predecessor) {
  const std::string me = rpc::get_worker_info().name;
  TORCH_CHECK_VALUE(predecessor != me, "take_over_replicated_state: the predecessor '", predecessor,
                    "' is this trainer itself");
  const std::vector<std::string> primaries = detail::primaries(optimizer, options);
  for (const std::string& primary : primaries) {
    detail::load_from_backup(
        optimizer, tables, modules,
        {primary, options.backups().at(primary), primary, {}, /*with_value=*/false, predecessor});
  }
  detail::set_backups(optimizer, tables, modules, options, /*restored_from_them=*/false);
  // The predecessor steps no more: its copies would only hold the backups' memory.
  for (const std::string& primary : primaries) {
    detail::drop_mirrored_state(options.backups().at(primary), primary, predecessor);
  }
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
