// Binding trainers to a lost owner's parts made anew (recovery.h): on its new incarnation, from a
// snapshot or its backup's copies, or on its backup itself (hot standby). The trainers' side;
// recovery_board.h is where they agree on who makes the parts.

#include <distoptim/dist_optim/recovery.h>

#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>
#include <distoptim/dist_optim/snapshot.h>
#include <distoptim/rpc/api.h>
#include <distoptim/rpc/detail/rref_calls.h>
#include <distoptim/rpc/errors.h>

#include "recovery_board.h"
#include "replicated_owners.h"
#include "snapshot_calls.h"
#include "step_mirror.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds kPoll{20};

// This trainer's claim on board `board` of `worker`.
Claim claim(const std::string& worker, const std::string& board, const std::string& stale) {
  return ask_board(worker, board, rpc::get_worker_info().name, stale);
}

// Whether `worker`, the owner `old_id` was, is lost: its name gone or taken by another process,
// or its calls failing as lost. A stalled owner is not lost (its calls time out).
bool is_lost(const std::string& worker, int old_id) {
  if (member_id(worker) != old_id) return true;
  try {
    ask_board(worker, "", "", "");
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

// A lost shard of a table (a ShardedEmbeddingBag or a ShardedIdEmbeddingBag), with its weight as
// the optimizer holds it.
template <class Table>
struct LostShard {
  Table* table;
  size_t shard;
  rpc::RRef<at::Tensor> old_weight;
};

// What the lost owner held: its table shards, its RemoteModules, and the optimizer's parameters
// there that are no shard, in order.
struct LostParts {
  std::vector<LostShard<rpc::ShardedEmbeddingBag>> shards;
  std::vector<LostShard<rpc::ShardedIdEmbeddingBag>> id_shards;
  std::vector<rpc::RemoteModuleBase*> modules;
  std::vector<rpc::RRef<at::Tensor>> old_module_parameters;
};

// The collisionless tables as the snapshot functions take them.
using IdTables = std::vector<const rpc::ShardedIdEmbeddingBag*>;

// Where a lost owner's parts are made anew: on its new incarnation (`worker` its own name,
// board "") or on its backup (hot standby: the backup's name, a board for the lost owner).
struct Place {
  std::string worker;
  std::string board;
};

// What bind_anew made (the restorer's, for the board) by key, and the keys of the optimizer's
// parameters it bound (as replicas.h names their copies).
struct Bound {
  std::vector<std::string> keys;
  std::vector<rpc::RRef<c10::IValue>> made;
  std::set<std::string> param_keys;
};

// Makes (the restorer) or takes (the others) the lost shards and modules at `place` and binds
// the handles and the optimizer to them. `from_copies`: the rows are loaded at once from a
// backup's copies, so the restorer's shards are made without drawing initial rows.
// The restorer makes each of `lost` with `make`; the others take what it published on the board.
template <class Shard, class Table, class Make>
std::vector<rpc::RRef<Shard>> make_or_take_shards(const Place& place, bool restorer,
                                                  const std::vector<LostShard<Table>>& lost,
                                                  Make make, Bound& bound) {
  std::vector<rpc::RRef<Shard>> shards;
  for (const LostShard<Table>& l : lost) {
    const std::string& key = l.table->shard_key(l.shard);
    shards.push_back(restorer ? make(l)
                              : rpc::remote<Shard>(place.worker, kBoardObject,
                                                   std::tuple{board_object_key(place.board, key)}));
    bound.keys.push_back(key);
    bound.param_keys.insert(key);
    bound.made.emplace_back(shards.back().handle());
  }
  return shards;
}

// Binds each table of `lost` to its shard made anew, and notes the old and new weights.
template <class Shard, class Table>
void rebind_shards(const std::vector<LostShard<Table>>& lost,
                   const std::vector<rpc::RRef<Shard>>& shards,
                   std::vector<rpc::RRef<at::Tensor>>& old_params,
                   std::vector<rpc::RRef<at::Tensor>>& new_params) {
  for (const auto& shard : shards) shard.confirm();
  for (size_t i = 0; i < lost.size(); ++i) {
    lost[i].table->rebind_shard(lost[i].shard, shards[i]);
    old_params.push_back(lost[i].old_weight);
    new_params.push_back(lost[i].table->remote_parameters()[lost[i].shard]);
  }
}

Bound bind_anew(const std::string& lost_worker, const Place& place, bool restorer, bool from_copies,
                DistributedOptimizer& optimizer, const LostParts& lost) {
  Bound bound;
  const auto shards = make_or_take_shards<rpc::EmbeddingShard>(
      place, restorer, lost.shards,
      [&](const LostShard<rpc::ShardedEmbeddingBag>& l) {
        return l.table->make_shard(l.shard, place.worker, /*initial_rows=*/!from_copies);
      },
      bound);
  // A collisionless table's shard is made empty: its rows come with their ids.
  const auto id_shards = make_or_take_shards<rpc::IdEmbeddingShard>(
      place, restorer, lost.id_shards,
      [&](const LostShard<rpc::ShardedIdEmbeddingBag>& l) {
        return l.table->make_shard(l.shard, place.worker);
      },
      bound);
  for (rpc::RemoteModuleBase* module : lost.modules) {
    module->move_to(place.worker);
    if (restorer) {
      bound.made.push_back(module->make_anew());
    } else {
      module->bind_to_remote(place.worker, kBoardObject,
                             board_object_key(place.board, module->module_key()));
    }
    bound.keys.push_back(module->module_key());
  }
  std::vector<rpc::RRef<at::Tensor>> old_params, new_params;
  rebind_shards(lost.shards, shards, old_params, new_params);
  rebind_shards(lost.id_shards, id_shards, old_params, new_params);
  std::vector<rpc::RRef<at::Tensor>> module_params;
  for (rpc::RemoteModuleBase* module : lost.modules) {
    const std::vector<rpc::RRef<at::Tensor>> params = module->owner_parameters();
    module_params.insert(module_params.end(), params.begin(), params.end());
    for (size_t j = 0; j < params.size(); ++j) {
      bound.param_keys.insert(module->module_key() + "/" + std::to_string(j));
    }
  }
  TORCH_CHECK_VALUE(module_params.size() == lost.old_module_parameters.size(),
                    "recover_lost_owners: worker '", lost_worker, "' was lost holding ",
                    lost.old_module_parameters.size(),
                    " parameter(s) of the optimizer that are no table's shard; its modules, made "
                    "anew, have ",
                    module_params.size());
  old_params.insert(old_params.end(), lost.old_module_parameters.begin(),
                    lost.old_module_parameters.end());
  new_params.insert(new_params.end(), module_params.begin(), module_params.end());
  optimizer.rebind(old_params, new_params);
  return bound;
}

// Whether the snapshot in `path` holds this trainer's optimizer state: its optimizer wrote it.
// A snapshot that does not say whose it is counts as the restorer's (`restorer`).
bool holds_own_state(const std::string& path, bool restorer) {
  const std::string trainer = snapshot_trainer(path);
  return trainer.empty() ? restorer : trainer == rpc::get_worker_info().name;
}

// Loads `optimizer`'s state on `worker` from this trainer's own snapshots: that of step
// `snapshot_step` in snapshot_directory (which the restorer loaded the parameters from) when this
// trainer's optimizer wrote it, else the newest in state_directory, if that names another
// directory; returns the step of the snapshot it loaded, if any.
std::optional<int64_t> load_own_state(const std::string& worker, DistributedOptimizer& optimizer,
                                      const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                                      const IdTables& id_tables, const RecoveryOptions& options,
                                      int64_t snapshot_step) {
  if (!options.snapshot_directory().empty() && snapshot_step >= 0) {
    const std::string path = scheduled_snapshot_path(options.snapshot_directory(), snapshot_step);
    if (std::filesystem::exists(std::filesystem::path(path) / "manifest.pt") &&
        holds_own_state(path, /*restorer=*/false)) {
      load_snapshot_into(path, optimizer, tables, worker, SnapshotPart::kState, id_tables);
      return snapshot_step;
    }
  }
  if (options.state_directory().empty() ||
      options.state_directory() == options.snapshot_directory()) {
    return std::nullopt;
  }
  const std::optional<SnapshotInfo> own = latest_snapshot(options.state_directory());
  if (!own) return std::nullopt;
  load_snapshot_into(own->path, optimizer, tables, worker, SnapshotPart::kState, id_tables);
  return own->step;
}

// Claims board `place` until this trainer has the claim or the parts were made (by another).
Claim claim_until_made(const std::string& lost_worker, const Place& place,
                       Clock::time_point deadline, std::chrono::milliseconds timeout) {
  std::string stale;
  Claim state = claim(place.worker, place.board, stale);
  while (state.outcome == kAnotherRestores) {
    // A restorer that left the group never finishes: its claim passes on.
    if (!member_id(state.claimant)) stale = state.claimant;
    DISTOPTIM_CHECK_WITH(TimeoutError, Clock::now() < deadline, "recover_lost_owners: '",
                         state.claimant, "' did not finish making the parts of worker '",
                         lost_worker, "' anew on worker '", place.worker, "' within ",
                         timeout.count(), " ms");
    if (stale.empty()) std::this_thread::sleep_for(kPoll);
    state = claim(place.worker, place.board, stale);
  }
  return state;
}

// The restorer's part: `restore` makes and loads the parts, then they are published on the
// board; if it fails, the claim is given back, so that the next trainer that asks restores
// rather than wait for this one's timeout.
template <class Restore>
void restore_and_publish(const std::string& lost_worker, const Place& place, Restore restore) {
  try {
    const auto [bound, snapshot_step] = restore();
    publish_on_board(place.worker, place.board, bound.keys, bound.made, snapshot_step);
  } catch (...) {
    try {
      release_board(place.worker, place.board);
    } catch (const c10::Error& error) {
      TORCH_WARN("recover_lost_owners: could not give back the claim to make the parts of worker '",
                 lost_worker, "' on worker '", place.worker, "': ", error.what_without_backtrace());
    }
    throw;
  }
}

std::chrono::milliseconds since(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
}

RecoveredOwner recover_one(const std::string& worker, int old_id, DistributedOptimizer& optimizer,
                           const LostParts& lost,
                           const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                           const IdTables& id_tables, const RecoveryOptions& options) {
  const Clock::time_point start = Clock::now(), deadline = start + options.timeout();
  wait_for_new_incarnation(worker, old_id, deadline, options.timeout());
  RecoveredOwner result;
  result.worker = worker;
  result.served_by = worker;
  const Place place{worker, ""};
  const Claim state = claim_until_made(worker, place, deadline, options.timeout());
  auto backup = options.backups().find(worker);
  if (backup != options.backups().end()) result.backup = backup->second;
  // Replicated: this trainer's state from the backup's copies, and its steps there again.
  auto from_backup = [&](bool with_value) {
    load_from_backup(optimizer, tables, lost.modules,
                     {worker, result.backup, worker, {}, with_value, rpc::get_worker_info().name});
    // The backup holds what was just loaded: nothing is sent back to it.
    set_backups(optimizer, tables, lost.modules,
                ReplicaOptions().backups({{worker, result.backup}}),
                /*restored_from_them=*/true);
  };
  if (state.outcome != kYouRestore) {
    bind_anew(worker, place, /*restorer=*/false, /*from_copies=*/false, optimizer, lost);
    if (!result.backup.empty()) {
      from_backup(/*with_value=*/false);
    } else {
      if (state.snapshot_step >= 0) result.snapshot_step = state.snapshot_step;
      result.state_step =
          load_own_state(worker, optimizer, tables, id_tables, options, state.snapshot_step);
    }
    result.waited = since(start);
    return result;
  }
  restore_and_publish(worker, place, [&] {
    Bound bound =
        bind_anew(worker, place, /*restorer=*/true, !result.backup.empty(), optimizer, lost);
    result.restored_here = true;
    const std::optional<SnapshotInfo> latest =
        options.snapshot_directory().empty() || !result.backup.empty()
            ? std::nullopt
            : latest_snapshot(options.snapshot_directory());
    if (!result.backup.empty()) {
      from_backup(/*with_value=*/true);
    } else if (latest) {
      // Another trainer's optimizer state is not this one's: its values alone then.
      const bool own = holds_own_state(latest->path, /*restorer=*/true);
      load_snapshot_into(latest->path, optimizer, tables, worker,
                         own ? SnapshotPart::kEverything : SnapshotPart::kValues, id_tables);
      result.snapshot_step = latest->step;
      if (own) result.state_step = latest->step;
    }
    return std::pair{std::move(bound), result.snapshot_step.value_or(-1)};
  });
  if (result.backup.empty() && !result.state_step) {
    result.state_step =
        load_own_state(worker, optimizer, tables, id_tables, options, /*snapshot_step=*/-1);
  }
  result.waited = since(start);
  return result;
}

// Hot standby: the lost `worker`'s parts are made on its `backup` from the backup's copies of
// them, with every step that returned, and the backup serves them from then on; its own steps
// go to its backup (options.backups()), stepping on without it while that one is lost.
RecoveredOwner take_over_on_backup(const std::string& worker, int old_id, const std::string& backup,
                                   DistributedOptimizer& optimizer, const LostParts& lost,
                                   const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                                   const std::vector<rpc::RemoteModuleBase*>& modules,
                                   const RecoveryOptions& options) {
  const Clock::time_point start = Clock::now(), deadline = start + options.timeout();
  const std::optional<int> backup_id = member_id(backup);
  DISTOPTIM_CHECK_WITH(PeerLostError, backup_id && !is_lost(backup, *backup_id),
                       "recover_lost_owners: worker '", worker,
                       "' was lost, and so is its backup '", backup,
                       "', which held the only copies of its parameters");
  RecoveredOwner result;
  result.worker = worker;
  result.backup = backup;
  result.served_by = backup;
  // One board per lost incarnation: the backup may take over a later one of the same name too.
  const Place place{backup, worker + "#" + std::to_string(old_id)};
  const Claim state = claim_until_made(worker, place, deadline, options.timeout());
  const std::string me = rpc::get_worker_info().name;
  const bool restorer = state.outcome == kYouRestore;
  auto load = [&](const Bound& bound) {
    // Every module: the backup's optimizer holds its own modules' parameters too.
    load_from_backup(optimizer, tables, modules,
                     {backup, backup, worker, bound.param_keys, /*with_value=*/restorer, me});
  };
  if (restorer) {
    restore_and_publish(worker, place, [&] {
      Bound bound =
          bind_anew(worker, place, /*restorer=*/true, /*from_copies=*/true, optimizer, lost);
      load(bound);
      return std::pair{std::move(bound), int64_t{-1}};
    });
    result.restored_here = true;
  } else {
    load(bind_anew(worker, place, /*restorer=*/false, /*from_copies=*/false, optimizer, lost));
  }
  // The backup's optimizer of this trainer, its own parameters and the lost one's, replicates
  // to the backup's backup (the lost worker, as a rule: its next incarnation takes everything).
  auto next = options.backups().find(backup);
  if (next != options.backups().end()) {
    set_backups(optimizer, tables, modules,
                ReplicaOptions().backups({{backup, next->second}}).continue_without_backup(true),
                /*restored_from_them=*/false);
  }
  result.waited = since(start);
  return result;
}

}  // namespace
}  // namespace detail

std::vector<RecoveredOwner> recover_lost_owners(
    DistributedOptimizer& optimizer, const std::vector<rpc::ShardedEmbeddingBag*>& tables,
    const std::vector<rpc::RemoteModuleBase*>& modules, const RecoveryOptions& options,
    const std::vector<rpc::ShardedIdEmbeddingBag*>& id_tables) {
  TORCH_CHECK_VALUE(options.timeout().count() > 0, "recover_lost_owners: timeout of ",
                    options.timeout().count(), " ms (must be positive)");
  for (size_t t = 0; t < tables.size(); ++t) {
    TORCH_CHECK_VALUE(tables[t] != nullptr, "recover_lost_owners: tables[", t, "] is null");
  }
  for (size_t m = 0; m < modules.size(); ++m) {
    TORCH_CHECK_VALUE(modules[m] != nullptr, "recover_lost_owners: modules[", m, "] is null");
  }
  for (size_t t = 0; t < id_tables.size(); ++t) {
    TORCH_CHECK_VALUE(id_tables[t] != nullptr, "recover_lost_owners: id_tables[", t, "] is null");
  }
  const detail::IdTables const_id_tables(id_tables.begin(), id_tables.end());
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
        if (table->shard_owner(s) != worker) continue;
        // The shard's weight as the optimizer holds it (remote_parameters keeps it).
        lost.shards.push_back({table, s, table->remote_parameters()[s]});
        shard_ids.insert(rpc::detail::rref_global_id(lost.shards.back().old_weight.handle()));
      }
    }
    for (rpc::ShardedIdEmbeddingBag* table : id_tables) {
      for (size_t s = 0; s < table->num_shards(); ++s) {
        if (table->shard_owner(s) != worker) continue;
        lost.id_shards.push_back({table, s, table->remote_parameters()[s]});
        shard_ids.insert(rpc::detail::rref_global_id(lost.id_shards.back().old_weight.handle()));
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
    auto backup = options.backups().find(worker);
    // A backup's copies are rows by index: a collisionless table's rows without their ids.
    TORCH_CHECK_VALUE(lost.id_shards.empty() || backup == options.backups().end(),
                      "recover_lost_owners: worker '", worker, "' was lost holding ",
                      lost.id_shards.size(),
                      " shard(s) of a collisionless table, and RecoveryOptions::backups names "
                      "its backup '",
                      backup == options.backups().end() ? std::string() : backup->second,
                      "': such tables come back from snapshots only");
    if (options.hot_standby() && backup != options.backups().end()) {
      recovered.push_back(detail::take_over_on_backup(worker, old_id, backup->second, optimizer,
                                                      lost, tables, modules, options));
    } else {
      recovered.push_back(
          detail::recover_one(worker, old_id, optimizer, lost, tables, const_id_tables, options));
    }
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
