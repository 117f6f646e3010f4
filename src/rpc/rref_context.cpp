#include "rref_context.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/jit_type.h>
#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>
#include <distoptim/rpc/classes.h>
#include <distoptim/rpc/errors.h>
#include <distoptim/rpc/values.h>

#include "executor.h"
#include "interception.h"
#include "reply_snapshot.h"

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

const std::string kCreate = std::string(RRefContext::kControlPrefix) + "create";
const std::string kFetch = std::string(RRefContext::kControlPrefix) + "fetch";
const std::string kFork = std::string(RRefContext::kControlPrefix) + "fork";
const std::string kAccept = std::string(RRefContext::kControlPrefix) + "accept";
const std::string kDelete = std::string(RRefContext::kControlPrefix) + "delete";

bool contains_rref(const c10::IValue& value) {
  if (value.isRRef()) return true;
  if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) {
      if (contains_rref(item)) return true;
    }
  } else if (value.isTuple()) {
    for (const c10::IValue& item : value.toTupleRef().elements()) {
      if (contains_rref(item)) return true;
    }
  } else if (value.isGenericDict()) {
    for (const auto& entry : value.toGenericDict()) {
      if (contains_rref(entry.value())) return true;
    }
  }
  return false;
}

// A copy of `value` with every RRef replaced by map(rref); containers without RRefs are shared.
template <class Map>
c10::IValue map_rrefs(const c10::IValue& value, const Map& map) {
  if (!contains_rref(value)) return value;
  if (value.isRRef()) return map(value.toRRef());
  if (value.isList()) {
    c10::impl::GenericList list(c10::AnyType::get());
    for (const c10::IValue& item : value.toListRef()) list.push_back(map_rrefs(item, map));
    return c10::IValue(std::move(list));
  }
  if (value.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const c10::IValue& item : value.toTupleRef().elements()) {
      elements.push_back(map_rrefs(item, map));
    }
    return c10::IValue(c10::ivalue::Tuple::create(std::move(elements)));
  }
  const auto dict = value.toGenericDict();
  c10::impl::GenericDict out(dict.keyType(), c10::AnyType::get());
  for (const auto& entry : dict) out.insert(entry.key(), map_rrefs(entry.value(), map));
  return c10::IValue(std::move(out));
}

int64_t int_arg(const std::vector<c10::IValue>& args, size_t index, const std::string& callable) {
  TORCH_CHECK_VALUE(index < args.size() && args[index].isInt(), "rref control message '", callable,
                    "': argument ", index, " is missing or not an int");
  return args[index].toInt();
}

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
  return callable.compare(0, std::char_traits<char>::length(kControlPrefix), kControlPrefix) == 0;
}

bool RRefContext::carries_user_values(const std::string& callable) {
  return !is_control(callable) || callable == kFetch;
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

void RRefContext::send_control(int to, const std::string& name, std::vector<c10::IValue> args) {
  try {
    channel_.send_control(to, name, std::move(args), kDefaultTimeout);
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
  c10::impl::GenericList call_args(c10::AnyType::get());
  for (auto& arg : args) call_args.push_back(std::move(arg));
  // The interceptor sees the creation's arguments, as those of a call of `callable`.
  auto intercept = [to, callable](uint64_t id, std::vector<c10::IValue>& create_args) {
    std::vector<c10::IValue> values;
    for (const c10::IValue& arg : create_args[5].toListRef()) values.push_back(arg);
    CallMetadata metadata = intercept_send({MessageInfo::Kind::kRequest, to, callable, id}, values);
    c10::impl::GenericList replaced(c10::AnyType::get());
    for (c10::IValue& value : values) replaced.push_back(std::move(value));
    create_args[5] = c10::IValue(std::move(replaced));
    return metadata;
  };
  auto creation =
      channel_.send_control(to, kCreate,
                            {rref_id.created_on, rref_id.local_id, fork_id.created_on,
                             fork_id.local_id, callable, c10::IValue(std::move(call_args))},
                            timeout, intercept);
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
    return intercept_send({MessageInfo::Kind::kRequest, owner, kFetch, id}, no_values);
  };
  // Only waited for here: its reply completes on the thread that reads it, which may be this one
  // (wait_future), not on the completion thread.
  auto fetched =
      channel_.send_control(owner, kFetch, {rref.rref_id().created_on, rref.rref_id().local_id},
                            timeout, intercept, /*waited_only=*/true);
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

namespace {

// The type of a value as RRef type names speak of it (rref.h's rref_type_name).
std::string value_type_name(const c10::IValue& value) {
  if (value.isTensor()) return ValueTraits<at::Tensor>::name();
  if (value.isBool()) return ValueTraits<bool>::name();
  if (value.isInt()) return ValueTraits<int64_t>::name();
  if (value.isDouble()) return ValueTraits<double>::name();
  if (value.isString()) return ValueTraits<std::string>::name();
  if (value.isList()) return "list";
  if (value.isGenericDict()) return "dict";
  if (value.isTuple()) return "tuple";
  if (value.isRRef()) return "RRef";
  if (value.isCapsule()) {
    if (auto* holder = dynamic_cast<const ObjectHolder*>(value.toCapsule().get())) {
      return holder->class_name();
    }
  }
  return value.tagKind();
}

// Whether a value of type `actual` can be read as one of type `declared` (from_value's rules).
bool type_fits(const std::string& declared, const std::string& actual) {
  return declared == actual || declared == "optional value" ||
         (declared == ValueTraits<double>::name() && actual == ValueTraits<int64_t>::name());
}

}  // namespace

c10::IValue RRefContext::prepare_to_send(const c10::IValue& value, int to, ForkBatch* batch) {
  return map_rrefs(value, [&](const c10::intrusive_ptr<c10::RRefInterface>& any) -> c10::IValue {
    RRefImpl* rref = rref_impl(any.get());
    auto* declared = dynamic_cast<DeclaredRRef*>(any.get());
    TORCH_CHECK_TYPE(rref != nullptr || dynamic_cast<RRefReference*>(any.get()) != nullptr,
                     "rpc: only distoptim RRefs can be sent");
    if (rref == nullptr) return c10::IValue(any);
    const GlobalId fork_id = new_id();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (rref->isOwner()) {
        // Early registration: the receiver's fork exists from now on, before it arrives.
        OwnerEntry& entry = owners_[rref->rref_id()];
        if (!entry.value) entry.value = rref->value();
        entry.forks[fork_id] = to;
        batch->owner_forks.emplace_back(rref->rref_id(), fork_id);
      } else {
        // Kept alive here until the receiver's fork is registered on the owner (accept()).
        pending_children_[fork_id] = PendingChild{any, to};
        batch->pending_children.push_back(fork_id);
      }
    }
    RRefIds ids;
    ids.owner_id = static_cast<int32_t>(rref->owner());
    ids.rref_created_on = rref->rref_id().created_on;
    ids.rref_local_id = rref->rref_id().local_id;
    ids.fork_created_on = fork_id.created_on;
    ids.fork_local_id = fork_id.local_id;
    ids.type_name = declared ? declared->type_name() : std::string();
    return c10::IValue(
        c10::intrusive_ptr<c10::RRefInterface>(c10::make_intrusive<RRefReference>(std::move(ids))));
  });
}

void RRefContext::rollback(const ForkBatch& batch) {
  std::vector<std::shared_ptr<OwnedValue>> freed;
  std::vector<c10::intrusive_ptr<c10::RRefInterface>> children;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [rref_id, fork_id] : batch.owner_forks) {
      freed.push_back(erase_fork_locked(rref_id, fork_id));
    }
    for (const GlobalId& fork_id : batch.pending_children) {
      auto it = pending_children_.find(fork_id);
      if (it != pending_children_.end()) {
        untie_locked(fork_id, it->second);
        children.push_back(std::move(it->second.rref));
        pending_children_.erase(it);
      }
    }
    children_done_.notify_all();
  }
  // `freed` and `children` are dropped here, outside the lock: a value may hold RRefs itself.
}

bool RRefContext::tie_to_reply(const ForkBatch& batch, int to, uint64_t call) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<GlobalId> tied;
  for (const GlobalId& fork_id : batch.pending_children) {
    auto it = pending_children_.find(fork_id);
    if (it == pending_children_.end()) continue;
    const RRefImpl* rref = rref_impl(it->second.rref.get());
    if (rref == nullptr || static_cast<int>(rref->owner()) != to) continue;
    it->second.call = call;
    tied.push_back(fork_id);
  }
  if (tied.empty()) return false;
  tied_.emplace(call, TiedCall{to, std::move(tied)});
  tied_count_.store(tied_.size(), std::memory_order_release);
  return true;
}

void RRefContext::untie_locked(const GlobalId& fork_id, const PendingChild& child) {
  if (child.call == 0) return;
  auto it = tied_.find(child.call);
  if (it == tied_.end()) return;
  auto& forks = it->second.forks;
  forks.erase(std::remove(forks.begin(), forks.end(), fork_id), forks.end());
  if (forks.empty()) tied_.erase(it);
  tied_count_.store(tied_.size(), std::memory_order_release);
}

void RRefContext::on_reply(int peer, uint64_t call) {
  if (tied_count_.load(std::memory_order_acquire) == 0) return;
  std::vector<c10::intrusive_ptr<c10::RRefInterface>> children;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto tied = tied_.find(call);
    // Only the worker the call went to answers for it (call ids are this worker's own): a reply
    // from another leaves the tie for the real one.
    if (tied == tied_.end() || tied->second.to != peer) return;
    std::vector<GlobalId> forks = std::move(tied->second.forks);
    tied_.erase(tied);
    tied_count_.store(tied_.size(), std::memory_order_release);
    for (const GlobalId& fork_id : forks) {
      auto it = pending_children_.find(fork_id);
      if (it == pending_children_.end()) continue;
      children.push_back(std::move(it->second.rref));
      pending_children_.erase(it);
    }
    children_done_.notify_all();
  }
  // `children` are dropped here, outside the lock (the last handle of one tells its owner).
}

c10::IValue RRefContext::receive(const c10::IValue& value, bool accepted_by_reply) {
  // A type mismatch is reported once every reference in `value` has been taken (else the forks
  // of those not yet taken would never be released).
  std::string mismatch;
  std::string gone;
  c10::IValue received =
      map_rrefs(value, [&](const c10::intrusive_ptr<c10::RRefInterface>& any) -> c10::IValue {
        auto* reference = dynamic_cast<RRefReference*>(any.get());
        if (reference == nullptr) return c10::IValue(any);  // Already a handle (a local call).
        const RRefIds& ids = reference->ids();
        const int owner = checked_worker(ids.owner_id, "the owner of a received RRef,");
        checked_worker(ids.rref_created_on, "the creator of a received RRef,");
        const int parent = checked_worker(ids.fork_created_on, "the sender of a received RRef,");
        const GlobalId rref_id{ids.rref_created_on, ids.rref_local_id};
        const GlobalId fork_id{ids.fork_created_on, ids.fork_local_id};
        const std::string& owner_name = name(owner);
        if (owner == self_) {
          std::shared_ptr<OwnedValue> owned;
          std::shared_ptr<OwnedValue> freed;
          {
            std::lock_guard<std::mutex> lock(mutex_);
            // A value a lost worker sent back after its forks were dropped here (a request of it
            // that ran late): made again, it would have no fork to free it ever.
            if (parent != self_ && lost_[parent] && owners_.count(rref_id) == 0) {
              if (gone.empty()) {
                gone = c10::str("rpc: worker '", name(parent), "', which sent RRef ",
                                rref_id.created_on, ":", rref_id.local_id,
                                " back to its owner, was lost, and the value released");
              }
              return c10::IValue();
            }
            owned = get_or_create_locked(rref_id);
            // Sent to ourselves: the fork registered while sending has done its job.
            if (parent == self_) freed = erase_fork_locked(rref_id, fork_id);
          }
          // From a user: the owner holds no fork for this handle (PyTorch's "phantom fork"); only
          // the sender's pending child needs releasing, by this worker's reply when the request
          // said so.
          if (parent != self_ && !accepted_by_reply)
            send_control(parent, kAccept, {fork_id.created_on, fork_id.local_id});
          auto local = c10::make_intrusive<RRefImpl>(handle_, owner, owner_name, rref_id, owned);
          // The sender's RRef<T> against the value (one still being created is not checked).
          const auto& future = owned->future;
          if (!ids.type_name.empty() && mismatch.empty() && future->completed() &&
              !future->hasError() && !type_fits(ids.type_name, value_type_name(future->value()))) {
            mismatch = c10::str("rpc: worker '", name(parent), "' sent ", local->describe(),
                                " as RRef<", ids.type_name, ">, but its value on worker '",
                                owner_name, "' is ", value_type_name(future->value()));
          }
          return c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(std::move(local)));
        }
        auto user = c10::make_intrusive<RRefImpl>(handle_, owner, owner_name, rref_id, fork_id,
                                                  c10::intrusive_ptr<c10::ivalue::Future>());
        {
          std::lock_guard<std::mutex> lock(mutex_);
          users_.emplace(fork_id, c10::weak_intrusive_ptr<RRefImpl>(user));
        }
        if (parent != owner) {
          // A fork of a user: register it on the owner, then release the sender's pending child.
          try {
            auto registered = channel_.send_control(
                owner, kFork,
                {rref_id.created_on, rref_id.local_id, fork_id.created_on, fork_id.local_id},
                kDefaultTimeout);
            registered->addCallback([this, parent, fork_id](c10::ivalue::Future&) {
              send_control(parent, kAccept, {fork_id.created_on, fork_id.local_id});
            });
          } catch (const c10::Error&) {
            // Shutting down.
          }
        }
        return c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(std::move(user)));
      });
  TORCH_CHECK_VALUE(gone.empty(), gone);
  TORCH_CHECK_TYPE(mismatch.empty(), mismatch);
  return received;
}

c10::intrusive_ptr<c10::ivalue::Future> RRefContext::handle_control(const std::string& callable,
                                                                    std::vector<c10::IValue> args,
                                                                    int caller, uint64_t id,
                                                                    const CallMetadata& metadata) {
  auto done = [] {
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
    future->markCompleted(c10::IValue());
    return future;
  };
  auto id_at = [&](size_t index) {
    return GlobalId{checked_worker(int_arg(args, index, callable), "a creator id"), [&] {
                      const int64_t local = int_arg(args, index + 1, callable);
                      TORCH_CHECK_VALUE(local >= 0, "rref control message '", callable,
                                        "': negative local id ", local);
                      return local;
                    }()};
  };
  if (callable == kCreate) {
    TORCH_CHECK_VALUE(args.size() == 6 && args[4].isString() && args[5].isList(),
                      "rref control message 'create': malformed arguments");
    const GlobalId rref_id = id_at(0);
    const GlobalId fork_id = id_at(2);
    std::vector<c10::IValue> call_args;
    for (const c10::IValue& arg : args[5].toListRef()) call_args.push_back(receive(arg));
    std::shared_ptr<OwnedValue> owned;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      owned = get_or_create_locked(rref_id);
      owners_[rref_id].forks[fork_id] = caller;
    }
    auto reply = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
    const MessageInfo info{MessageInfo::Kind::kRequest, caller, args[4].toStringRef(), id};
    auto result = channel_.run_locally(info.callable, std::move(call_args),
                                       [info, metadata](std::vector<c10::IValue>& values) {
                                         return intercept_receive(info, values, metadata);
                                       });
    result->addCallback([owned, reply](c10::ivalue::Future& created) {
      // A failed creation is the value's error, and the reply's: the creator learns it at
      // confirm() or to_here().
      if (created.hasError()) {
        owned->future->setErrorIfNeeded(created.exception_ptr());
        reply->setError(created.exception_ptr());
        return;
      }
      if (!owned->future->completed()) {
        owned->future->markCompleted(created.value());
      }
      reply->markCompleted(c10::IValue());
    });
    return reply;
  }
  if (callable == kFetch) {
    TORCH_CHECK_VALUE(args.size() == 2, "rref control message 'fetch': malformed arguments");
    std::vector<c10::IValue> no_values;
    (void)intercept_receive({MessageInfo::Kind::kRequest, caller, kFetch, id}, no_values, metadata);
    const GlobalId rref_id = id_at(0);
    c10::intrusive_ptr<c10::ivalue::Future> owned;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = owners_.find(rref_id);
      TORCH_CHECK_VALUE(it != owners_.end(), "worker '", name(self_), "' owns no RRef ",
                        rref_id.str(), " (deleted, or never created)");
      owned = it->second.value->future;
    }
    // The owner keeps the value and may update it in place (a parameter server stepping its
    // weights): the reply carries a copy taken when the value is read, never a torn one.
    auto fetched = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
    owned->addCallback([fetched](c10::ivalue::Future& done) {
      if (done.hasError()) {
        fetched->setError(done.exception_ptr());
      } else {
        fetched->markCompleted(snapshot_shared_tensors(done.value(), /*holders=*/0));
      }
    });
    return fetched;
  }
  if (callable == kFork) {
    TORCH_CHECK_VALUE(args.size() == 4, "rref control message 'fork': malformed arguments");
    const GlobalId rref_id = id_at(0);
    const GlobalId fork_id = id_at(2);
    std::lock_guard<std::mutex> lock(mutex_);
    get_or_create_locked(rref_id);
    owners_[rref_id].forks[fork_id] = caller;
    return done();
  }
  if (callable == kDelete) {
    TORCH_CHECK_VALUE(args.size() == 4, "rref control message 'delete': malformed arguments");
    const GlobalId rref_id = id_at(0);
    const GlobalId fork_id = id_at(2);
    std::shared_ptr<OwnedValue> freed;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      freed = erase_fork_locked(rref_id, fork_id);
    }
    return done();  // `freed` goes outside the lock.
  }
  if (callable == kAccept) {
    TORCH_CHECK_VALUE(args.size() == 2, "rref control message 'accept': malformed arguments");
    const GlobalId fork_id = id_at(0);
    c10::intrusive_ptr<c10::RRefInterface> child;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = pending_children_.find(fork_id);
      if (it != pending_children_.end()) {
        untie_locked(fork_id, it->second);
        child = std::move(it->second.rref);
        pending_children_.erase(it);
        children_done_.notify_all();
      }
    }
    return done();
  }
  TORCH_CHECK_VALUE(false, "unknown rref control message '", callable, "'");
}

void RRefContext::on_user_deleted(const RRefImpl& rref) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    users_.erase(rref.fork_id());
    if (closed_) return;
  }
  send_control(static_cast<int>(rref.owner()), kDelete,
               {rref.rref_id().created_on, rref.rref_id().local_id, rref.fork_id().created_on,
                rref.fork_id().local_id});
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
