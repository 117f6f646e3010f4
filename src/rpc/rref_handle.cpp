#include "rref_handle.h"

#include <ATen/core/jit_type.h>

#include <distoptim/comm/errors.h>

namespace distoptim {
namespace rpc {
namespace detail {

RRefImpl::RRefImpl(std::weak_ptr<RRefContext> context, int owner, std::string owner_name,
                   GlobalId rref_id, std::shared_ptr<OwnedValue> value)
    : context_(std::move(context)),
      owner_(owner),
      owner_name_(std::move(owner_name)),
      rref_id_(rref_id),
      value_(std::move(value)) {}

RRefImpl::RRefImpl(std::weak_ptr<RRefContext> context, int owner, std::string owner_name,
                   GlobalId rref_id, GlobalId fork_id,
                   c10::intrusive_ptr<c10::ivalue::Future> creation)
    : context_(std::move(context)),
      owner_(owner),
      owner_name_(std::move(owner_name)),
      rref_id_(rref_id),
      fork_id_(fork_id),
      creation_(std::move(creation)) {}

void RRefImpl::release_resources() { on_last_handle_dropped(); }

RRefImpl::~RRefImpl() { on_last_handle_dropped(); }

const c10::TypePtr RRefImpl::type() const { return c10::RRefType::create(c10::AnyType::get()); }

std::shared_ptr<RRefContext> RRefImpl::context() const {
  std::shared_ptr<RRefContext> context = context_.lock();
  DISTOPTIM_CHECK_WITH(DistributedError, context != nullptr, "rpc: ", describe(),
                       " belongs to an agent that has stopped");
  return context;
}

std::string RRefImpl::describe() const {
  return "RRef " + rref_id_.str() + " owned by worker '" + owner_name_ + "'";
}

RRefImpl* rref_impl(c10::RRefInterface* rref) {
  if (auto* declared = dynamic_cast<DeclaredRRef*>(rref)) return declared->impl().get();
  return dynamic_cast<RRefImpl*>(rref);
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
