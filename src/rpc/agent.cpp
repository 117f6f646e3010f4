#include "agent.h"

#include <algorithm>
#include <atomic>

#include <distoptim/comm/errors.h>

#include "debug_info_sources.h"
#include "future_errors.h"
#include "interception.h"
#include "liveness.h"
#include "refusal_log.h"

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

// How long a graceful shutdown without shutdown_timeout lets this worker's own calls and requests
// finish: far enough to mean "until they do" (each call has its own timeout), near enough for
// the condition variables' clocks.
constexpr auto kUnboundedDrain = std::chrono::hours(24 * 365);

}  // namespace

std::shared_ptr<Agent> Agent::create(const std::string& name, int rank, int world_size,
                                     const RpcBackendOptions& options) {
  std::shared_ptr<Agent> agent(new Agent(rank, world_size, options));
  try {
    agent->start(name);
  } catch (...) {
    // A worker joining later must not wait for this one: it never joined.
    agent->membership_.abandon_join();
    agent->stop();
    throw;
  }
  return agent;
}

Agent::Agent(int rank, int world_size, const RpcBackendOptions& options)
    : options_(options),
      group_(rank, world_size, options),
      pending_([this](std::vector<PendingCall> expired) { on_calls_expired(std::move(expired)); }),
      dispatcher_(options, limits_, pending_),
      peers_(group_.listen_address(), limits_, options.inbound_queue_bytes(),
             options.frame_stall_timeout(), options.same_host_unix_sockets()),
      membership_(
          group_, options,
          [this](int to, const std::string& function, std::vector<c10::IValue> args,
                 std::chrono::milliseconds timeout) {
            return send(to, function, std::move(args), timeout);
          },
          [this](int id) { dispatcher_.caller_lost(id); },
          [this](int id) { return peers_.refused_us(id); }) {}

void Agent::start(const std::string& name) {
  if (group_.dynamic()) {
    group_.claim(name, peers_.listen_address(), peers_.listen_port());
  } else {
    group_.join(name, peers_.listen_address(), peers_.listen_port());
  }
  rrefs_ = std::make_unique<RRefContext>(*this, shared_from_this(), group_.rank(), group_.table(),
                                         options_.rpc_timeout(), limits_);
  dispatcher_.start(group_.rank(), group_.table(), rrefs_.get(), weak_from_this(),
                    [this](int caller, const std::string& notice, std::vector<c10::IValue> args) {
                      return membership_.on_notice(caller, notice, std::move(args));
                    });
  HandshakeConfig handshake;
  handshake.secret = options_.shared_secret();
  handshake.self_id = group_.rank();
  handshake.self_name = name;
  handshake.timeout = options_.handshake_timeout();
  handshake.peer_memory = options_.same_host_memory_reads();
  handshake.same_user_only =
      options_.shared_secret().empty() && !options_.insecure_without_secret();
  handshake.refusals = std::make_shared<RefusalLog>(name);
  handshake.own_key = group_.own_key();
  // A key known already answers at once, on the I/O thread; otherwise the handshake goes on
  // from the I/O loop once the lookup thread has answered.
  handshake.member_key = [this](int id, MemberKeys::Resolved done) {
    if (std::optional<std::string> key = group_.keys().find(id)) {
      done(std::move(key), "");
      return;
    }
    group_.keys().resolve(id, [this, done](std::optional<std::string> key, const std::string& why) {
      peers_.run_on_loop([done, key, why] { done(key, why); });
    });
  };
  PeerEvents events;
  events.on_request = [this](const std::shared_ptr<Connection>& connection, int caller,
                             Frame frame) {
    return dispatcher_.on_request_frame(connection, caller, std::move(frame));
  };
  events.on_reply = [this](int peer, Frame frame) {
    dispatcher_.on_reply_frame(peer, std::move(frame));
  };
  // A caller's connection closed: it died or stopped. Forks it held are gone with it, after the
  // control messages it sent before (they run on the same ordered thread).
  events.on_caller_gone = [this](int caller) {
    dispatcher_.caller_lost(caller);
    dispatcher_.post_ordered([this, caller] { on_peer_gone(caller); });
  };
  // A caller proved itself on a new connection: it is alive, whatever closed before under its
  // identity (a stale connection, or another process holding the secret). Unless this worker lost
  // its own connection to it for good, its requests run again and the RRefs it sends are taken,
  // after the control messages received before.
  events.on_caller_proven = [this](int caller) {
    if (peers_.dead_peers().count(caller) != 0) return;
    dispatcher_.caller_back(caller);
    dispatcher_.post_ordered([this, caller] { rrefs_->on_peer_back(caller); });
  };
  events.on_peer_lost = [this](int peer, const std::string& why) { on_peer_lost(peer, why); };
  membership_.watch_lost_members();
  // Only now, with every worker known, take peers' connections (they wait in the backlog).
  peers_.start(std::move(handshake), group_.table(), std::move(events));
  if (group_.dynamic()) membership_.announce_join();
}

WorkerInfo Agent::member(int id) const {
  const auto table = group_.table().snapshot();
  const WorkerTable::Entry* entry = table->find(id);
  TORCH_CHECK_VALUE(entry != nullptr, "rpc: no worker has id ", id);
  TORCH_CHECK_VALUE(!entry->left, "rpc: worker '", entry->info.name, "' (id ", id,
                    ") left the group (workers: ", table->describe_members(), ")");
  return entry->info;
}

Agent::~Agent() {
  try {
    stop();
  } catch (...) {
  }
}

std::map<std::string, int64_t> Agent::debug_info() {
  std::map<std::string, int64_t> info = peers_.debug_info();
  info.merge(rrefs_->debug_info());
  info.merge(debug_info_from_sources());
  info["agent.num_pending_requests"] = static_cast<int64_t>(pending_.size());
  info["agent.num_requests_in_flight"] = dispatcher_.requests_in_flight();
  info["agent.num_dropped_requests"] = dispatcher_.dropped_requests();
  return info;
}

void Agent::on_peer_lost(int peer, const std::string& why) {
  bool stopping = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping = state_ != State::kRunning;
  }
  if (!stopping) {
    dispatcher_.caller_lost(peer);
    dispatcher_.post_ordered([this, peer] { on_peer_gone(peer); });
  }
  // Not taken here but behind the replies read before the connection ended: a worker leaving
  // the group writes its last replies, then closes, and those replies answer their calls.
  dispatcher_.fail_calls_to(peer, [this, peer, why, stopping](const PendingCall& call) {
    const auto table = group_.table().snapshot();
    const std::string worker = table->name(peer);
    const WorkerTable::Entry* entry = table->find(peer);
    if (stopping) {
      return DISTOPTIM_RPC_ERROR(DistributedError, "rpc: the agent shut down before worker '" +
                                                       worker + "' answered '" + call.function +
                                                       "'");
    }
    if (entry != nullptr && entry->left) {
      return DISTOPTIM_RPC_ERROR(PeerLostError, "rpc: worker '" + worker +
                                                    "' left the group before it answered '" +
                                                    call.function + "' (" + why + ")");
    }
    return DISTOPTIM_RPC_ERROR(PeerLostError, "rpc: lost the connection to worker '" + worker +
                                                  "' (" + why + "); the call to '" + call.function +
                                                  "' failed");
  });
}

// Calls past their deadline fail; a message of theirs still waiting to be written is dropped,
// so a stalled peer cannot make a worker hold the arguments of calls that already failed.
void Agent::on_calls_expired(std::vector<PendingCall> expired) {
  for (const PendingCall& call : expired) {
    peers_.drop_queued(call.to, call.id);
  }
  dispatcher_.fail_calls(std::move(expired), [this](const PendingCall& call) {
    return DISTOPTIM_RPC_ERROR(
        TimeoutError,
        "rpc: the call to '" + call.function + "' on worker '" + name_of(call.to) + "' timed out");
  });
}

c10::intrusive_ptr<c10::ivalue::Future> Agent::send(int to, const std::string& function,
                                                    std::vector<c10::IValue> args,
                                                    std::chrono::milliseconds timeout,
                                                    bool waited_only) {
  return send_message(to, function, std::move(args), timeout, /*flags=*/0, nullptr, waited_only);
}

c10::intrusive_ptr<c10::ivalue::Future> Agent::send_control(int to, const std::string& function,
                                                            std::vector<c10::IValue> args,
                                                            std::chrono::milliseconds timeout,
                                                            SendInterception intercept,
                                                            bool waited_only) {
  return send_message(to, function, std::move(args), timeout, MessageHeader::kOrdered, intercept,
                      waited_only);
}

c10::intrusive_ptr<c10::ivalue::Future> Agent::send_message(int to, const std::string& function,
                                                            std::vector<c10::IValue> args,
                                                            std::chrono::milliseconds timeout,
                                                            uint16_t flags,
                                                            const SendInterception& intercept,
                                                            bool waited_only) {
  // Held for the call: `worker` lives in it.
  const std::shared_ptr<const WorkerTable::Snapshot> table = group_.table().snapshot();
  const WorkerTable::Entry* entry = table->find(to);
  TORCH_INTERNAL_ASSERT(entry != nullptr, "rpc: no worker has id ", to);
  const std::string& worker = entry->info.name;
  if (entry->left) {
    // Known to be gone: failed at once, before anything is forked or sent.
    auto failed = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
    failed->setError(DISTOPTIM_RPC_ERROR(PeerLostError,
                                         "rpc: worker '" + worker + "' (id " + std::to_string(to) +
                                             ") left the group; cannot call '" + function + "'"));
    return failed;
  }
  TORCH_CHECK_VALUE(timeout == kDefaultTimeout || timeout.count() >= 0, "rpc: timeout of ",
                    timeout.count(), " ms calling '", function, "' on worker '", worker,
                    "' (use a positive value, kNoTimeout or kDefaultTimeout)");
  TORCH_CHECK_VALUE(!function.empty(), "rpc: the function name is empty (calling worker '", worker,
                    "')");
  const std::chrono::milliseconds effective = effective_timeout(timeout);
  static std::atomic<uint64_t> next_id{1};
  const uint64_t id = next_id.fetch_add(1);
  // Encoding checks every argument (and may throw) before the call is registered anywhere;
  // forks of RRefs among the arguments are undone if the message is not sent. Control messages
  // are intercepted only where the RRef protocol asks.
  CallMetadata metadata;
  if (intercept) {
    metadata = intercept(id, args);
  } else if ((flags & MessageHeader::kOrdered) == 0) {
    metadata = intercept_send({MessageInfo::Kind::kRequest, to, function, id}, args);
  }
  ForkBatch forks;
  EncodedMessage message;
  try {
    for (c10::IValue& arg : args) {
      arg = rrefs_->prepare_to_send(arg, to, &forks);
    }
    // RRefs sent to their owner in a request are settled by its reply, not by accept messages.
    if ((flags & MessageHeader::kOrdered) == 0 && !forks.pending_children.empty() &&
        rrefs_->tie_to_reply(forks, to, id)) {
      flags |= MessageHeader::kAcceptedByReply;
    }
    message = encode_request(id, function, args, effective.count(), group_.rank(), flags, metadata);
  } catch (...) {
    rrefs_->rollback(forks);
    throw;
  }
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  PendingCall call;
  call.id = id;
  call.future = future;
  call.to = to;
  call.function = function;
  call.waited_only = waited_only;
  if (waited_only) {
    call.leading_waiter = CallingThread::current();
  }
  if (effective.count() > 0) {
    call.has_deadline = true;
    call.deadline = std::chrono::steady_clock::now() + effective;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  if (state_ != State::kRunning) {
    lock.unlock();
    rrefs_->rollback(forks);
    DISTOPTIM_THROW(DistributedError, "rpc: the agent is shutting down; cannot call '", function,
                    "' on worker '", worker, "'");
  }
  pending_.add(std::move(call));
  std::optional<std::string> lost = peers_.send(to, std::move(message));
  lock.unlock();
  if (lost) {
    // Failed here unless the loss already took it (and failed it the same way).
    if (pending_.take(id, to)) {
      rrefs_->rollback(forks);
      future->setError(DISTOPTIM_RPC_ERROR(PeerLostError, "rpc: lost the connection to worker '" +
                                                              worker + "' (" + *lost +
                                                              "); cannot call '" + function + "'"));
    }
  }
  return future;
}

void Agent::offer_loop_to(std::shared_ptr<const CallingThread> caller) {
  peers_.run_on_loop(
      [this, caller = std::move(caller)] { dispatcher_.leave_loop_for_replies_of(caller); });
}

void Agent::on_peer_gone(int peer) {
  membership_.on_peer_gone(peer);
  rrefs_->on_peer_lost(peer);
  if (auto installed = interceptor()) {
    installed->on_peer_lost(peer);
  }
}

void Agent::shutdown(bool graceful) {
  std::exception_ptr failure;
  if (graceful && group_.dynamic()) {
    try {
      leave();
    } catch (...) {
      failure = std::current_exception();
    }
  } else if (graceful) {
    try {
      const auto barrier = [this](const std::string& round, bool wait) {
        LivenessProbe probe(
            [this](int peer, std::chrono::milliseconds timeout) {
              return send(peer, kAliveFunction, {}, timeout);
            },
            options_.liveness_timeout(), [this](int peer) { return peers_.refused_us(peer); });
        WorkerGroup::BarrierWatch watch;
        watch.dead_peers = [this] { return peers_.dead_peers(); };
        watch.check_alive = [&probe](const std::vector<int>& peers) { return probe.check(peers); };
        group_.barrier(round, wait, watch);
      };
      barrier("entered", /*wait=*/true);
      // Every worker has stopped making calls: delete the RRefs its users still hold, so that
      // owners free their values before the agents stop (PyTorch does the same at shutdown).
      // Without a shutdown_timeout this waits for this worker's own calls, each bounded by its
      // timeout, and for the requests it runs.
      const auto bound = options_.shutdown_timeout();
      const auto deadline =
          std::chrono::steady_clock::now() + (bound.count() > 0 ? bound : kUnboundedDrain);
      rrefs_->release_all_users(deadline);
      const bool calls_done = pending_.wait_empty(deadline);
      const int requests_left = dispatcher_.wait_idle(deadline);
      DISTOPTIM_CHECK_WITH(TimeoutError, calls_done && requests_left == 0, "rpc shutdown: worker '",
                           self().name, "' still had ", pending_.size(), " call(s) and ",
                           requests_left, " request(s) outstanding after ", bound.count(), " ms");
      barrier("drained", /*wait=*/true);
      // Rank 0 serves the store: it leaves last, once every worker is past the barrier.
      barrier("left", /*wait=*/group_.rank() == 0);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  stop();
  if (failure) {
    std::rethrow_exception(failure);
  }
}

void Agent::leave() {
  // Without a shutdown_timeout: as long as the workers waited for are alive (the store host's
  // wait) and this worker's own calls and requests take (each call has its timeout).
  const auto bound = options_.shutdown_timeout();
  const auto deadline =
      std::chrono::steady_clock::now() + (bound.count() > 0 ? bound : kUnboundedDrain);
  const std::exception_ptr failure = membership_.leave_group(deadline);
  // Delete the references this worker holds while their owners still hear it.
  rrefs_->release_all_users(deadline);
  membership_.tell_members_left(deadline);
  const bool calls_done = pending_.wait_empty(deadline);
  const int requests_left = dispatcher_.wait_idle(deadline);
  // The replies of the requests just finished may still be queued on their connections: written
  // before the connections close (no barrier follows a leave to give them the time).
  peers_.wait_writes_done(
      std::min(deadline, std::chrono::steady_clock::now() + options_.liveness_timeout()));
  if (failure) std::rethrow_exception(failure);
  DISTOPTIM_CHECK_WITH(TimeoutError, calls_done && requests_left == 0, "rpc shutdown: worker '",
                       self().name, "' still had ", pending_.size(), " call(s) and ", requests_left,
                       " request(s) outstanding after ", bound.count(), " ms");
}

void Agent::stop() {
  // First: a member dropped now would be told by calls that fail.
  membership_.stop();
  // No key lookup answers a handshake once the transport stops.
  group_.keys().stop();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (state_ != State::kRunning) {
      return;
    }
    state_ = State::kStopping;
  }
  // After this no transport callback runs any more; calls still pending failed with the agent's
  // shutdown as their peers' connections closed, or fail below.
  peers_.stop();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    state_ = State::kStopped;
  }
  pending_.stop();
  // Fail what is left before joining the request pool and the I/O loop's threads (a request
  // may run on one): a request blocked on a nested call is waiting for exactly these futures.
  dispatcher_.fail_calls(pending_.take_all(), [this](const PendingCall& call) {
    return DISTOPTIM_RPC_ERROR(DistributedError, "rpc: the agent shut down before worker '" +
                                                     name_of(call.to) + "' answered '" +
                                                     call.function + "'");
  });
  dispatcher_.stop();
  peers_.join();
  if (rrefs_) {
    owned_at_stop_ = rrefs_->close();
  }
  group_.close();
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
