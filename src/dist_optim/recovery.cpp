// Binding trainers to an owner that was started again (recovery.h): the trainers' side, and the
// restarted owner's board through which one trainer restores its shards and modules and the
// others take them.

#include <distoptim/dist_optim/recovery.h>

#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>
#include <distoptim/dist_optim/snapshot.h>
#include <distoptim/rpc/api.h>
#include <distoptim/rpc/detail/internal_registry.h>
#include <distoptim/rpc/detail/rref_calls.h>
#include <distoptim/rpc/errors.h>

#include "replicated_owners.h"
#include "snapshot_calls.h"
#include "step_mirror.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

namespace {

using Clock = std::chrono::steady_clock;

// The restarted owner's board (one per process: a new incarnation starts with an empty one).
constexpr const char* kClaim = "__distoptim.recovery.claim";
constexpr const char* kPublish = "__distoptim.recovery.publish";
constexpr const char* kObject = "__distoptim.recovery.object";
constexpr const char* kRelease = "__distoptim.recovery.release";
// A claim's outcome, and the board's state.
constexpr int64_t kYouRestore = 0, kAnotherRestores = 1, kRestored = 2;
constexpr std::chrono::milliseconds kPoll{20};

struct Board {
  std::mutex mutex;
  std::string claimant;  // the trainer restoring this owner's shards and modules; empty: none
  bool restored = false;
  int64_t snapshot_step = -1;
  std::map<std::string, c10::IValue> objects;  // by shard or module key
};

Board& board() {
  static Board* instance = new Board();  // never destroyed: requests may run at exit
  return *instance;
}

// [outcome, claimant, snapshot step]. `stale`: a claimant the caller found gone from the group,
// whose claim passes to the caller. An empty `caller` only asks.
c10::IValue on_claim(const std::string& caller, const std::string& stale) {
  Board& b = board();
  std::lock_guard<std::mutex> lock(b.mutex);
  int64_t outcome = kRestored;
  if (!b.restored && caller.empty()) {
    outcome = kAnotherRestores;  // a query: nothing is claimed
  } else if (!b.restored) {
    if (b.claimant.empty() || b.claimant == caller || (!stale.empty() && b.claimant == stale)) {
      b.claimant = caller;
      outcome = kYouRestore;
    } else {
      outcome = kAnotherRestores;
    }
  }
  return c10::ivalue::Tuple::create({outcome, b.claimant, b.snapshot_step});
}

// A restorer that failed gives its claim back, so that the next trainer that asks restores.
void on_release(const std::string& caller) {
  Board& b = board();
  std::lock_guard<std::mutex> lock(b.mutex);
  if (!b.restored && b.claimant == caller) b.claimant.clear();
}

void on_publish(const std::string& caller, std::vector<std::string> keys,
                std::vector<rpc::RRef<c10::IValue>> made, int64_t snapshot_step) {
  TORCH_CHECK_VALUE(keys.size() == made.size(), "recovery: ", keys.size(), " keys for ",
                    made.size(), " shards and modules");
  std::map<std::string, c10::IValue> objects;
  for (size_t i = 0; i < keys.size(); ++i) objects[keys[i]] = made[i].local_value();
  Board& b = board();
  std::lock_guard<std::mutex> lock(b.mutex);
  TORCH_CHECK_VALUE(
      !b.restored && b.claimant == caller, "recovery: '", caller,
      "' publishes the shards and modules of this worker, but ",
      b.restored ? "they were published already" : "'" + b.claimant + "' restores them");
  b.objects = std::move(objects);
  b.snapshot_step = snapshot_step;
  b.restored = true;
}

c10::IValue on_object(const std::string& key) {
  Board& b = board();
  std::lock_guard<std::mutex> lock(b.mutex);
  TORCH_CHECK_VALUE(b.restored, "recovery: this worker is not restored yet");
  auto it = b.objects.find(key);
  TORCH_CHECK_VALUE(it != b.objects.end(), "recovery: no shard or module '", key,
                    "' was restored here (", "the trainer '", b.claimant,
                    "' that restored this worker did not know it)");
  return it->second;
}

bool register_board() {
  rpc::detail::register_internal_function(kClaim, [](std::vector<c10::IValue> args) {
    TORCH_CHECK_TYPE(args.size() == 2, "takes 2 arguments");
    return on_claim(rpc::from_value<std::string>(args[0], "the caller"),
                    rpc::from_value<std::string>(args[1], "the stale claimant"));
  });
  rpc::detail::register_internal_function(kPublish, [](std::vector<c10::IValue> args) {
    TORCH_CHECK_TYPE(args.size() == 4, "takes 4 arguments");
    on_publish(rpc::from_value<std::string>(args[0], "the caller"),
               rpc::from_value<std::vector<std::string>>(args[1], "the keys"),
               rpc::from_value<std::vector<rpc::RRef<c10::IValue>>>(args[2], "the shards"),
               rpc::from_value<int64_t>(args[3], "the snapshot's step"));
    return c10::IValue();
  });
  rpc::detail::register_internal_function(kObject, [](std::vector<c10::IValue> args) {
    TORCH_CHECK_TYPE(args.size() == 1, "takes 1 argument");
    return on_object(rpc::from_value<std::string>(args[0], "the key"));
  });
  rpc::detail::register_internal_function(kRelease, [](std::vector<c10::IValue> args) {
    TORCH_CHECK_TYPE(args.size() == 1, "takes 1 argument");
    on_release(rpc::from_value<std::string>(args[0], "the caller"));
    return c10::IValue();
  });
  return true;
}

struct Claim {
  int64_t outcome;
  std::string claimant;
  int64_t snapshot_step;
};

Claim claim_of(const c10::IValue& reply) {
  const auto items = rpc::from_value<std::tuple<int64_t, std::string, int64_t>>(
      reply, "the restarted owner's answer");
  return {std::get<0>(items), std::get<1>(items), std::get<2>(items)};
}

// Asks `worker`'s board as `caller` (empty: claiming nothing, a call every owner answers at once).
Claim ask(const std::string& worker, const std::string& caller, const std::string& stale) {
  return claim_of(rpc::rpc_sync<c10::IValue>(worker, kClaim, std::tuple{caller, stale}));
}

Claim claim(const std::string& worker, const std::string& stale) {
  return ask(worker, rpc::get_worker_info().name, stale);
}

// The id of the member named `name`; nullopt when none is.
std::optional<int> member_id(const std::string& name) {
  try {
    return rpc::get_worker_info(name).id;
  } catch (const c10::ValueError&) {
    return std::nullopt;
  }
}

// Whether `worker`, the owner `old_id` was, is lost: its name gone or taken by another process,
// or its calls failing as lost. A stalled owner is not lost (its calls time out).
bool is_lost(const std::string& worker, int old_id) {
  if (member_id(worker) != old_id) return true;
  try {
    ask(worker, {}, {});
    return false;
  } catch (const PeerLostError&) {
    return true;
  } catch (const rpc::RemoteError&) {
    return false;
  }
}

// Waits until a worker named `worker` is a member other than the process `old_id` was.
void wait_for_new_incarnation(const std::string& worker, int old_id, Clock::time_point deadline,
                              std::chrono::milliseconds timeout) {
  while (true) {
    const std::optional<int> id = member_id(worker);
    if (id && *id != old_id) return;
    DISTOPTIM_CHECK_WITH(TimeoutError, Clock::now() < deadline, "recover_lost_owners: worker '",
                         worker, "' was lost and no worker of that name joined within ",
                         timeout.count(), " ms");
    std::this_thread::sleep_for(kPoll);
  }
}

// What the lost owner held: its table shards (with each shard's weight as the optimizer holds
// it), its RemoteModules, and the optimizer's parameters there that are no shard, in order.
struct LostParts {
  struct Shard {
    rpc::ShardedEmbeddingBag* table;
    size_t shard;
    rpc::RRef<at::Tensor> old_weight;
  };
  std::vector<Shard> shards;
  std::vector<rpc::RemoteModuleBase*> modules;
  std::vector<rpc::RRef<at::Tensor>> old_module_parameters;
};

// Makes (the restorer) or takes (the others) the lost shards and modules on the new `worker` and
// binds the handles and the optimizer to them; returns, for the restorer, what it made (for the
// board) by key.
std::pair<std::vector<std::string>, std::vector<rpc::RRef<c10::IValue>>> bind_anew(
    const std::string& worker, bool restorer, DistributedOptimizer& optimizer,
    const LostParts& lost) {
  std::vector<std::string> keys;
  std::vector<rpc::RRef<c10::IValue>> made;
  std::vector<rpc::RRef<rpc::EmbeddingShard>> shards;
  for (const LostParts::Shard& l : lost.shards) {
    shards.push_back(restorer ? l.table->make_shard(l.shard)
                              : rpc::remote<rpc::EmbeddingShard>(
                                    worker, kObject, std::tuple{l.table->shard_key(l.shard)}));
    keys.push_back(l.table->shard_key(l.shard));
    made.emplace_back(shards.back().handle());
  }
  for (rpc::RemoteModuleBase* module : lost.modules) {
    if (restorer) {
      made.push_back(module->make_anew());
    } else {
      module->bind_to_remote(worker, kObject, module->module_key());
    }
    keys.push_back(module->module_key());
  }
  for (const auto& shard : shards) shard.confirm();
  std::vector<rpc::RRef<at::Tensor>> old_params, new_params;
  for (size_t i = 0; i < lost.shards.size(); ++i) {
    lost.shards[i].table->rebind_shard(lost.shards[i].shard, shards[i]);
    old_params.push_back(lost.shards[i].old_weight);
    new_params.push_back(lost.shards[i].table->remote_parameters()[lost.shards[i].shard]);
  }
  std::vector<rpc::RRef<at::Tensor>> module_params;
  for (rpc::RemoteModuleBase* module : lost.modules) {
    const std::vector<rpc::RRef<at::Tensor>> params = module->owner_parameters();
    module_params.insert(module_params.end(), params.begin(), params.end());
  }
  TORCH_CHECK_VALUE(module_params.size() == lost.old_module_parameters.size(),
                    "recover_lost_owners: worker '", worker, "' was lost holding ",
                    lost.old_module_parameters.size(),
                    " parameter(s) of the optimizer that are no table's shard; its modules, made "
                    "anew, have ",
                    module_params.size());
  old_params.insert(old_params.end(), lost.old_module_parameters.begin(),
                    lost.old_module_parameters.end());
  new_params.insert(new_params.end(), module_params.begin(), module_params.end());
  optimizer.rebind(old_params, new_params);
  return {keys, made};
}

// Loads `optimizer`'s state on `worker` from the newest snapshot in the trainer's own
// state_directory, if it names one other than snapshot_directory; returns its step.
std::optional<int64_t> load_own_state(const std::string& worker, DistributedOptimizer& optimizer,
                                      const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                                      const RecoveryOptions& options) {
  if (options.state_directory().empty() ||
      options.state_directory() == options.snapshot_directory()) {
    return std::nullopt;
  }
  const std::optional<SnapshotInfo> own = latest_snapshot(options.state_directory());
  if (!own) return std::nullopt;
  load_snapshot_into(own->path, optimizer, tables, worker, /*state_only=*/true);
  return own->step;
}

RecoveredOwner recover_one(const std::string& worker, int old_id, DistributedOptimizer& optimizer,
                           const LostParts& lost,
                           const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                           const RecoveryOptions& options) {
  const Clock::time_point start = Clock::now(), deadline = start + options.timeout();
  wait_for_new_incarnation(worker, old_id, deadline, options.timeout());
  RecoveredOwner result;
  result.worker = worker;
  std::string stale;
  Claim state = claim(worker, stale);
  while (state.outcome == kAnotherRestores) {
    // A restorer that left the group never finishes: its claim passes on.
    if (!member_id(state.claimant)) stale = state.claimant;
    DISTOPTIM_CHECK_WITH(TimeoutError, Clock::now() < deadline, "recover_lost_owners: '",
                         state.claimant, "' did not finish restoring worker '", worker, "' within ",
                         options.timeout().count(), " ms");
    if (stale.empty()) std::this_thread::sleep_for(kPoll);
    state = claim(worker, stale);
  }
  auto backup = options.backups().find(worker);
  if (backup != options.backups().end()) result.backup = backup->second;
  // Replicated: this trainer's state from the backup's copies, and its steps there again.
  auto from_backup = [&](bool with_value) {
    load_from_backup(optimizer, tables, lost.modules, worker, result.backup, with_value,
                     rpc::get_worker_info().name);
    // The backup holds what was just loaded: nothing is sent back to it.
    set_backups(optimizer, tables, lost.modules,
                ReplicaOptions().backups({{worker, result.backup}}),
                /*restored_from_them=*/true);
  };
  if (state.outcome != kYouRestore) {
    bind_anew(worker, /*restorer=*/false, optimizer, lost);
    if (!result.backup.empty()) {
      from_backup(/*with_value=*/false);
    } else {
      if (state.snapshot_step >= 0) result.snapshot_step = state.snapshot_step;
      result.state_step = load_own_state(worker, optimizer, tables, options);
    }
    result.waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    return result;
  }
  try {
    auto [keys, made] = bind_anew(worker, /*restorer=*/true, optimizer, lost);
    result.restored_here = true;
    const std::optional<SnapshotInfo> latest =
        options.snapshot_directory().empty() || !result.backup.empty()
            ? std::nullopt
            : latest_snapshot(options.snapshot_directory());
    if (!result.backup.empty()) {
      from_backup(/*with_value=*/true);
    } else if (latest) {
      load_snapshot_into(latest->path, optimizer, tables, worker);
      result.snapshot_step = latest->step;
    }
    rpc::rpc_sync<void>(
        worker, kPublish,
        std::tuple{rpc::get_worker_info().name, keys, made, result.snapshot_step.value_or(-1)});
  } catch (...) {
    // The next trainer that asks restores instead, rather than wait for this one's timeout.
    try {
      rpc::rpc_sync<void>(worker, kRelease, std::tuple{rpc::get_worker_info().name});
    } catch (const c10::Error& error) {
      TORCH_WARN("recover_lost_owners: could not give back the claim to restore worker '", worker,
                 "': ", error.what_without_backtrace());
    }
    throw;
  }
  if (result.backup.empty()) result.state_step = load_own_state(worker, optimizer, tables, options);
  result.waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  return result;
}

}  // namespace
}  // namespace detail

std::vector<RecoveredOwner> recover_lost_owners(
    DistributedOptimizer& optimizer, const std::vector<rpc::ShardedEmbeddingBag*>& tables,
    const std::vector<rpc::RemoteModuleBase*>& modules, const RecoveryOptions& options) {
  TORCH_CHECK_VALUE(options.timeout().count() > 0, "recover_lost_owners: timeout of ",
                    options.timeout().count(), " ms (must be positive)");
  for (size_t t = 0; t < tables.size(); ++t) {
    TORCH_CHECK_VALUE(tables[t] != nullptr, "recover_lost_owners: tables[", t, "] is null");
  }
  for (size_t m = 0; m < modules.size(); ++m) {
    TORCH_CHECK_VALUE(modules[m] != nullptr, "recover_lost_owners: modules[", m, "] is null");
  }
  // Each owner's process as the optimizer knows it.
  std::map<std::string, int> owners;
  for (const rpc::RRef<at::Tensor>& param : optimizer.parameters()) {
    const rpc::WorkerInfo owner = param.owner();
    owners.emplace(owner.name, owner.id);
  }
  std::vector<RecoveredOwner> recovered;
  for (const auto& [worker, old_id] : owners) {
    if (!detail::is_lost(worker, old_id)) continue;
    detail::LostParts lost;
    std::set<std::string> shard_ids;
    for (rpc::ShardedEmbeddingBag* table : tables) {
      for (size_t s = 0; s < table->num_shards(); ++s) {
        if (table->options().workers()[s] != worker) continue;
        // The shard's weight as the optimizer holds it (remote_parameters keeps it).
        lost.shards.push_back({table, s, table->remote_parameters()[s]});
        shard_ids.insert(rpc::detail::rref_global_id(lost.shards.back().old_weight.handle()));
      }
    }
    for (const rpc::RRef<at::Tensor>& param : optimizer.parameters()) {
      if (param.owner().name != worker ||
          shard_ids.count(rpc::detail::rref_global_id(param.handle())) > 0) {
        continue;
      }
      lost.old_module_parameters.push_back(param);
    }
    for (rpc::RemoteModuleBase* module : modules) {
      if (module->remote_device().worker_name != worker) continue;
      // Checked before anything is claimed: any trainer may have to make it anew.
      TORCH_CHECK_VALUE(module->can_make_anew() && !module->remote_device().rank,
                        "recover_lost_owners: a RemoteModule on '",
                        module->remote_device().to_string(), "' (worker '", worker,
                        "', lost) cannot be made anew: ",
                        module->remote_device().rank
                            ? "its worker is given by rank"
                            : "its constructor's arguments are unknown (make_anew_with)");
      lost.modules.push_back(module);
    }
    TORCH_CHECK_VALUE(lost.old_module_parameters.empty() || !lost.modules.empty(),
                      "recover_lost_owners: worker '", worker, "' was lost holding ",
                      lost.old_module_parameters.size(),
                      " parameter(s) of the optimizer that are no table's shard and no module "
                      "was given for it (give every table whose shards the optimizer steps, and "
                      "every RemoteModule whose parameters it steps)");
    recovered.push_back(detail::recover_one(worker, old_id, optimizer, lost, tables, options));
  }
  return recovered;
}

std::vector<RecoveredOwner> recover_lost_owners(
    DistributedOptimizer& optimizer, const std::vector<rpc::ShardedEmbeddingBag*>& tables,
    const RecoveryOptions& options) {
  return recover_lost_owners(optimizer, tables, {}, options);
}

}  // namespace dist_optim
}  // namespace distoptim

// Registered at start-up, as the remote optimizer: a restarted owner answers its trainers.
extern "C" const bool distoptim_dist_optim_recovery_registered =  // NOLINT: kept by the linker
    distoptim::dist_optim::detail::register_board();
