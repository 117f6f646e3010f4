// Binding trainers to an owner that was started again (recovery.h): the trainers' side, and the
// restarted owner's board through which one trainer restores its shards and the others take them.

#include <distoptim/dist_optim/recovery.h>

#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>
#include <distoptim/dist_optim/snapshot.h>
#include <distoptim/rpc/api.h>
#include <distoptim/rpc/detail/internal_registry.h>
#include <distoptim/rpc/detail/rref_calls.h>
#include <distoptim/rpc/errors.h>

#include "snapshot_calls.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

namespace {

using Clock = std::chrono::steady_clock;

// The restarted owner's board (one per process: a new incarnation starts with an empty one).
constexpr const char* kClaim = "__distoptim.recovery.claim";
constexpr const char* kPublish = "__distoptim.recovery.publish";
constexpr const char* kObject = "__distoptim.recovery.object";
// A claim's outcome, and the board's state.
constexpr int64_t kYouRestore = 0, kAnotherRestores = 1, kRestored = 2;
constexpr std::chrono::milliseconds kPoll{20};

struct Board {
  std::mutex mutex;
  std::string claimant;  // the trainer restoring this owner's shards; empty: none
  bool restored = false;
  int64_t snapshot_step = -1;
  std::map<std::string, c10::IValue> objects;  // by shard key: the shard
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

void on_publish(const std::string& caller, std::vector<std::string> keys,
                std::vector<rpc::RRef<c10::IValue>> shards, int64_t snapshot_step) {
  TORCH_CHECK_VALUE(keys.size() == shards.size(), "recovery: ", keys.size(), " keys for ",
                    shards.size(), " shards");
  std::map<std::string, c10::IValue> objects;
  for (size_t i = 0; i < keys.size(); ++i) objects[keys[i]] = shards[i].local_value();
  Board& b = board();
  std::lock_guard<std::mutex> lock(b.mutex);
  TORCH_CHECK_VALUE(
      !b.restored && b.claimant == caller, "recovery: '", caller,
      "' publishes the shards of this worker, but ",
      b.restored ? "they were published already" : "'" + b.claimant + "' restores them");
  b.objects = std::move(objects);
  b.snapshot_step = snapshot_step;
  b.restored = true;
}

c10::IValue on_object(const std::string& key) {
  Board& b = board();
  std::lock_guard<std::mutex> lock(b.mutex);
  TORCH_CHECK_VALUE(b.restored, "recovery: the shards of this worker are not restored yet");
  auto it = b.objects.find(key);
  TORCH_CHECK_VALUE(it != b.objects.end(), "recovery: no shard '", key, "' was restored here (",
                    "the trainer '", b.claimant, "' that restored this worker did not know it)");
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

// A table shard on the lost owner.
struct LostShard {
  rpc::ShardedEmbeddingBag* table;
  size_t shard;
  rpc::RRef<at::Tensor> old_weight;
};

RecoveredOwner recover_one(const std::string& worker, int old_id, DistributedOptimizer& optimizer,
                           const std::vector<LostShard>& lost,
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
  std::vector<rpc::RRef<rpc::EmbeddingShard>> shards;
  if (state.outcome == kYouRestore) {
    for (const LostShard& l : lost) shards.push_back(l.table->make_shard(l.shard));
  } else {
    for (const LostShard& l : lost) {
      shards.push_back(rpc::remote<rpc::EmbeddingShard>(worker, kObject,
                                                        std::tuple{l.table->shard_key(l.shard)}));
    }
    if (state.snapshot_step >= 0) result.snapshot_step = state.snapshot_step;
  }
  for (const auto& shard : shards) shard.confirm();
  std::vector<rpc::RRef<at::Tensor>> old_weights, new_weights;
  for (size_t i = 0; i < lost.size(); ++i) {
    lost[i].table->rebind_shard(lost[i].shard, shards[i]);
    old_weights.push_back(lost[i].old_weight);
    new_weights.push_back(lost[i].table->remote_parameters()[lost[i].shard]);
  }
  optimizer.rebind(old_weights, new_weights);
  if (state.outcome == kYouRestore) {
    result.restored_here = true;
    const std::optional<SnapshotInfo> latest = options.snapshot_directory().empty()
                                                   ? std::nullopt
                                                   : latest_snapshot(options.snapshot_directory());
    if (latest) {
      load_snapshot_into(latest->path, optimizer, tables, worker);
      result.snapshot_step = latest->step;
    }
    std::vector<std::string> keys;
    std::vector<rpc::RRef<c10::IValue>> published;
    for (size_t i = 0; i < lost.size(); ++i) {
      keys.push_back(lost[i].table->shard_key(lost[i].shard));
      published.emplace_back(shards[i].handle());
    }
    rpc::rpc_sync<void>(worker, kPublish,
                        std::tuple{rpc::get_worker_info().name, keys, published,
                                   result.snapshot_step.value_or(-1)});
  }
  result.waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  return result;
}

}  // namespace
}  // namespace detail

std::vector<RecoveredOwner> recover_lost_owners(
    DistributedOptimizer& optimizer, const std::vector<rpc::ShardedEmbeddingBag*>& tables,
    const RecoveryOptions& options) {
  TORCH_CHECK_VALUE(options.timeout().count() > 0, "recover_lost_owners: timeout of ",
                    options.timeout().count(), " ms (must be positive)");
  // Each owner's process as the optimizer knows it, and how many parameters it holds there.
  std::map<std::string, std::pair<int, size_t>> owners;
  for (const rpc::RRef<at::Tensor>& param : optimizer.parameters()) {
    const rpc::WorkerInfo owner = param.owner();
    auto [it, fresh] = owners.emplace(owner.name, std::pair{owner.id, size_t{0}});
    ++it->second.second;
  }
  std::vector<RecoveredOwner> recovered;
  for (const auto& [worker, known] : owners) {
    if (!detail::is_lost(worker, known.first)) continue;
    std::vector<detail::LostShard> lost;
    for (size_t t = 0; t < tables.size(); ++t) {
      TORCH_CHECK_VALUE(tables[t] != nullptr, "recover_lost_owners: tables[", t, "] is null");
      for (size_t s = 0; s < tables[t]->num_shards(); ++s) {
        if (tables[t]->options().workers()[s] != worker) continue;
        // The shard's weight as the optimizer holds it (remote_parameters keeps it).
        lost.push_back({tables[t], s, tables[t]->remote_parameters()[s]});
      }
    }
    TORCH_CHECK_VALUE(lost.size() == known.second, "recover_lost_owners: worker '", worker,
                      "' was lost holding ", known.second, " parameter(s) of the optimizer, ",
                      lost.size(), " of them table shards; only table shards are made anew (",
                      "give every table whose shards the optimizer steps)");
    recovered.push_back(detail::recover_one(worker, known.first, optimizer, lost, tables, options));
  }
  return recovered;
}

}  // namespace dist_optim
}  // namespace distoptim

// Registered at start-up, as the remote optimizer: a restarted owner answers its trainers.
extern "C" const bool distoptim_dist_optim_recovery_registered =  // NOLINT: kept by the linker
    distoptim::dist_optim::detail::register_board();
