#include "membership.h"

#include <algorithm>
#include <thread>
#include <utility>

#include <distoptim/comm/errors.h>

#include "liveness.h"
#include "worker_table.h"

namespace distoptim {
namespace rpc {
namespace detail {

Membership::Membership(WorkerGroup& group, const RpcBackendOptions& options, Send send,
                       CallerLost caller_lost, Refused refused)
    : group_(group),
      options_(options),
      send_(std::move(send)),
      caller_lost_(std::move(caller_lost)),
      refused_(std::move(refused)) {}

void Membership::watch_lost_members() {
  if (!group_.drops_lost_members()) return;
  lost_members_ = std::make_unique<LostMemberWatch>(
      [this](int peer, std::chrono::milliseconds timeout) {
        return send_(peer, kAliveFunction, {}, timeout);
      },
      options_.liveness_timeout(),
      [this](int id) {
        const auto table = group_.table().snapshot();
        const WorkerTable::Entry* entry = table->find(id);
        return id != group_.rank() && entry != nullptr && !entry->left;
      },
      [this](int id, const std::string& why) { drop_member(id, why); });
}

// Every member that joined before this worker hears of it from this worker (those joining after
// read it in the store and tell it themselves), so that when init_rpc returns, all can call it.
void Membership::announce_join() {
  const std::vector<int> earlier = group_.enter();
  const auto table = group_.table().snapshot();
  const WorkerTable::Entry& me = *table->find(group_.rank());
  std::vector<std::pair<int, c10::intrusive_ptr<c10::ivalue::Future>>> notices;
  for (int member : earlier) {
    notices.emplace_back(member, send_(member, kMemberJoined,
                                       {c10::IValue(me.info.name), c10::IValue(me.host),
                                        c10::IValue(static_cast<int64_t>(me.port))},
                                       options_.init_timeout()));
  }
  for (auto& [member, notice] : notices) {
    notice->wait();
    if (!notice->hasError()) {
      // A member that is leaving does not stay: it is not called.
      if (!notice->value().toBool()) group_.table().mark_left(member);
      continue;
    }
    try {
      std::rethrow_exception(notice->exception_ptr());
    } catch (const PeerLostError& lost) {
      DISTOPTIM_CHECK_WITH(DistributedError, !refused_(member), "init_rpc: worker '", self().name,
                           "' (rank ", group_.rank(), ") could not tell worker '", name_of(member),
                           "' that it joined: ", lost.what_without_backtrace());
      // It died (or left) since it entered the store's list: not a member any more.
      TORCH_WARN("init_rpc: worker '", self().name, "' could not tell worker '", name_of(member),
                 "' that it joined: ", lost.what_without_backtrace());
      group_.table().mark_left(member);
    } catch (const c10::Error& error) {
      DISTOPTIM_THROW(DistributedError, "init_rpc: worker '", self().name, "' (rank ",
                      group_.rank(), ") could not tell worker '", name_of(member),
                      "' that it joined: ", error.what_without_backtrace());
    }
  }
}

void Membership::abandon_join() {
  if (group_.dynamic() && group_.self().id >= 0) group_.leave();
}

c10::IValue Membership::on_notice(int caller, const std::string& notice,
                                  std::vector<c10::IValue> args) {
  TORCH_CHECK_VALUE(group_.dynamic(), "worker '", self().name,
                    "' is in a static group: workers do not join or leave it");
  if (notice == kMemberLeft) {
    group_.table().mark_left(caller);
    return c10::IValue(true);
  }
  if (notice == kMemberDropped) {
    // Only the store host drops members, or over etcd a member whose drop the store records: no
    // member can make this one forget a third that the store still lists.
    TORCH_CHECK_VALUE(!group_.has_store_host() || caller == 0, "worker id ", caller,
                      " sent a notice that a member was dropped; only the store host (rank 0) "
                      "drops members");
    TORCH_CHECK_VALUE(args.size() == 1 && args[0].isInt(),
                      "a notice that a member was dropped needs its id");
    const int64_t id = args[0].toInt();
    const int64_t lowest = group_.has_store_host() ? 1 : 0;
    TORCH_CHECK_VALUE(id >= lowest && id <= WorkerTable::kMaxDynamicId && id != group_.rank(),
                      "a notice that a member was dropped names worker id ", id, " (this worker, '",
                      self().name, "', is id ", group_.rank(), ")");
    TORCH_CHECK_VALUE(group_.has_store_host() || group_.marked_left(static_cast<int>(id)),
                      "worker id ", caller, " sent a notice that worker id ", id,
                      " was dropped, but the store does not say it left");
    group_.table().mark_left(static_cast<int>(id));
    // Whatever it still sends (a stopped worker that resumes) is not run.
    caller_lost_(static_cast<int>(id));
    return c10::IValue(true);
  }
  TORCH_CHECK_VALUE(args.size() == 3 && args[0].isString() && args[1].isString() && args[2].isInt(),
                    "a notice that worker id ", caller, " joined needs its name, host and port");
  const int64_t port = args[2].toInt();
  TORCH_CHECK_VALUE(port > 0 && port <= 65535, "worker id ", caller, " joined with port ", port);
  group_.table().add(WorkerInfo{args[0].toStringRef(), caller}, args[1].toStringRef(),
                     static_cast<int>(port));
  return c10::IValue(!leaving_.load());
}

void Membership::on_peer_gone(int peer) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    gone_.insert(peer);
  }
  if (lost_members_) lost_members_->suspect(peer);
}

std::exception_ptr Membership::leave_group(std::chrono::steady_clock::time_point deadline) {
  leaving_ = true;
  std::exception_ptr failure;
  if (group_.has_store_host() && group_.rank() == 0) {
    // The store host: the others join and leave through its store, so it leaves last.
    try {
      wait_for_others_to_leave(deadline);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  group_.leave();
  return failure;
}

void Membership::tell_members_left(std::chrono::steady_clock::time_point deadline) {
  std::vector<std::pair<int, c10::intrusive_ptr<c10::ivalue::Future>>> notices;
  for (const WorkerInfo& member : group_.workers()) {
    if (member.id == group_.rank()) continue;
    // A member that does not answer within liveness_timeout is stopped, hung or gone: it sees
    // this worker's connections end.
    const auto timeout =
        std::min(options_.liveness_timeout(), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                  deadline - std::chrono::steady_clock::now()));
    notices.emplace_back(member.id, send_(member.id, kMemberLeft, {},
                                          std::max(timeout, std::chrono::milliseconds(1))));
  }
  for (auto& [member, notice] : notices) notice->wait();
}

// The member's connection ended without a notice and it failed a liveness check: it is gone. Its
// rank stays used (ids are never reused); its name may be taken by a worker joining later.
void Membership::drop_member(int id, const std::string& why) {
  group_.drop(id);
  if (!group_.table().mark_left(id)) return;  // Its notice that it left came meanwhile.
  caller_lost_(id);
  TORCH_WARN("rpc: worker '", self().name, "' dropped worker '", name_of(id), "' (rank ", id,
             ") from the group: its connection ended without a notice that it left, and ", why);
  for (const WorkerInfo& member : group_.workers()) {
    if (member.id == group_.rank()) continue;
    // Not waited for: a member that does not hear it sees the dropped worker's connections end.
    (void)send_(member.id, kMemberDropped, {c10::IValue(static_cast<int64_t>(id))},
                options_.liveness_timeout());
  }
}

// Waits while the members that stay are alive: one that dies (its connection ends) or does not
// answer a liveness check (stopped, hung, unreachable) is not waited for.
void Membership::wait_for_others_to_leave(std::chrono::steady_clock::time_point deadline) {
  LivenessProbe probe(
      [this](int peer, std::chrono::milliseconds timeout) {
        return send_(peer, kAliveFunction, {}, timeout);
      },
      options_.liveness_timeout());
  auto next_check = std::chrono::steady_clock::now();
  while (true) {
    std::vector<int> ids;
    std::string staying;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const WorkerInfo& member : group_.workers()) {
        if (member.id == group_.rank() || gone_.count(member.id) > 0) continue;
        ids.push_back(member.id);
        staying += (staying.empty() ? "'" : ", '") + member.name + "' (rank " +
                   std::to_string(member.id) + ")";
      }
    }
    if (ids.empty()) return;
    DISTOPTIM_CHECK_WITH(
        TimeoutError, std::chrono::steady_clock::now() < deadline, "rpc shutdown: worker '",
        self().name, "' serves the group's store and leaves last, but after ",
        options_.shutdown_timeout().count(), " ms these workers had not left: ", staying);
    if (std::chrono::steady_clock::now() >= next_check) {
      if (auto silent = probe.check(ids)) {
        TORCH_WARN("rpc shutdown: worker '", self().name, "' does not wait for worker '",
                   name_of(silent->first), "' to leave: ", silent->second);
        std::lock_guard<std::mutex> lock(mutex_);
        gone_.insert(silent->first);
      }
      next_check = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void Membership::stop() {
  if (lost_members_) lost_members_->stop();
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
