#include "agent.h"

#include <algorithm>
#include <atomic>
#include <thread>

#include <asio/post.hpp>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <distoptim/comm/errors.h>
#include <distoptim/comm/store_wait.h>

#include "registry_internal.h"

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

constexpr const char* kStorePrefix = "distoptim/rpc/";
// How long rank 0 keeps the store up, after a shutdown barrier failed, for the workers that
// arrived to read why.
constexpr auto kBarrierFailureGrace = std::chrono::seconds(2);

// The exception for a future, located where it is made.
#define DISTOPTIM_RPC_ERROR(type, message) \
  std::make_exception_ptr(type({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message))

std::string describe_missing(const std::vector<int>& missing,
                             const std::vector<WorkerInfo>& workers) {
  std::string out;
  for (int rank : missing) {
    if (!out.empty()) out += ", ";
    if (rank < static_cast<int>(workers.size()) && !workers[rank].name.empty()) {
      out += "'" + workers[rank].name + "' (rank " + std::to_string(rank) + ")";
    } else {
      out += "rank " + std::to_string(rank);
    }
  }
  return out;
}

// The message a failed future carries to the caller: a RemoteError's own text (not wrapped
// twice), else the exception's message without LibTorch's backtrace.
std::string error_text(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const RemoteError& remote) {
    return remote.remote_message();
  } catch (const c10::Error& c10_error) {
    return c10_error.what_without_backtrace();
  } catch (const std::exception& other) {
    return other.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

}  // namespace

Agent::Agent(const std::string& name, int rank, int world_size, const RpcBackendOptions& options)
    : rank_(rank), world_size_(world_size), options_(options), io_work_(io_.get_executor()) {
  request_pool_ =
      std::make_unique<Executor>(options.num_worker_threads(), options.max_extra_worker_threads());
  ordered_ = std::make_unique<Executor>(1);
  completion_ = std::make_unique<Executor>(1);
  pending_ = std::make_unique<PendingCalls>(
      [this](std::vector<PendingCall> expired) { on_calls_expired(std::move(expired)); });
  io_thread_ = std::thread([this] { io_.run(); });
  try {
    rendezvous_ = comm::rendezvous(comm::RendezvousOptions(options.init_method())
                                       .rank(rank)
                                       .world_size(world_size)
                                       .timeout(options.init_timeout())
                                       .prefix("distoptim/rpc/rendezvous")
                                       .launch_env(options.launch_env()));
    start_listening();
    exchange_addresses(name);
    rrefs_ = std::make_unique<RRefContext>(*this, rank_, world_size_);
    // Only now, with every worker known, take peers' connections (they wait in the backlog).
    asio::post(io_, [this] {
      listener_->start([this](std::shared_ptr<Connection> connection) { on_accepted(connection); });
    });
  } catch (...) {
    stop();
    throw;
  }
}

Agent::~Agent() {
  try {
    stop();
  } catch (...) {
  }
}

HandshakeConfig Agent::handshake_config() const {
  HandshakeConfig config;
  config.secret = options_.shared_secret();
  config.self_id = rank_;
  config.self_name = workers_.empty() ? std::string() : workers_[rank_].name;
  config.world_size = world_size_;
  config.timeout = options_.handshake_timeout();
  config.peer_memory = options_.same_host_memory_reads();
  return config;
}

std::map<std::string, int64_t> Agent::debug_info() {
  std::vector<std::shared_ptr<Connection>> open;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    open = incoming_;
    for (const auto& [peer, outgoing] : outgoing_) {
      if (outgoing.connection) open.push_back(outgoing.connection);
    }
  }
  int64_t peer_memory = 0;
  int64_t bytes_read = 0;
  for (const auto& connection : open) {
    peer_memory += connection->peer_memory_enabled() ? 1 : 0;
    bytes_read += static_cast<int64_t>(connection->peer_memory_bytes_read());
  }
  return {{"connections", static_cast<int64_t>(open.size())},
          {"peer_memory.connections", peer_memory},
          {"peer_memory.bytes_read", bytes_read}};
}

void Agent::start_listening() {
  const std::string& address =
      options_.listen_address().empty() ? rendezvous_.local_address : options_.listen_address();
  listener_ = std::make_shared<Listener>(io_, address);
}

void Agent::exchange_addresses(const std::string& name) {
  comm::DeadlineStore& store = *rendezvous_.store;
  const std::string key_prefix = std::string(kStorePrefix) + "worker/";
  const std::string url = listener_->address() + " " + std::to_string(listener_->port());
  const auto deadline = std::chrono::steady_clock::now() + options_.init_timeout();
  store.set(key_prefix + std::to_string(rank_), std::vector<uint8_t>(name.begin(), name.end()),
            deadline);
  store.set(key_prefix + std::to_string(rank_) + "/url",
            std::vector<uint8_t>(url.begin(), url.end()), deadline);
  const std::vector<int> missing =
      comm::wait_for_rank_keys(store, key_prefix, world_size_, deadline);
  DISTOPTIM_CHECK_WITH(TimeoutError, missing.empty(), "init_rpc: worker '", name, "' (rank ", rank_,
                       ") waited ", options_.init_timeout().count(),
                       " ms for workers that never arrived: ", describe_missing(missing, {}));
  workers_.resize(world_size_);
  addresses_.resize(world_size_);
  for (int id = 0; id < world_size_; ++id) {
    const std::vector<uint8_t> peer_name = store.get(key_prefix + std::to_string(id), deadline);
    const std::vector<uint8_t> peer_url =
        store.get(key_prefix + std::to_string(id) + "/url", deadline);
    workers_[id] = WorkerInfo{std::string(peer_name.begin(), peer_name.end()), id};
    const std::string address(peer_url.begin(), peer_url.end());
    const size_t space = address.rfind(' ');
    TORCH_CHECK_VALUE(space != std::string::npos, "init_rpc: worker ", id,
                      " published a malformed address '", address, "'");
    addresses_[id] = {address.substr(0, space), std::stoi(address.substr(space + 1))};
    auto [it, inserted] = ids_by_name_.emplace(workers_[id].name, id);
    TORCH_CHECK_VALUE(inserted, "init_rpc: the worker name '", workers_[id].name,
                      "' is used by both rank ", it->second, " and rank ", id);
  }
}

int Agent::resolve(const WorkerRef& to) const {
  if (to.name()) {
    auto it = ids_by_name_.find(*to.name());
    if (it == ids_by_name_.end()) {
      std::string known;
      for (const WorkerInfo& worker : workers_) {
        known += (known.empty() ? "'" : ", '") + worker.name + "'";
      }
      TORCH_CHECK_VALUE(false, "rpc: no worker is named '", *to.name(), "' (workers: ", known, ")");
    }
    return it->second;
  }
  const int id = to.id().value_or(-1);
  TORCH_CHECK_VALUE(id >= 0 && id < world_size_, "rpc: worker id ", id, " is out of range [0, ",
                    world_size_, ")");
  return id;
}

// RRefs in a message that is refused or comes too late are taken and dropped at once, so that
// their owners hear nobody holds them (else the owners keep the values until shutdown).
void Agent::discard_rrefs(const std::vector<c10::IValue>& values) {
  for (const c10::IValue& value : values) {
    try {
      (void)rrefs_->receive(value);
    } catch (...) {
    }
  }
}

void Agent::handle_request(const std::shared_ptr<Connection>& connection, int connection_peer,
                           const MessageHeader& header, const std::string& body,
                           std::vector<at::Tensor> buffers) {
  const std::string& me = self().name;
  int caller = -1;
  std::optional<std::string> failure;
  try {
    DecodedMessage request;
    const bool ordered = (header.flags & MessageHeader::kOrdered) != 0;
    if (Status error = decode_body(header, body, std::move(buffers), limits_, &request)) {
      failure = "malformed request: " + *error;
    } else if (request.caller_id != connection_peer) {
      failure = "malformed request: caller id " + std::to_string(request.caller_id) +
                " on the connection of worker id " + std::to_string(connection_peer);
    } else if (ordered != RRefContext::is_control(request.callable)) {
      failure = "'" + request.callable + "' cannot be called " +
                (ordered ? "as an ordered control message" : "by name");
      discard_rrefs(request.args);
    } else if (ordered) {
      caller = request.caller_id;
      auto result = rrefs_->handle_control(request.callable, std::move(request.args), caller,
                                           header.id, request.metadata);
      // The reply may wait (a fetch of a value still being created); it is written by whoever
      // completes `result`.
      result->addCallback([this, connection, id = header.id, caller,
                           callable = request.callable](c10::ivalue::Future& done) {
        reply(connection, id, caller, callable, done);
      });
      return;
    } else if (auto function = find_function(request.callable)) {
      caller = request.caller_id;
      for (c10::IValue& arg : request.args) {
        arg = rrefs_->receive(arg);
      }
      // Lives while the function runs (a context the interceptor set for it).
      const std::shared_ptr<void> context =
          intercept_receive({MessageInfo::Kind::kRequest, caller, request.callable, header.id},
                            request.args, request.metadata);
      c10::IValue value = (*function)(std::move(request.args));
      if (value.isFuture()) {
        // async_execution: the reply goes when the returned future completes, on whichever
        // thread completes it, and the request counts as in flight until then. The future may
        // outlive the agent: the callback holds it weakly.
        {
          std::lock_guard<std::mutex> lock(mutex_);
          ++in_flight_requests_;
        }
        value.toFuture()->addCallback([weak = weak_from_this(), connection, id = header.id, caller,
                                       callable = request.callable](c10::ivalue::Future& done) {
          if (auto agent = weak.lock()) {
            agent->reply(connection, id, caller, callable, done);
            std::lock_guard<std::mutex> lock(agent->mutex_);
            --agent->in_flight_requests_;
            agent->idle_.notify_all();
          }
        });
        return;
      }
      auto result = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
      result->markCompleted(snapshot_shared_tensors(value, /*holders=*/1));
      value = c10::IValue();
      reply(connection, header.id, caller, request.callable, *result);
      return;
    } else {
      failure = "no function or class is registered as '" + request.callable + "'";
      discard_rrefs(request.args);
    }
  } catch (...) {
    failure = error_text(std::current_exception());
  }
  // A failed write means the caller is gone; its side reports that.
  connection->send(encode_error(header.id, *failure, me));
}

void Agent::reply(const std::shared_ptr<Connection>& connection, uint64_t id, int caller,
                  const std::string& callable, const c10::ivalue::Future& result) {
  EncodedMessage message;
  if (result.hasError()) {
    message = encode_error(id, error_text(result.exception_ptr()), self().name);
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
      message = encode_error(id, error_text(std::current_exception()), self().name);
    }
  }
  connection->send(std::move(message));
}

c10::intrusive_ptr<c10::ivalue::Future> Agent::run_locally(const std::string& callable,
                                                           std::vector<c10::IValue> args,
                                                           Preparation prepare) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    DISTOPTIM_CHECK_WITH(DistributedError, state_ == State::kRunning,
                         "rpc: the agent is shutting down; cannot run '", callable, "'");
    ++in_flight_requests_;
  }
  request_pool_->post(
      [this, future, callable, args = std::move(args), prepare = std::move(prepare)]() mutable {
        auto remote_error = [me = self().name](const std::exception_ptr& error) {
          return std::make_exception_ptr(RemoteError(
              {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, me, error_text(error)));
        };
        try {
          auto function = find_function(callable);
          TORCH_CHECK_VALUE(function != nullptr, "no function or class is registered as '",
                            callable, "'");
          const std::shared_ptr<void> context = prepare ? prepare(args) : nullptr;
          c10::IValue value = (*function)(std::move(args));
          if (value.isFuture()) {
            // async_execution, as in handle_request: done (and no longer in flight) when the
            // returned future is.
            value.toFuture()->addCallback(
                [weak = weak_from_this(), future, remote_error](c10::ivalue::Future& done) {
                  if (done.hasError()) {
                    future->setErrorIfNeeded(remote_error(done.exception_ptr()));
                  } else {
                    future->markCompleted(done.value());
                  }
                  if (auto agent = weak.lock()) {
                    std::lock_guard<std::mutex> lock(agent->mutex_);
                    --agent->in_flight_requests_;
                    agent->idle_.notify_all();
                  }
                });
            return;
          }
          future->markCompleted(std::move(value));
        } catch (...) {
          future->setErrorIfNeeded(remote_error(std::current_exception()));
        }
        std::lock_guard<std::mutex> lock(mutex_);
        --in_flight_requests_;
        idle_.notify_all();
      });
  return future;
}

std::vector<c10::IValue> Agent::through_wire_to_self(const std::string& callable,
                                                     const std::vector<c10::IValue>& args) {
  ForkBatch forks;
  EncodedMessage message;
  std::vector<c10::IValue> prepared;
  try {
    for (const c10::IValue& arg : args) {
      prepared.push_back(rrefs_->prepare_to_send(arg, rank_, &forks));
    }
    message = encode_request(0, callable, prepared, 0, rank_);
  } catch (...) {
    rrefs_->rollback(forks);
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
    arg = rrefs_->receive(arg);
  }
  return std::move(decoded.args);
}

void Agent::handle_reply(int peer, const MessageHeader& header, const std::string& body,
                         std::vector<at::Tensor> buffers) {
  // Replies from a worker the call did not go to are treated as late ones.
  std::optional<PendingCall> call = pending_->take(header.id, peer);
  const std::string& worker = workers_[peer].name;
  DecodedMessage reply;
  if (Status error = decode_body(header, body, std::move(buffers), limits_, &reply)) {
    if (call) {
      call->future->setError(DISTOPTIM_RPC_ERROR(
          DistributedError, "rpc: worker '" + worker + "' sent a malformed reply to '" +
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
        {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, worker, reply.error_message)));
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
        DistributedError, "rpc: worker '" + worker + "' sent an unusable reply to '" +
                              call->function + "': " + error_text(std::current_exception())));
  }
}

void Agent::lose_peer(int peer, const std::string& why) {
  bool stopping = false;
  std::shared_ptr<Connection> connection;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping = state_ != State::kRunning;
    auto it = outgoing_.find(peer);
    if (it != outgoing_.end()) {
      connection = std::move(it->second.connection);
      outgoing_.erase(it);
    }
    lost_peers_.emplace(peer, why);
  }
  if (connection) {
    connection->close(why);
  }
  std::vector<PendingCall> failed = pending_->take_to(peer);
  if (!stopping) {
    ordered_->post([this, peer] { on_peer_gone(peer); });
  }
  const std::string worker = workers_[peer].name;
  fail_calls(std::move(failed), [worker, why, stopping](const PendingCall& call) {
    if (stopping) {
      return DISTOPTIM_RPC_ERROR(DistributedError, "rpc: the agent shut down before worker '" +
                                                       worker + "' answered '" + call.function +
                                                       "'");
    }
    return DISTOPTIM_RPC_ERROR(PeerLostError, "rpc: lost the connection to worker '" + worker +
                                                  "' (" + why + "); the call to '" + call.function +
                                                  "' failed");
  });
}

// Calls past their deadline fail; a message of theirs still waiting to be written is dropped,
// so a stalled peer cannot make a worker hold the arguments of calls that already failed.
void Agent::on_calls_expired(std::vector<PendingCall> expired) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const PendingCall& call : expired) {
      auto it = outgoing_.find(call.to);
      if (it == outgoing_.end()) {
        continue;
      }
      auto& held = it->second.held;
      const size_t before = held.size();
      held.erase(std::remove_if(held.begin(), held.end(),
                                [&](const EncodedMessage& message) {
                                  MessageHeader header;
                                  return !decode_header(message.header, &header) &&
                                         header.id == call.id;
                                }),
                 held.end());
      if (held.size() == before && it->second.connection) {
        it->second.connection->drop_queued(call.id);
      }
    }
  }
  fail_calls(std::move(expired), [this](const PendingCall& call) {
    return DISTOPTIM_RPC_ERROR(TimeoutError, "rpc: the call to '" + call.function +
                                                 "' on worker '" + workers_[call.to].name +
                                                 "' timed out");
  });
}

void Agent::fail_calls(std::vector<PendingCall> calls,
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

c10::intrusive_ptr<c10::ivalue::Future> Agent::send(int to, const std::string& function,
                                                    std::vector<c10::IValue> args,
                                                    std::chrono::milliseconds timeout,
                                                    uint16_t flags, SendInterception intercept,
                                                    bool waited_only) {
  TORCH_CHECK_VALUE(timeout == kDefaultTimeout || timeout.count() >= 0, "rpc: timeout of ",
                    timeout.count(), " ms calling '", function, "' on worker '", workers_[to].name,
                    "' (use a positive value, kNoTimeout or kDefaultTimeout)");
  TORCH_CHECK_VALUE(!function.empty(), "rpc: the function name is empty (calling worker '",
                    workers_[to].name, "')");
  const std::chrono::milliseconds effective =
      timeout == kDefaultTimeout ? options_.rpc_timeout() : timeout;
  static std::atomic<uint64_t> next_id{1};
  const uint64_t id = next_id.fetch_add(1);
  // Encoding checks every argument (and may throw) before the call is registered anywhere;
  // forks of RRefs among the arguments are undone if the message is not sent.
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
    message = encode_request(id, function, args, effective.count(), rank_, flags, metadata);
  } catch (...) {
    rrefs_->rollback(forks);
    throw;
  }
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  std::unique_lock<std::mutex> lock(mutex_);
  if (state_ != State::kRunning) {
    lock.unlock();
    rrefs_->rollback(forks);
    DISTOPTIM_THROW(DistributedError, "rpc: the agent is shutting down; cannot call '", function,
                    "' on worker '", workers_[to].name, "'");
  }
  auto lost = lost_peers_.find(to);
  if (lost != lost_peers_.end()) {
    const std::string why = lost->second;
    lock.unlock();
    rrefs_->rollback(forks);
    future->setError(DISTOPTIM_RPC_ERROR(PeerLostError, "rpc: lost the connection to worker '" +
                                                            workers_[to].name + "' (" + why +
                                                            "); cannot call '" + function + "'"));
    return future;
  }
  PendingCall call;
  call.id = id;
  call.future = future;
  call.to = to;
  call.function = function;
  call.waited_only = waited_only;
  if (effective.count() > 0) {
    call.has_deadline = true;
    call.deadline = std::chrono::steady_clock::now() + effective;
  }
  pending_->add(std::move(call));
  auto [it, created] = outgoing_.try_emplace(to);
  Outgoing& out = it->second;
  if (out.ready) {
    // Under the lock, so that calls reach the connection in the order they were made.
    out.connection->send(std::move(message));
  } else {
    out.held.push_back(std::move(message));
  }
  lock.unlock();
  if (created) {
    connect_to(to);
  }
  return future;
}

void Agent::on_peer_gone(int peer) {
  rrefs_->on_peer_lost(peer);
  if (auto installed = interceptor()) {
    installed->on_peer_lost(peer);
  }
}

namespace {

std::string barrier_failed_key(const std::string& prefix) { return prefix + "failed"; }
std::string barrier_left_key(const std::string& prefix, int rank) {
  return prefix + "left/" + std::to_string(rank);
}

// Rank 0, whose shutdown barrier under `prefix` timed out: publishes `why`, then waits (briefly)
// until the workers that arrived have read it, before it goes on to stop the store; otherwise
// they would see only the store's loss, not the workers that never came. Never throws.
void announce_barrier_failure(comm::DeadlineStore& store, const std::string& prefix, int world_size,
                              const std::string& why, const std::vector<int>& missing) {
  // Bounded: the workers that arrived read it within their next poll (at most 50 ms apart).
  const auto until = std::chrono::steady_clock::now() + kBarrierFailureGrace;
  try {
    store.set(barrier_failed_key(prefix), std::vector<uint8_t>(why.begin(), why.end()), until);
    for (int rank = 1; rank < world_size; ++rank) {
      if (std::find(missing.begin(), missing.end(), rank) != missing.end()) continue;
      while (!store.check({barrier_left_key(prefix, rank)}, until)) {
        if (std::chrono::steady_clock::now() >= until) return;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
  } catch (const std::exception&) {
    // The store failing too leaves nothing more to tell anyone.
  }
}

}  // namespace

void Agent::barrier(const std::string& round, bool wait) {
  // Every store operation ends by the barrier's deadline: a store host that stopped answering
  // fails it with TimeoutError, one that died with PeerLostError, both naming the store.
  comm::DeadlineStore& store = *rendezvous_.store;
  const std::string prefix = std::string(kStorePrefix) + "shutdown/" + round + "/";
  const auto deadline = std::chrono::steady_clock::now() + options_.shutdown_timeout();
  const auto lost_peers = [this] {
    std::lock_guard<std::mutex> lock(mutex_);
    return dead_peers_;
  };
  const auto throw_lost = [&](int peer, const std::string& why, const std::string& then) {
    DISTOPTIM_THROW(PeerLostError, "rpc shutdown: worker '", self().name, "' cannot pass barrier '",
                    round, "': worker ", describe_missing({peer}, workers_), " is lost (", why, ")",
                    then);
  };
  // A worker already known to be dead that has not arrived never will: fail now, not at the
  // deadline. (A worker that refused us is alive: it is waited for.)
  bool reported_lost = false;
  const auto check_lost = [&] {
    for (const auto& [peer, why] : lost_peers()) {
      if (!store.check({prefix + std::to_string(peer)}, deadline)) {
        reported_lost = true;
        throw_lost(peer, why, "");
      }
    }
    // Rank 0, which serves the store, gave up: it says why (announce_barrier_failure).
    if (rank_ != 0 && store.check({barrier_failed_key(prefix)}, deadline)) {
      const std::vector<uint8_t> why = store.get(barrier_failed_key(prefix), deadline);
      store.add(barrier_left_key(prefix, rank_), 1, deadline);
      DISTOPTIM_THROW(TimeoutError, "rpc shutdown: worker '", self().name,
                      "' cannot pass barrier '", round, "': ", std::string(why.begin(), why.end()));
    }
  };
  std::vector<int> missing;
  try {
    // add, not set: a TCPStore answers an add, so the key is in the store before this worker
    // goes on; a set is not answered, and a worker that leaves right after could be taken for
    // lost by rank 0 before its key arrives.
    store.add(prefix + std::to_string(rank_), 1, deadline);
    if (!wait) {
      return;
    }
    missing = comm::wait_for_rank_keys(store, prefix, world_size_, deadline, check_lost);
  } catch (const DistributedError& error) {
    // The store host may have left first, its own barrier failed by the same dead worker: the
    // worker known to be lost is the cause to report, the store's failure its consequence.
    const auto lost = lost_peers();
    if (reported_lost || lost.empty()) throw;
    throw_lost(lost.begin()->first, lost.begin()->second,
               std::string("; then: ") + error.what_without_backtrace());
  }
  if (missing.empty()) {
    return;
  }
  const std::string why =
      "worker '" + self().name + "' waited " + std::to_string(options_.shutdown_timeout().count()) +
      " ms at barrier '" + round +
      "' for workers that never arrived: " + describe_missing(missing, workers_);
  if (rank_ == 0) {
    announce_barrier_failure(store, prefix, world_size_, why, missing);
  }
  DISTOPTIM_THROW(TimeoutError, "rpc shutdown: ", why);
}

void Agent::shutdown(bool graceful) {
  std::exception_ptr failure;
  if (graceful) {
    try {
      barrier("entered");
      // Every worker has stopped making calls: delete the RRefs its users still hold, so that
      // owners free their values before the agents stop (PyTorch does the same at shutdown).
      const auto deadline = std::chrono::steady_clock::now() + options_.shutdown_timeout();
      rrefs_->release_all_users(deadline);
      const bool calls_done = pending_->wait_empty(deadline);
      int requests_left = 0;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        idle_.wait_until(lock, deadline, [this] { return in_flight_requests_ == 0; });
        requests_left = in_flight_requests_;
      }
      DISTOPTIM_CHECK_WITH(TimeoutError, calls_done && requests_left == 0, "rpc shutdown: worker '",
                           self().name, "' still had ", pending_->size(), " call(s) and ",
                           requests_left, " request(s) outstanding after ",
                           options_.shutdown_timeout().count(), " ms");
      barrier("drained");
      // Rank 0 serves the store: it leaves last, once every worker is past the barrier.
      barrier("left", /*wait=*/rank_ == 0);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  stop();
  if (failure) {
    std::rethrow_exception(failure);
  }
}

void Agent::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (state_ != State::kRunning) {
      return;
    }
    state_ = State::kStopping;
  }
  // Close every connection on the I/O thread, then let it run out: after the join no transport
  // callback runs any more.
  asio::post(io_, [this] {
    std::vector<std::shared_ptr<Connection>> connections;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [peer, out] : outgoing_) {
        if (out.connection) connections.push_back(out.connection);
      }
      connections.insert(connections.end(), incoming_.begin(), incoming_.end());
    }
    for (const auto& connection : connections) {
      connection->close("the agent stopped");
    }
    if (listener_) {
      listener_->close();
    }
  });
  // Handlers run in the order they were posted: the connections are closed before the loop
  // stops, and whatever the closing queued (cancelled reads, writes, timers) is dropped with it.
  asio::post(io_, [this] { io_.stop(); });
  io_work_.reset();
  if (io_thread_.joinable()) {
    io_thread_.join();
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    state_ = State::kStopped;
    outgoing_.clear();
    incoming_.clear();
    unproven_.clear();
    paused_.clear();
  }
  idle_.notify_all();
  pending_->stop();
  // Fail what is left before joining the request pool: a request blocked on a nested call
  // is waiting for exactly these futures.
  fail_calls(pending_->take_all(), [this](const PendingCall& call) {
    return DISTOPTIM_RPC_ERROR(DistributedError, "rpc: the agent shut down before worker '" +
                                                     workers_[call.to].name + "' answered '" +
                                                     call.function + "'");
  });
  request_pool_->stop();
  ordered_->stop();
  completion_->stop();
  if (rrefs_) {
    owned_at_stop_ = rrefs_->close();
  }
  listener_.reset();
  rendezvous_.store.reset();
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
