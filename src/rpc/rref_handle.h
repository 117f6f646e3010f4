#pragma once

// One worker's handle on an RRef (rref.h's RRef<T> holds one): its ids, and on the owner the
// value. The protocol that counts handles across workers is the RRef context's
// (rref_context.h).

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>

namespace distoptim {
namespace rpc {
namespace detail {

class RRefContext;

/// (worker that made it, counter on that worker): unique across the job.
struct GlobalId {
  int32_t created_on = -1;
  int64_t local_id = -1;
  bool operator<(const GlobalId& other) const {
    return created_on != other.created_on ? created_on < other.created_on
                                          : local_id < other.local_id;
  }
  bool operator==(const GlobalId& other) const {
    return created_on == other.created_on && local_id == other.local_id;
  }
  std::string str() const { return std::to_string(created_on) + ":" + std::to_string(local_id); }
};

/// The value an owner holds: a future that completes with it, or with the error creating it
/// raised (a RemoteError naming the owner).
struct OwnedValue {
  c10::intrusive_ptr<c10::ivalue::Future> future =
      c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
};

/// One handle on an RRef in this process (shared by every copy of an RRef<T>). An owner handle
/// holds the value; a user handle holds its ForkId and tells the owner when it dies. Immutable
/// after construction except `released_`; thread-safe.
class RRefImpl : public c10::RRefInterface {
 public:
  /// An owner handle.
  RRefImpl(std::weak_ptr<RRefContext> context, int owner, std::string owner_name, GlobalId rref_id,
           std::shared_ptr<OwnedValue> value);
  /// A user handle. `creation` (may be null) is the create() call for RRefs made by remote().
  RRefImpl(std::weak_ptr<RRefContext> context, int owner, std::string owner_name, GlobalId rref_id,
           GlobalId fork_id, c10::intrusive_ptr<c10::ivalue::Future> creation);
  ~RRefImpl() override;
  void release_resources() override;

  c10::worker_id_t owner() const override { return static_cast<c10::worker_id_t>(owner_); }
  std::string ownerName() const override { return owner_name_; }
  bool isOwner() const override { return value_ != nullptr; }
  /// An owner handle: always. A user made by remote(): once the owner has created the value.
  /// A user that received the RRef from another worker: always (its sender keeps the value alive
  /// until the owner has registered the receiver).
  bool confirmedByOwner() const override {
    return !creation_ || (creation_->completed() && !creation_->hasError());
  }
  const c10::TypePtr type() const override;

  const GlobalId& rref_id() const { return rref_id_; }
  const GlobalId& fork_id() const { return fork_id_; }
  const std::shared_ptr<OwnedValue>& value() const { return value_; }
  const c10::intrusive_ptr<c10::ivalue::Future>& creation() const { return creation_; }
  /// Marks a user handle as already deleted on the owner (graceful shutdown deleted it); returns
  /// whether it was not yet.
  bool release() { return !released_.exchange(true); }
  std::string describe() const;
  /// The RRef protocol of the agent this handle belongs to; DistributedError once it stopped.
  std::shared_ptr<RRefContext> context() const;

 private:
  void on_last_handle_dropped() noexcept;

  const std::weak_ptr<RRefContext> context_;
  const int owner_;
  const std::string owner_name_;
  const GlobalId rref_id_;
  const GlobalId fork_id_;
  const std::shared_ptr<OwnedValue> value_;
  const c10::intrusive_ptr<c10::ivalue::Future> creation_;
  std::atomic<bool> released_{false};
};

/// An RRef handle as it is sent as an RRef<T>: the handle and the name of T (rref.h's
/// declare_rref_type). Used only between to_value and prepare_to_send; forwards the rest.
class DeclaredRRef : public c10::RRefInterface {
 public:
  DeclaredRRef(c10::intrusive_ptr<RRefImpl> impl, std::string type_name)
      : impl_(std::move(impl)), type_name_(std::move(type_name)) {}
  const c10::intrusive_ptr<RRefImpl>& impl() const { return impl_; }
  const std::string& type_name() const { return type_name_; }
  c10::worker_id_t owner() const override { return impl_->owner(); }
  std::string ownerName() const override { return impl_->ownerName(); }
  bool isOwner() const override { return impl_->isOwner(); }
  bool confirmedByOwner() const override { return impl_->confirmedByOwner(); }
  const c10::TypePtr type() const override { return impl_->type(); }

 private:
  c10::intrusive_ptr<RRefImpl> impl_;
  std::string type_name_;
};

/// The handle behind an RRef interface (unwrapping a DeclaredRRef), or null.
RRefImpl* rref_impl(c10::RRefInterface* rref);

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
