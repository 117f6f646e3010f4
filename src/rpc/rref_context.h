#pragma once

// Distributed reference counting of RRefs, after PyTorch's RRef protocol
// (torch/csrc/distributed/rpc/rref_context.h). Terms:
//
// - An RRef names a value by its RRefId (the worker that made the id, a local counter). The
//   value lives on its owner; every other worker holding the RRef is a user, and each user
//   holds its own ForkId.
// - The owner keeps `owners_`: for each RRef some user still holds, the value and the set of
//   forks (ForkId -> the worker holding it). When that set becomes empty the entry is erased and
//   the value is freed, once no handle on the owner itself holds it either.
// - Users keep `users_` (to delete them at graceful shutdown) and `pending_children_`: an RRef a
//   user sent to another worker stays alive on the sender until the owner has registered the
//   receiver's fork, so the owner never frees a value whose new fork is still on its way.
//
// Control messages (requests with MessageHeader::kOrdered, handled on one thread in the order
// they arrive on their connection, so that a fork's registration precedes its deletion):
//   create(rref, fork, callable, args)  user -> owner: register the creator's fork, then run the
//                                        callable on the request pool; its result (or error) is
//                                        the value. Replies once the value is set.
//   fetch(rref)                          user -> owner: replies with the value when it is set.
//   fork(rref, fork)                     new user -> owner: register a fork a user sent on.
//   accept(fork)                         new user (or the owner) -> the sender: release the pending
//                                        child.
//   delete(rref, fork)                   user -> owner: the user dropped its last handle.
// Sending an RRef: the owner registers the receiver's fork at once (no messages needed); a user
// makes a pending child, and the receiver sends fork() to the owner and then accept() to the
// sender, or, when the receiver is the owner, accept() only. A request (not a control message)
// that sends RRefs to their owner says so (MessageHeader::kAcceptedByReply): the owner sends no
// accept() for them, and the sender releases those pending children when the request's reply
// comes, whatever it says and however late (tie_to_reply, on_reply). The owner replies only
// after taking every RRef of the request (its handle then holds the value), so the value is
// still held then. A call that never gets a reply is settled as an unaccepted child always was:
// by the peer's loss, or at shutdown (a request dropped unsent after its timeout, a function
// whose future never completes).
// This saves a control message and its reply per call through an RRef to its owner (a
// DistributedOptimizer's step: one per owner and step).
//
// Each control message's arguments travel as the named fields of its struct in rref_control.h,
// which encodes them and checks received ones. RRefContext's work is in three files:
// rref_context.cpp (the tables and the user's side), rref_transfer.cpp (RRefs inside messages
// sent and received) and rref_control_handlers.cpp (received control messages, dispatched by
// name to their handlers).
//
// Peer death: forks held by a lost worker are erased on the owner (and values freed), pending
// children sent to it are released; a user's to_here on a lost owner fails with PeerLostError
// and its delete is dropped. A reference the lost worker sent to the owner, received after that
// (a request of it that ran late), is refused when its value is gone, rather than owned again
// with no fork to ever free it.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>

#include <distoptim/rpc/api.h>

#include "message.h"
#include "rref_control.h"
#include "rref_handle.h"
#include "worker_table.h"

namespace distoptim {
namespace rpc {
namespace detail {

class RRefContext;

/// Runs the interceptor over a request's arguments once its id is known; returns the metadata.
using SendInterception = std::function<CallMetadata(uint64_t id, std::vector<c10::IValue>& args)>;
/// Runs first on the thread of a local call; what it returns lives while the callable runs.
using Preparation = std::function<std::shared_ptr<void>(std::vector<c10::IValue>& args)>;

/// What the RRef protocol needs of the agent under it: sending its control messages, and running
/// a callable on this worker's request pool (the value of an RRef created here).
class RRefChannel {
 public:
  /// Sends control message `function` to `to`, handled there in the order it arrives
  /// (MessageHeader::kOrdered). `intercept` (optional) runs the interceptor over the arguments
  /// and returns the metadata; without it control messages are not intercepted. `waited_only`:
  /// the caller only waits on the reply's future (PendingCall::waited_only). Throws what sending
  /// throws (DistributedError once the agent is stopping).
  virtual c10::intrusive_ptr<c10::ivalue::Future> send_control(int to, const std::string& function,
                                                               std::vector<c10::IValue> args,
                                                               std::chrono::milliseconds timeout,
                                                               SendInterception intercept = nullptr,
                                                               bool waited_only = false) = 0;
  /// Runs the registered `callable` on this worker's request pool (Dispatcher::run_locally).
  virtual c10::intrusive_ptr<c10::ivalue::Future> run_locally(const std::string& callable,
                                                              std::vector<c10::IValue> args,
                                                              Preparation prepare) = 0;

 protected:
  ~RRefChannel() = default;
};

/// What prepare_to_send registered for one outgoing message, undone if it is never sent.
struct ForkBatch {
  std::vector<std::pair<GlobalId, GlobalId>> owner_forks;  // (rref, fork) added to owners_
  std::vector<GlobalId> pending_children;
};

/// The request a control message came in, as its handler sees it: the sender, and the request's
/// id and metadata (for the interceptor of a create or a fetch). Lives while handle_control runs.
struct ControlCall {
  int caller = -1;
  uint64_t id = 0;
  const CallMetadata& metadata;
};

/// The RRef tables of one agent, and its side of the protocol. Thread safety: one mutex guards
/// the tables; it is never held while sending a message, completing a future or running user
/// code (lock order: this mutex is never taken inside the agent's).
class RRefContext {
 public:
  /// `owner` owns this context and `channel` (the agent), and is already held by a shared
  /// pointer: handles hold the context through it, so that a handle dropped while the agent
  /// stops still finds it whole. `default_timeout` is kDefaultTimeout's meaning.
  RRefContext(RRefChannel& channel, const std::shared_ptr<void>& owner, int self,
              const WorkerTable& workers, std::chrono::milliseconds default_timeout,
              WireLimits limits);

  GlobalId new_id() { return GlobalId{self_, next_local_id_.fetch_add(1)}; }

  /// An owner handle on `value`, on this worker (PyTorch's RRef(value)).
  c10::intrusive_ptr<RRefImpl> make_owned(c10::IValue value);
  /// remote(): the value is `callable(args)` run on `to`. Throws what sending throws.
  c10::intrusive_ptr<RRefImpl> remote(int to, const std::string& callable,
                                      std::vector<c10::IValue> args,
                                      std::chrono::milliseconds timeout);
  /// The value, fetched from the owner (or read on it). Throws RemoteError (creating it failed,
  /// or the owner refused), TimeoutError, PeerLostError.
  c10::IValue to_here(const RRefImpl& rref, std::chrono::milliseconds timeout);
  /// The value on its owner; c10::ValueError on a user.
  c10::IValue local_value(const RRefImpl& rref, std::chrono::milliseconds timeout);
  /// Waits until the owner has confirmed `rref` (for remote(): created its value); throws the
  /// error creating it raised (RemoteError naming the owner), TimeoutError, PeerLostError.
  void confirm(const RRefImpl& rref, std::chrono::milliseconds timeout);

  /// Replaces every RRef handle in `value` by its wire reference for a message to `to`,
  /// registering the forks (recorded in `batch` for rollback).
  c10::IValue prepare_to_send(const c10::IValue& value, int to, ForkBatch* batch);
  void rollback(const ForkBatch& batch);
  /// Before a request `call` with `batch` is sent to `to`: the pending children of `batch` whose
  /// owner is `to` are released by the reply to `call` (on_reply) rather than by accept().
  /// Returns whether there were any (the request then carries MessageHeader::kAcceptedByReply).
  bool tie_to_reply(const ForkBatch& batch, int to, uint64_t call);
  /// A reply (or error, or late reply) to call `call` came from `peer`: releases the pending
  /// children tied to it. Lock-free when no child is tied to any reply.
  void on_reply(int peer, uint64_t call);
  /// Replaces every wire reference in a received `value` by a handle. Throws c10::ValueError for
  /// a reference naming a worker outside the world. `accepted_by_reply`: the value came in a
  /// request with MessageHeader::kAcceptedByReply, so its sender needs no accept() for the
  /// references to this worker's own values.
  c10::IValue receive(const c10::IValue& value, bool accepted_by_reply = false);

  static bool is_control(const std::string& callable);
  /// Whether replies to `callable` carry user values the interceptor sees: those of every call
  /// but the control messages, of which only a fetch's (to_here's result). A create's arguments
  /// are seen on their own (RRefContext::remote, handle_control).
  static bool carries_user_values(const std::string& callable);
  /// Handles a control message (on the agent's ordered thread); returns the reply's future.
  /// Throws c10::ValueError for an unknown name, malformed arguments or an id of no worker.
  /// `id` and `metadata`: the request's, for the interceptor of a create or a fetch.
  c10::intrusive_ptr<c10::ivalue::Future> handle_control(const std::string& callable,
                                                         std::vector<c10::IValue> args, int caller,
                                                         uint64_t id = 0,
                                                         const CallMetadata& metadata = {});

  /// A user handle died: tell the owner.
  void on_user_deleted(const RRefImpl& rref);
  void on_peer_lost(int peer);
  /// `peer` proved itself on a new connection after its loss here: RRefs it sends are taken again.
  void on_peer_back(int peer);
  /// Graceful shutdown: waits (until `deadline`) for pending children to be accepted, then
  /// deletes every user handle still alive on its owner. Returns false on timeout.
  bool release_all_users(std::chrono::steady_clock::time_point deadline);
  /// Drops every table (the agent is stopping); returns how many values were still owned.
  size_t close();

  size_t owned_count();
  size_t pending_children_count();
  /// PyTorch's RRefContext::getDebugInfo names: "num_owner_rrefs" (values owned here that some
  /// user holds), "num_forks" (their users' forks), "num_pending_users" (user handles alive here
  /// whose owner has not confirmed them yet); and "num_user_rrefs" (user handles alive here),
  /// "num_pending_children" (RRefs sent on, waiting for their owner to register the receiver).
  std::map<std::string, int64_t> debug_info();

 private:
  struct OwnerEntry {
    std::shared_ptr<OwnedValue> value;
    std::map<GlobalId, int> forks;  // ForkId -> the worker holding it
  };
  struct PendingChild {
    c10::intrusive_ptr<c10::RRefInterface> rref;
    int child = -1;
    uint64_t call = 0;  // the call whose reply releases it (tie_to_reply); 0: accept() does
  };
  // Forgets the tie of a child released otherwise (rollback, peer loss).
  void untie_locked(const GlobalId& fork_id, const PendingChild& child);  // requires mutex_

  std::shared_ptr<OwnedValue> get_or_create_locked(const GlobalId& rref_id);  // requires mutex_
  // Erases a fork; returns the value if that freed it (to be dropped outside the lock).
  std::shared_ptr<OwnedValue> erase_fork_locked(const GlobalId& rref_id,
                                                const GlobalId& fork_id);  // requires mutex_
  int checked_worker(int64_t id, const char* what) const;
  /// A received id whose creator is a worker; c10::ValueError otherwise.
  GlobalId checked_id(const ControlId& id) const;
  /// Sends `request` and forgets it (no reply awaited; nothing sent once the agent stops).
  void send_control(int to, ControlRequest request);

  // The handlers of received control messages (handle_control's table), on the ordered thread.
  c10::intrusive_ptr<c10::ivalue::Future> handle_create(CreateMessage create,
                                                        const ControlCall& call);
  c10::intrusive_ptr<c10::ivalue::Future> handle_fetch(FetchMessage fetch, const ControlCall& call);
  c10::intrusive_ptr<c10::ivalue::Future> handle_fork(ForkMessage fork, const ControlCall& call);
  c10::intrusive_ptr<c10::ivalue::Future> handle_delete(DeleteMessage deleted,
                                                        const ControlCall& call);
  c10::intrusive_ptr<c10::ivalue::Future> handle_accept(AcceptMessage accept,
                                                        const ControlCall& call);
  std::chrono::milliseconds effective_timeout(std::chrono::milliseconds timeout) const {
    return timeout == kDefaultTimeout ? default_timeout_ : timeout;
  }
  std::string name(int worker) const { return workers_.snapshot()->name(worker); }
  /// `args` as a worker receives them from this one (encoded, decoded: copies, with the RRefs
  /// among them forked), for a call to this worker itself that must behave as to another.
  std::vector<c10::IValue> through_wire_to_self(const std::string& callable,
                                                const std::vector<c10::IValue>& args);

  RRefChannel& channel_;
  const std::weak_ptr<RRefContext> handle_;  // this, held through its owner
  const int self_;
  const WorkerTable& workers_;  // outlives this object
  const std::chrono::milliseconds default_timeout_;
  const WireLimits limits_;
  std::atomic<int64_t> next_local_id_{0};

  std::mutex mutex_;
  std::condition_variable children_done_;
  std::map<GlobalId, OwnerEntry> owners_;              // guarded by mutex_
  std::map<GlobalId, PendingChild> pending_children_;  // by fork id; guarded by mutex_
  struct TiedCall {
    int to = -1;                  // the worker the call went to, the children's owner
    std::vector<GlobalId> forks;  // the pending children its reply releases
  };
  std::map<uint64_t, TiedCall> tied_;  // by call id; guarded by mutex_
  std::atomic<size_t> tied_count_{0};  // tied_.size(), read without the lock
  std::map<GlobalId, c10::weak_intrusive_ptr<RRefImpl>> users_;  // by fork id; guarded by mutex_
  bool closed_ = false;                                          // guarded by mutex_
  std::vector<bool> lost_;  // by worker id: on_peer_lost ran for it; guarded by mutex_
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
