// The RRef context's tables and the user's side of the protocol (rref_context.h): making owner
// handles, remote(), confirm(), to_here() and local values, a user's delete when its last handle
// goes, and the tables' fate when a peer is lost, comes back or the agent stops. RRefs inside
// messages are rref_transfer.cpp's; received control messages are rref_control_handlers.cpp's.

#include "rref_context.h"

#include <iterator>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>
#include <distoptim/rpc/errors.h>

#include "executor.h"
#include "interception.h"

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

// Waits for `future` at most `timeout` (kNoTimeout: without limit); whether it completed.
bool wait_for(const c10::intrusive_ptr<c10::ivalue::Future>& future,
              std::chrono::milliseconds timeout) {
  if (timeout == kNoTimeout) return wait_future(*future);
  return wait_future(*future, std::chrono::steady_clock::now() + timeout);
}

}  // namespace

// A user handle's last reference is gone: the owner is told (the protocol's delete). Defined
// here, with the protocol; c10::intrusive_ptr calls release_resources() when the last strong
// reference goes and weak ones (the user table's) remain, and only the destructor otherwise:
// either may come first.
void RRefImpl::on_last_handle_dropped() noexcept {
  if (isOwner() || !release()) return;
  try {
    if (auto context = context_.lock()) context->on_user_deleted(*this);
  } catch (...) {
    // The agent is stopping; the owner frees the value when it stops too.
  }
}

RRefContext::RRefContext(RRefChannel& channel, const std::shared_ptr<void>& owner, int self,
                         const WorkerTable& workers, std::chrono::milliseconds default_timeout,
                         WireLimits limits)
    : channel_(channel),
      handle_(std::shared_ptr<RRefContext>(owner, this)),
      self_(self),
      workers_(workers),
      default_timeout_(default_timeout),
      limits_(limits),
      lost_(workers_.id_capacity(), false) {}

bool RRefContext::is_control(const std::string& callable) {
  return callable.compare(0, std::char_traits<char>::length(kRRefControlPrefix),
                          kRRefControlPrefix) == 0;
}

bool RRefContext::carries_user_values(const std::string& callable) {
  return !is_control(callable) || callable == control_name(ControlKind::kFetch);
}

int RRefContext::checked_worker(int64_t id, const char* what) const {
  const auto table = workers_.snapshot();
  if (!workers_.dynamic()) {
    const size_t world_size = table->entries.size();
    TORCH_CHECK_VALUE(id >= 0 && id < static_cast<int64_t>(world_size), "rref: ", what, " ", id,
                      " is not a worker id (world size ", world_size, ")");
  } else {
    TORCH_CHECK_VALUE(
        id >= 0 && id <= WorkerTable::kMaxDynamicId && table->find(static_cast<int>(id)) != nullptr,
        "rref: ", what, " ", id, " is not the id of a worker that has joined");
  }
  return static_cast<int>(id);
}

GlobalId RRefContext::checked_id(const ControlId& id) const {
  return GlobalId{checked_worker(id.created_on, "a creator id"), id.local_id};
}

void RRefContext::send_control(int to, ControlRequest request) {
  try {
    channel_.send_control(to, request.callable, std::move(request.args), kDefaultTimeout);
  } catch (const c10::Error&) {
    // The agent is shutting down: every table goes with it.
  }
}

c10::intrusive_ptr<RRefImpl> RRefContext::make_owned(c10::IValue value) {
  auto owned = std::make_shared<OwnedValue>();
  owned->future->markCompleted(std::move(value));
  return c10::make_intrusive<RRefImpl>(handle_, self_, name(self_), new_id(), std::move(owned));
}

c10::intrusive_ptr<RRefImpl> RRefContext::remote(int to, const std::string& callable,
                                                 std::vector<c10::IValue> args,
                                                 std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(!callable.empty() && !is_control(callable), "remote: '", callable,
                    "' is not a function or class name (calling worker '", name(to), "')");
  const GlobalId rref_id = new_id();
  const std::string& owner_name = name(to);
  if (to == self_) {
    // Owned here, but as to another worker: the callable gets copies of the arguments, through
    // the wire format without the network, and the interceptor sees both sides.
    const MessageInfo info{MessageInfo::Kind::kRequest, self_, callable, 0};
    const CallMetadata metadata = intercept_send(info, args);
    auto owned = std::make_shared<OwnedValue>();
    auto result = channel_.run_locally(callable, through_wire_to_self(callable, args),
                                       [info, metadata](std::vector<c10::IValue>& values) {
                                         return intercept_receive(info, values, metadata);
                                       });
    result->addCallback([owned](c10::ivalue::Future& done) {
      if (done.hasError()) {
        owned->future->setErrorIfNeeded(done.exception_ptr());
      } else {
        owned->future->markCompleted(done.value());
      }
    });
    return c10::make_intrusive<RRefImpl>(handle_, to, owner_name, rref_id, std::move(owned));
  }
  const GlobalId fork_id = new_id();
  // The interceptor sees the creation's arguments, as those of a call of `callable`.
  auto intercept = [to](uint64_t id, std::vector<c10::IValue>& create_args) {
    CreateMessage create;
    const Status malformed = decode_control(create_args, &create);
    TORCH_INTERNAL_ASSERT(
        !malformed, "rref: a create this worker encoded did not decode: ", malformed.value_or(""));
    CallMetadata metadata =
        intercept_send({MessageInfo::Kind::kRequest, to, create.callable, id}, create.args);
    create_args = encode_control(std::move(create)).args;
    return metadata;
  };
  ControlRequest create = encode_control(
      CreateMessage{ControlId::of(rref_id), ControlId::of(fork_id), callable, std::move(args)});
  auto creation = channel_.send_control(to, create.callable, std::move(create.args), timeout,
                                        std::move(intercept));
  auto user =
      c10::make_intrusive<RRefImpl>(handle_, to, owner_name, rref_id, fork_id, std::move(creation));
  std::lock_guard<std::mutex> lock(mutex_);
  users_.emplace(fork_id, c10::weak_intrusive_ptr<RRefImpl>(user));
  return user;
}

c10::IValue RRefContext::local_value(const RRefImpl& rref, std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(rref.isOwner(), "local_value: ", rref.describe(), ", not by this worker '",
                    name(self_), "'; use to_here() on a user");
  const auto& future = rref.value()->future;
  DISTOPTIM_CHECK_WITH(TimeoutError, wait_for(future, effective_timeout(timeout)),
                       "rref: the value of ", rref.describe(), " was not created within ",
                       effective_timeout(timeout).count(), " ms");
  if (future->hasError()) std::rethrow_exception(future->exception_ptr());
  return future->value();
}

void RRefContext::confirm(const RRefImpl& rref, std::chrono::milliseconds timeout) {
  if (rref.isOwner()) {
    (void)local_value(rref, timeout);
    return;
  }
  if (!rref.creation()) {
    return;
  }
  // The creation's own timeout (remote()'s) bounds it too.
  DISTOPTIM_CHECK_WITH(TimeoutError, wait_for(rref.creation(), effective_timeout(timeout)),
                       "rref: ", rref.describe(), " was not confirmed by its owner within ",
                       effective_timeout(timeout).count(), " ms");
  rref.creation()->waitAndThrow();
}

c10::IValue RRefContext::to_here(const RRefImpl& rref, std::chrono::milliseconds timeout) {
  if (rref.isOwner()) return local_value(rref, timeout);
  // remote() itself failed (timed out, or the owner refused or died): that is the answer.
  if (rref.creation() && rref.creation()->completed() && rref.creation()->hasError()) {
    std::rethrow_exception(rref.creation()->exception_ptr());
  }
  // The interceptor sees the fetch as a request without values, so that its reply (which carries
  // the value) belongs to whatever the request's metadata says (a distributed autograd context).
  const int owner = static_cast<int>(rref.owner());
  auto intercept = [owner](uint64_t id, std::vector<c10::IValue>&) {
    std::vector<c10::IValue> no_values;
    return intercept_send(
        {MessageInfo::Kind::kRequest, owner, control_name(ControlKind::kFetch), id}, no_values);
  };
  ControlRequest fetch = encode_control(FetchMessage{ControlId::of(rref.rref_id())});
  // Only waited for here: its reply completes on the thread that reads it, which may be this one
  // (wait_future), not on the completion thread.
  auto fetched = channel_.send_control(owner, fetch.callable, std::move(fetch.args), timeout,
                                       intercept, /*waited_only=*/true);
  wait_for(fetched, kNoTimeout);  // The fetch's own timeout bounds it.
  fetched->waitAndThrow();
  return fetched->value();
}

std::vector<c10::IValue> RRefContext::through_wire_to_self(const std::string& callable,
                                                           const std::vector<c10::IValue>& args) {
  ForkBatch forks;
  EncodedMessage message;
  std::vector<c10::IValue> prepared;
  try {
    for (const c10::IValue& arg : args) {
      prepared.push_back(prepare_to_send(arg, self_, &forks));
    }
    message = encode_request(0, callable, prepared, 0, self_);
  } catch (...) {
    rollback(forks);
    throw;
  }
  MessageHeader header;
  TORCH_INTERNAL_ASSERT(!decode_header(message.header, &header));
  std::vector<at::Tensor> buffers;
  for (const at::Tensor& tensor : message.tensors) {
    // A copy of each tensor's bytes, as a receiver's would be.
    buffers.push_back(tensor.reshape({-1}).view(at::kByte).clone());
  }
  DecodedMessage decoded;
  const Status error = decode_body(header, message.body, std::move(buffers), limits_, &decoded);
  TORCH_INTERNAL_ASSERT(
      !error, "rpc: a message to this worker itself did not decode: ", error.value_or(""));
  for (c10::IValue& arg : decoded.args) {
    arg = receive(arg);
  }
  return std::move(decoded.args);
}

std::shared_ptr<OwnedValue> RRefContext::get_or_create_locked(const GlobalId& rref_id) {
  OwnerEntry& entry = owners_[rref_id];
  if (!entry.value) entry.value = std::make_shared<OwnedValue>();
  return entry.value;
}

std::shared_ptr<OwnedValue> RRefContext::erase_fork_locked(const GlobalId& rref_id,
                                                           const GlobalId& fork_id) {
  auto it = owners_.find(rref_id);
  if (it == owners_.end()) return nullptr;
  it->second.forks.erase(fork_id);
  if (!it->second.forks.empty()) return nullptr;
  std::shared_ptr<OwnedValue> freed = std::move(it->second.value);
  owners_.erase(it);
  return freed;
}

void RRefContext::on_user_deleted(const RRefImpl& rref) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    users_.erase(rref.fork_id());
    if (closed_) return;
  }
  send_control(
      static_cast<int>(rref.owner()),
      encode_control(DeleteMessage{ControlId::of(rref.rref_id()), ControlId::of(rref.fork_id())}));
}

void RRefContext::on_peer_back(int peer) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (peer >= 0 && static_cast<size_t>(peer) < lost_.size()) lost_[peer] = false;
}

void RRefContext::on_peer_lost(int peer) {
  std::vector<std::shared_ptr<OwnedValue>> freed;
  std::vector<c10::intrusive_ptr<c10::RRefInterface>> children;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    lost_[peer] = true;
    for (auto it = owners_.begin(); it != owners_.end();) {
      auto& forks = it->second.forks;
      for (auto fork = forks.begin(); fork != forks.end();) {
        fork = fork->second == peer ? forks.erase(fork) : std::next(fork);
      }
      if (forks.empty()) {
        freed.push_back(std::move(it->second.value));
        it = owners_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = pending_children_.begin(); it != pending_children_.end();) {
      if (it->second.child == peer) {
        untie_locked(it->first, it->second);
        children.push_back(std::move(it->second.rref));
        it = pending_children_.erase(it);
      } else {
        ++it;
      }
    }
    children_done_.notify_all();
  }
}

bool RRefContext::release_all_users(std::chrono::steady_clock::time_point deadline) {
  std::vector<c10::intrusive_ptr<RRefImpl>> alive;
  bool settled = false;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    settled =
        children_done_.wait_until(lock, deadline, [this] { return pending_children_.empty(); });
    for (auto& [fork_id, weak] : users_) {
      if (auto user = weak.lock()) alive.push_back(std::move(user));
    }
  }
  for (const auto& user : alive) {
    if (user->release()) on_user_deleted(*user);
  }
  return settled;
}

size_t RRefContext::close() {
  std::map<GlobalId, OwnerEntry> owners;
  std::map<GlobalId, PendingChild> children;
  std::map<GlobalId, c10::weak_intrusive_ptr<RRefImpl>> users;
  size_t left = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
    left = owners_.size();
    owners.swap(owners_);
    children.swap(pending_children_);
    tied_.clear();
    tied_count_.store(0, std::memory_order_release);
    users.swap(users_);
    children_done_.notify_all();
  }
  return left;
}

size_t RRefContext::owned_count() {
  std::lock_guard<std::mutex> lock(mutex_);
  return owners_.size();
}

std::map<std::string, int64_t> RRefContext::debug_info() {
  std::vector<c10::intrusive_ptr<RRefImpl>> users;
  int64_t owners = 0;
  int64_t forks = 0;
  int64_t children = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    owners = static_cast<int64_t>(owners_.size());
    for (const auto& [rref_id, entry] : owners_) forks += static_cast<int64_t>(entry.forks.size());
    children = static_cast<int64_t>(pending_children_.size());
    for (const auto& [fork_id, weak] : users_) {
      if (auto user = weak.lock()) users.push_back(std::move(user));
    }
  }
  int64_t pending = 0;
  for (const auto& user : users) pending += user->confirmedByOwner() ? 0 : 1;
  const auto alive = static_cast<int64_t>(users.size());
  // The handles taken above are dropped outside the lock: the last one tells the owner.
  users.clear();
  return {{"num_owner_rrefs", owners},
          {"num_forks", forks},
          {"num_pending_users", pending},
          {"num_user_rrefs", alive},
          {"num_pending_children", children}};
}

size_t RRefContext::pending_children_count() {
  std::lock_guard<std::mutex> lock(mutex_);
  return pending_children_.size();
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
