// RRefs inside the values of messages, as they leave and arrive: prepare_to_send turns each
// handle into its wire reference and registers its fork (on the owner) or pending child (on a
// user), rollback undoes that for a message never sent, tie_to_reply and on_reply let a reply
// release the children it settles, and receive turns each wire reference back into a handle,
// sending the fork() and accept() the protocol asks of a receiver (rref_context.h).

#include "rref_context.h"

#include <algorithm>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/jit_type.h>
#include <c10/util/Exception.h>

#include <distoptim/rpc/classes.h>
#include <distoptim/rpc/values.h>

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

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
            send_control(parent, encode_control(AcceptMessage{ControlId::of(fork_id)}));
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
            ControlRequest fork =
                encode_control(ForkMessage{ControlId::of(rref_id), ControlId::of(fork_id)});
            auto registered =
                channel_.send_control(owner, fork.callable, std::move(fork.args), kDefaultTimeout);
            registered->addCallback([this, parent, fork_id](c10::ivalue::Future&) {
              send_control(parent, encode_control(AcceptMessage{ControlId::of(fork_id)}));
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

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
