#include "dispatcher.h"

#include <optional>

#include <ATen/ATen.h>

#include "future_errors.h"
#include "interception.h"
#include "registry_internal.h"
#include "reply_snapshot.h"
#include "transport/io_loop.h"

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

// The dispatcher whose request runs on this thread, in its pools or on an I/O thread after a
// hand-over, so that on_own_thread() knows it there too.
thread_local const Dispatcher* t_running_requests = nullptr;

size_t frame_bytes(const Frame& frame) {
  size_t bytes = frame.body->size();
  for (const at::Tensor& buffer : frame.buffers) bytes += buffer.nbytes();
  return bytes;
}

}  // namespace

Dispatcher::Dispatcher(const RpcBackendOptions& options, WireLimits limits, PendingCalls& calls)
    : inbound_limit_(options.inbound_queue_bytes()),
      limits_(limits),
      calls_(calls),
      request_pool_(std::make_unique<Executor>(options.num_worker_threads(),
                                               options.max_extra_worker_threads())),
      ordered_(std::make_unique<Executor>(1)),
      completion_(std::make_unique<Executor>(1)) {}

Dispatcher::~Dispatcher() { stop(); }

void Dispatcher::start(int self, const WorkerTable& workers, RRefContext* rrefs,
                       std::weak_ptr<void> owner, MembershipHandler membership) {
  self_ = self;
  workers_ = &workers;
  rrefs_ = rrefs;
  owner_ = std::move(owner);
  membership_ = std::move(membership);
  lost_callers_capacity_ = workers.id_capacity();
  lost_callers_ = std::make_unique<std::atomic<bool>[]>(lost_callers_capacity_);
}

void Dispatcher::caller_back(int caller) {
  if (caller >= 0 && static_cast<size_t>(caller) < lost_callers_capacity_) {
    lost_callers_[caller].store(false, std::memory_order_release);
  }
}

void Dispatcher::caller_lost(int caller) {
  if (caller >= 0 && static_cast<size_t>(caller) < lost_callers_capacity_) {
    lost_callers_[caller].store(true, std::memory_order_release);
  }
}

bool Dispatcher::on_own_thread() const {
  if (t_running_requests == this) return true;
  const Executor* pool = Executor::current();
  return pool != nullptr &&
         (pool == request_pool_.get() || pool == ordered_.get() || pool == completion_.get());
}

bool Dispatcher::on_request_frame(const std::shared_ptr<Connection>& connection, int caller,
                                  Frame frame) {
  const size_t bytes = frame_bytes(frame);
  bool go_on = true;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (refusing_) {
      return false;
    }
    ++in_flight_;
    inbound_bytes_ += bytes;
    if (inbound_bytes_ > inbound_limit_) {
      paused_.push_back(connection);
      go_on = false;
    }
  }
  const bool ordered = (frame.header.flags & MessageHeader::kOrdered) != 0;
  std::function<void()> job = [this, connection, caller, bytes,
                               frame = std::move(frame)]() mutable {
    const Dispatcher* outer = t_running_requests;
    t_running_requests = this;
    try {
      handle_request(connection, caller, frame.header, *frame.body, std::move(frame.buffers));
    } catch (...) {
    }
    t_running_requests = outer;
    request_done(bytes);
  };
  // A request runs on the I/O thread that read it, which keeps the loop meanwhile (io_loop.h):
  // no thread waits to be woken before it starts or while it runs; one that waits in the library
  // leads the loop as it waits (wait_future), one that blocks elsewhere loses it to the other
  // thread after IoLoop::kLongJob. When the other is busy with a request of its own, or requests
  // wait in the pool (this one would start before them), it goes to the pool: requests start in
  // the order they arrived. RRef control messages keep their order on the ordered thread; they
  // never block.
  if (!ordered && IoLoop::can_run_after_handler() && request_pool_->nothing_queued()) {
    IoLoop::run_after_handler(std::move(job));
    return go_on;
  }
  (ordered ? *ordered_ : *request_pool_).post(std::move(job));
  return go_on;
}

void Dispatcher::request_done(size_t bytes) {
  std::vector<std::shared_ptr<Connection>> resume;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    --in_flight_;
    inbound_bytes_ -= bytes;
    if (!paused_.empty() && inbound_bytes_ <= inbound_limit_ / 2) {
      resume.swap(paused_);
    }
    idle_.notify_all();
  }
  for (const auto& connection : resume) {
    connection->resume_reading();
  }
}

// RRefs in a message that is refused or comes too late are taken and dropped at once, so that
// their owners hear nobody holds them (else the owners keep the values until shutdown).
void Dispatcher::discard_rrefs(const std::vector<c10::IValue>& values, bool accepted_by_reply) {
  for (const c10::IValue& value : values) {
    try {
      (void)rrefs_->receive(value, accepted_by_reply);
    } catch (...) {
    }
  }
}

std::optional<c10::IValue> Dispatcher::invoke(
    const RawFunction& function, std::vector<c10::IValue> args,
    std::function<void(c10::ivalue::Future& result, bool owner_alive)> done) {
  std::optional<c10::IValue> value = function(std::move(args));
  if (!value->isFuture()) {
    return value;
  }
  // async_execution: done when the returned future is, on whichever thread completes it, and in
  // flight until then. The future may outlive the agent: the callback holds it weakly.
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++in_flight_;
  }
  value->toFuture()->addCallback(
      [this, owner = owner_, done = std::move(done)](c10::ivalue::Future& result) {
        const std::shared_ptr<void> alive = owner.lock();
        done(result, alive != nullptr);
        if (alive) {
          std::lock_guard<std::mutex> lock(mutex_);
          --in_flight_;
          idle_.notify_all();
        }
      });
  return {};
}

void Dispatcher::handle_request(const std::shared_ptr<Connection>& connection, int connection_peer,
                                const MessageHeader& header, const std::string& body,
                                std::vector<at::Tensor> buffers) {
  const bool ordered = (header.flags & MessageHeader::kOrdered) != 0;
  const bool accepted_by_reply = (header.flags & MessageHeader::kAcceptedByReply) != 0;
  // The caller is lost (it died or stopped): its request is not run, and its memory goes now.
  // Its RRefs are lost with it and its contexts released here; a request of it run now would act
  // for nobody (its forks and contexts made again, never to be freed). Undecoded, it leaves
  // nothing behind: RRefs in it were never received here, and their owners drop the lost
  // caller's forks themselves. Control messages still run, in order: they settle the RRefs of
  // forks registered before.
  if (!ordered &&
      (connection->closed() || lost_callers_[connection_peer].load(std::memory_order_acquire))) {
    dropped_requests_.fetch_add(1, std::memory_order_relaxed);
    // Lost only here (its connection to us still open): it hears why, if it is still there.
    connection->send(encode_error(header.id,
                                  "rpc: worker '" + name(self_) + "' counts worker '" +
                                      name(connection_peer) + "' as lost; its request was not run",
                                  name(self_)));
    return;
  }
  std::optional<std::string> failure;
  try {
    DecodedMessage request;
    if (Status error = decode_body(header, body, std::move(buffers), limits_, &request)) {
      failure = "malformed request: " + *error;
    } else if (request.caller_id != connection_peer) {
      failure = "malformed request: caller id " + std::to_string(request.caller_id) +
                " on the connection of worker id " + std::to_string(connection_peer);
    } else if (ordered != RRefContext::is_control(request.callable)) {
      failure = "'" + request.callable + "' cannot be called " +
                (ordered ? "as an ordered control message" : "by name");
      discard_rrefs(request.args, accepted_by_reply);
    } else if (ordered) {
      const int caller = request.caller_id;
      auto result = rrefs_->handle_control(request.callable, std::move(request.args), caller,
                                           header.id, request.metadata);
      // The reply may wait (a fetch of a value still being created); it is written by whoever
      // completes `result`.
      result->addCallback([this, connection, id = header.id, caller,
                           callable = request.callable](c10::ivalue::Future& done) {
        reply(connection, id, caller, callable, done);
      });
      return;
    } else if (request.callable == kMemberJoined || request.callable == kMemberLeft ||
               request.callable == kMemberDropped) {
      // A worker announces itself (the caller's proven id is the worker the notice is about), or
      // the store host says it dropped a member.
      auto sent = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
      try {
        sent->markCompleted(membership_(request.caller_id, request.callable, request.args));
      } catch (...) {
        sent->setError(std::current_exception());
      }
      reply(connection, header.id, request.caller_id, request.callable, *sent);
      return;
    } else if (auto function = find_function(request.callable)) {
      const int caller = request.caller_id;
      for (c10::IValue& arg : request.args) {
        arg = rrefs_->receive(arg, accepted_by_reply);
      }
      // Lives while the function runs (a context the interceptor set for it).
      const std::shared_ptr<void> context =
          intercept_receive({MessageInfo::Kind::kRequest, caller, request.callable, header.id},
                            request.args, request.metadata);
      auto result = invoke(*function, std::move(request.args),
                           [this, connection, id = header.id, caller, callable = request.callable](
                               c10::ivalue::Future& done, bool owner_alive) {
                             if (owner_alive) reply(connection, id, caller, callable, done);
                           });
      if (result) {
        // Copies of what someone else may still write; `result` is the only other holder.
        auto sent = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
        sent->markCompleted(snapshot_shared_tensors(*result, /*holders=*/1));
        result.reset();
        reply(connection, header.id, caller, request.callable, *sent);
      }
      return;
    } else {
      failure = "no function or class is registered as '" + request.callable + "'";
      discard_rrefs(request.args, accepted_by_reply);
    }
  } catch (...) {
    failure = error_text(std::current_exception());
  }
  // A failed write means the caller is gone; its side reports that.
  connection->send(encode_error(header.id, *failure, name(self_)));
}

void Dispatcher::reply(const std::shared_ptr<Connection>& connection, uint64_t id, int caller,
                       const std::string& callable, const c10::ivalue::Future& result) {
  EncodedMessage message;
  if (result.hasError()) {
    message = encode_error(id, error_text(result.exception_ptr()), name(self_));
  } else {
    ForkBatch forks;
    try {
      std::vector<c10::IValue> values{result.constValue()};
      const CallMetadata metadata =
          RRefContext::carries_user_values(callable)
              ? intercept_send({MessageInfo::Kind::kResponse, caller, callable, id}, values)
              : CallMetadata();
      message = encode_response(id, rrefs_->prepare_to_send(values[0], caller, &forks), metadata);
    } catch (...) {
      rrefs_->rollback(forks);
      message = encode_error(id, error_text(std::current_exception()), name(self_));
    }
  }
  connection->send(std::move(message));
}

c10::intrusive_ptr<c10::ivalue::Future> Dispatcher::run_locally(const std::string& callable,
                                                                std::vector<c10::IValue> args,
                                                                Preparation prepare) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    DISTOPTIM_CHECK_WITH(DistributedError, !refusing_,
                         "rpc: the agent is shutting down; cannot run '", callable, "'");
    ++in_flight_;
  }
  request_pool_->post(
      [this, future, callable, args = std::move(args), prepare = std::move(prepare)]() mutable {
        auto remote_error = [me = name(self_)](const std::exception_ptr& error) {
          return std::make_exception_ptr(RemoteError(
              {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, me, error_text(error)));
        };
        try {
          auto function = find_function(callable);
          TORCH_CHECK_VALUE(function != nullptr, "no function or class is registered as '",
                            callable, "'");
          const std::shared_ptr<void> context = prepare ? prepare(args) : nullptr;
          auto complete = [future, remote_error](c10::ivalue::Future& done, bool) {
            if (done.hasError()) {
              future->setErrorIfNeeded(remote_error(done.exception_ptr()));
            } else {
              future->markCompleted(done.value());
            }
          };
          if (auto result = invoke(*function, std::move(args), complete)) {
            future->markCompleted(std::move(*result));
          }
        } catch (...) {
          future->setErrorIfNeeded(remote_error(std::current_exception()));
        }
        request_done(0);
      });
  return future;
}

void Dispatcher::on_reply_frame(int peer, Frame frame) {
  // A reply to a caller that only waits completes its future here, when that cannot overtake a
  // reply still queued for the completion thread: one thread hand-off (tens of microseconds on a
  // virtual machine) fewer per blocking call. Every other reply goes to the completion thread,
  // where the future's callbacks may run.
  std::optional<std::shared_ptr<const CallingThread>> waiter =
      calls_.waited_only(frame.header.id, peer);
  if (waiter && completion_->quiescent()) {
    handle_reply(peer, frame.header, *frame.body, std::move(frame.buffers));
    leave_loop_for_replies_of(*waiter);
    return;
  }
  completion_->post([this, peer, frame = std::move(frame)]() mutable {
    handle_reply(peer, frame.header, *frame.body, std::move(frame.buffers));
  });
}

void Dispatcher::leave_loop_for_replies_of(const std::shared_ptr<const CallingThread>& caller) {
  if (calls_.only_calls_led_by(caller.get()) && requests_in_flight() == 0) {
    IoLoop::leave_to_next_wait(caller);
  }
}

void Dispatcher::handle_reply(int peer, const MessageHeader& header, const std::string& body,
                              std::vector<at::Tensor> buffers) {
  // Replies from a worker the call did not go to are treated as late ones.
  std::optional<PendingCall> call = calls_.take(header.id, peer);
  // Any answer, even late or malformed, shows the callee took the RRefs the call sent it.
  rrefs_->on_reply(peer, header.id);
  // Named only when something failed: a name costs a look-up in the worker table.
  const auto worker = [&] { return name(peer); };
  DecodedMessage reply;
  if (Status error = decode_body(header, body, std::move(buffers), limits_, &reply)) {
    if (call) {
      call->future->setError(DISTOPTIM_RPC_ERROR(
          DistributedError, "rpc: worker '" + worker() + "' sent a malformed reply to '" +
                                call->function + "': " + *error));
    }
    return;
  }
  if (!call) {
    // A late reply (its call timed out): RRefs in it are taken and dropped at once, so their
    // owners hear that nobody holds them.
    if (header.type == MessageType::kResponse) {
      discard_rrefs({reply.result});
    }
    return;
  }
  if (header.type == MessageType::kError) {
    call->future->setError(std::make_exception_ptr(RemoteError(
        {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, worker(), reply.error_message)));
    return;
  }
  try {
    std::vector<c10::IValue> values{rrefs_->receive(reply.result)};
    if (RRefContext::carries_user_values(call->function)) {
      (void)intercept_receive({MessageInfo::Kind::kResponse, peer, call->function, header.id},
                              values, reply.metadata);
    }
    call->future->markCompleted(std::move(values[0]));
  } catch (...) {
    call->future->setError(DISTOPTIM_RPC_ERROR(
        DistributedError, "rpc: worker '" + worker() + "' sent an unusable reply to '" +
                              call->function + "': " + error_text(std::current_exception())));
  }
}

void Dispatcher::fail_calls(std::vector<PendingCall> calls,
                            std::function<std::exception_ptr(const PendingCall&)> make_error) {
  if (calls.empty()) {
    return;
  }
  completion_->post([calls = std::move(calls), make_error = std::move(make_error)] {
    for (const PendingCall& call : calls) {
      call.future->setErrorIfNeeded(make_error(call));
    }
  });
}

void Dispatcher::fail_calls_to(int peer,
                               std::function<std::exception_ptr(const PendingCall&)> make_error) {
  completion_->post([this, peer, make_error = std::move(make_error)] {
    for (const PendingCall& call : calls_.take_to(peer)) {
      call.future->setErrorIfNeeded(make_error(call));
    }
  });
}

void Dispatcher::post_ordered(std::function<void()> job) { ordered_->post(std::move(job)); }

int64_t Dispatcher::requests_in_flight() {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_flight_;
}

int Dispatcher::wait_idle(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait_until(lock, deadline, [this] { return in_flight_ == 0; });
  return in_flight_;
}

void Dispatcher::refuse_requests() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    refusing_ = true;
    paused_.clear();
  }
  idle_.notify_all();
}

void Dispatcher::stop() {
  refuse_requests();
  request_pool_->stop();
  ordered_->stop();
  completion_->stop();
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
