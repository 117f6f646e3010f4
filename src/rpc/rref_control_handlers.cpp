// The receiving side of the RRef protocol's control messages (rref_context.h): a dispatch table
// from a control message's name to what decodes its arguments (rref_control.h) and handles it,
// and the five handlers, which run on the agent's ordered thread.

#include "rref_context.h"

#include <string>
#include <unordered_map>
#include <vector>

#include <c10/util/Exception.h>

#include "interception.h"
#include "reply_snapshot.h"

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

using ControlFuture = c10::intrusive_ptr<c10::ivalue::Future>;
using ControlHandler = ControlFuture (*)(RRefContext& context, const std::vector<c10::IValue>& args,
                                         const ControlCall& call);

// An entry of the dispatch table: the arguments decoded as a `Message` (c10::ValueError naming
// the argument at fault when they are malformed, before anything changes), then handled.
template <class Message, ControlFuture (RRefContext::*Handle)(Message, const ControlCall&)>
ControlFuture decode_and_handle(RRefContext& context, const std::vector<c10::IValue>& args,
                                const ControlCall& call) {
  Message message;
  const Status malformed = decode_control(args, &message);
  TORCH_CHECK_VALUE(!malformed, *malformed);
  return (context.*Handle)(std::move(message), call);
}

ControlFuture completed_control() {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  future->markCompleted(c10::IValue());
  return future;
}

}  // namespace

c10::intrusive_ptr<c10::ivalue::Future> RRefContext::handle_control(const std::string& callable,
                                                                    std::vector<c10::IValue> args,
                                                                    int caller, uint64_t id,
                                                                    const CallMetadata& metadata) {
  static const std::unordered_map<std::string, ControlHandler> kHandlers = {
      {control_name(ControlKind::kCreate),
       &decode_and_handle<CreateMessage, &RRefContext::handle_create>},
      {control_name(ControlKind::kFetch),
       &decode_and_handle<FetchMessage, &RRefContext::handle_fetch>},
      {control_name(ControlKind::kFork),
       &decode_and_handle<ForkMessage, &RRefContext::handle_fork>},
      {control_name(ControlKind::kDelete),
       &decode_and_handle<DeleteMessage, &RRefContext::handle_delete>},
      {control_name(ControlKind::kAccept),
       &decode_and_handle<AcceptMessage, &RRefContext::handle_accept>},
  };
  const auto handler = kHandlers.find(callable);
  TORCH_CHECK_VALUE(handler != kHandlers.end(), "unknown rref control message '", callable, "'");
  return handler->second(*this, args, ControlCall{caller, id, metadata});
}

c10::intrusive_ptr<c10::ivalue::Future> RRefContext::handle_create(CreateMessage create,
                                                                   const ControlCall& call) {
  const GlobalId rref_id = checked_id(create.rref_id);
  const GlobalId fork_id = checked_id(create.fork_id);
  std::vector<c10::IValue> call_args;
  for (const c10::IValue& arg : create.args) call_args.push_back(receive(arg));
  std::shared_ptr<OwnedValue> owned;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    owned = get_or_create_locked(rref_id);
    owners_[rref_id].forks[fork_id] = call.caller;
  }
  auto reply = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  const MessageInfo info{MessageInfo::Kind::kRequest, call.caller, std::move(create.callable),
                         call.id};
  auto result =
      channel_.run_locally(info.callable, std::move(call_args),
                           [info, metadata = call.metadata](std::vector<c10::IValue>& values) {
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

c10::intrusive_ptr<c10::ivalue::Future> RRefContext::handle_fetch(FetchMessage fetch,
                                                                  const ControlCall& call) {
  std::vector<c10::IValue> no_values;
  (void)intercept_receive(
      {MessageInfo::Kind::kRequest, call.caller, control_name(ControlKind::kFetch), call.id},
      no_values, call.metadata);
  const GlobalId rref_id = checked_id(fetch.rref_id);
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

c10::intrusive_ptr<c10::ivalue::Future> RRefContext::handle_fork(ForkMessage fork,
                                                                 const ControlCall& call) {
  const GlobalId rref_id = checked_id(fork.rref_id);
  const GlobalId fork_id = checked_id(fork.fork_id);
  std::lock_guard<std::mutex> lock(mutex_);
  get_or_create_locked(rref_id);
  owners_[rref_id].forks[fork_id] = call.caller;
  return completed_control();
}

c10::intrusive_ptr<c10::ivalue::Future> RRefContext::handle_delete(DeleteMessage deleted,
                                                                   const ControlCall&) {
  const GlobalId rref_id = checked_id(deleted.rref_id);
  const GlobalId fork_id = checked_id(deleted.fork_id);
  std::shared_ptr<OwnedValue> freed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    freed = erase_fork_locked(rref_id, fork_id);
  }
  return completed_control();  // `freed` goes outside the lock.
}

c10::intrusive_ptr<c10::ivalue::Future> RRefContext::handle_accept(AcceptMessage accept,
                                                                   const ControlCall&) {
  const GlobalId fork_id = checked_id(accept.fork_id);
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
  return completed_control();
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
