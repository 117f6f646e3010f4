#include "agent.h"

#include <algorithm>
#include <atomic>

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
// Accepted connections whose peer has not proven itself yet, beyond one per worker of the job:
// past that many, the oldest is closed (see Agent::on_accepted).
constexpr size_t kExtraUnprovenConnections = 64;
// Connection attempts to a peer whose connection is lost before its handshake ends (the peer's
// listener was busy, or it evicted us among stalled connections) before the peer counts as lost.
constexpr int kConnectAttempts = 5;
constexpr std::chrono::milliseconds kReconnectDelay{100};
// How long a connection closed for a protocol error waits for the peer to read why.
constexpr std::chrono::milliseconds kFarewellLinger{1000};

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

size_t frame_bytes(const Frame& frame) {
  size_t bytes = frame.body->size();
  for (const at::Tensor& buffer : frame.buffers) bytes += buffer.nbytes();
  return bytes;
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
  return config;
}

void Agent::start_listening() {
  std::string address = options_.listen_address();
  if (address.empty()) {
    address = rendezvous_.master_addr.empty() || comm::is_loopback_address(rendezvous_.master_addr)
                  ? "127.0.0.1"
                  : host_address();
  }
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

// Accepting side: every connection proves itself within options().handshake_timeout, and at most
// world_size + kExtraUnprovenConnections wait at once: a job's workers open one connection each
// and prove themselves within milliseconds, so past that the oldest is a peer that stalls.
void Agent::on_accepted(const std::shared_ptr<Connection>& connection) {
  std::shared_ptr<Connection> evicted;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (state_ != State::kRunning) {
      connection->close("the agent is stopping");
      return;
    }
    incoming_.push_back(connection);
    unproven_.push_back(connection);
    if (unproven_.size() > static_cast<size_t>(world_size_) + kExtraUnprovenConnections) {
      evicted = std::move(unproven_.front());
      unproven_.pop_front();
    }
  }
  if (evicted) {
    evicted->close("too many connections waiting to prove themselves; this was the oldest");
  }
  accept_handshake(connection, handshake_config(), [this, connection](HandshakeOutcome outcome) {
    if (!outcome.accepted) {
      forget_incoming(connection);
      return;
    }
    on_caller_proven(connection, outcome.peer);
  });
}

void Agent::on_caller_proven(const std::shared_ptr<Connection>& connection, int caller) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    unproven_.erase(std::remove(unproven_.begin(), unproven_.end(), connection), unproven_.end());
  }
  std::weak_ptr<Connection> weak = connection;
  Connection* raw = connection.get();
  connection->set_farewell([this, raw](const std::string& why) { return farewell(raw, why); });
  connection->read_frames(
      limits_,
      [this, weak, caller](Frame frame) {
        auto self = weak.lock();
        return self && on_request_frame(self, caller, std::move(frame));
      },
      [this, weak, caller](const std::string&) {
        if (auto self = weak.lock()) forget_incoming(self);
        // A caller's connection closed: it died or stopped. Forks it held are gone with it,
        // after the control messages it sent before (they run on the same ordered thread).
        if (caller != rank_) {
          ordered_->post([this, caller] { rrefs_->on_peer_lost(caller); });
        }
      });
}

void Agent::forget_incoming(const std::shared_ptr<Connection>& connection) {
  std::lock_guard<std::mutex> lock(mutex_);
  incoming_.erase(std::remove(incoming_.begin(), incoming_.end(), connection), incoming_.end());
  unproven_.erase(std::remove(unproven_.begin(), unproven_.end(), connection), unproven_.end());
  paused_.erase(std::remove(paused_.begin(), paused_.end(), connection), paused_.end());
}

// Connecting side. Calls made meanwhile wait in `held`.
void Agent::connect_to(int peer) {
  const auto& [address, port] = addresses_[peer];
  connect(io_, address, port,
          [this, peer](std::shared_ptr<Connection> connection, const std::string& error) {
            if (!connection) {
              on_outgoing_lost(peer, nullptr, "cannot connect: " + error, /*refused=*/false);
              return;
            }
            {
              std::lock_guard<std::mutex> lock(mutex_);
              auto it = outgoing_.find(peer);
              if (state_ != State::kRunning || it == outgoing_.end()) {
                connection->close("the agent is stopping");
                return;
              }
              it->second.connection = connection;
            }
            connect_handshake(connection, handshake_config(), peer,
                              [this, peer, connection](HandshakeOutcome outcome) {
                                if (outcome.accepted) {
                                  on_connected(peer, connection);
                                } else {
                                  on_outgoing_lost(peer, connection, outcome.why,
                                                   outcome.refused);
                                }
                              });
          });
}

// The handshake succeeded: read replies, then write the calls made meanwhile, in order, and let
// new calls write directly.
void Agent::on_connected(int peer, const std::shared_ptr<Connection>& connection) {
  std::weak_ptr<Connection> weak = connection;
  Connection* raw = connection.get();
  connection->set_farewell([this, raw](const std::string& why) { return farewell(raw, why); });
  connection->read_frames(
      limits_,
      [this, weak, peer](Frame frame) {
        auto self = weak.lock();
        return self && on_reply_frame(self, peer, std::move(frame));
      },
      [this, weak, peer](const std::string& why) {
        on_outgoing_lost(peer, weak.lock(), why, /*refused=*/false);
      });
  std::vector<EncodedMessage> held;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = outgoing_.find(peer);
    if (it == outgoing_.end() || it->second.connection != connection) {
      return;  // Lost meanwhile; its calls failed with it.
    }
    held.swap(it->second.held);
    it->second.ready = true;
    // Sent while the lock is held: a call made now queues behind these on the connection.
    for (EncodedMessage& message : held) {
      connection->send(std::move(message));
    }
  }
}

// A connection to `peer` failed. Before its handshake ended, a lost connection is tried again a
// few times (the calls wait in `held`); a refusal, or a loss after the handshake, loses the peer.
// A peer lost other than by refusal counts as dead (graceful shutdown does not wait for it).
void Agent::on_outgoing_lost(int peer, const std::shared_ptr<Connection>& connection,
                             const std::string& why, bool refused) {
  std::string reason = why;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = outgoing_.find(peer);
    if (it == outgoing_.end() || (connection && it->second.connection != connection)) {
      return;
    }
    if (!it->second.farewell.empty()) {
      reason = it->second.farewell;
    }
    if (state_ == State::kRunning && !refused && !it->second.ready &&
        ++it->second.attempts < kConnectAttempts) {
      it->second.connection = nullptr;
      auto timer = std::make_shared<asio::steady_timer>(io_, kReconnectDelay * it->second.attempts);
      timer->async_wait([this, peer, timer](const asio::error_code& error) {
        if (!error) connect_to(peer);
      });
      return;
    }
    if (!refused) {
      dead_peers_.emplace(peer, reason);
    }
  }
  lose_peer(peer, reason);
}

bool Agent::on_request_frame(const std::shared_ptr<Connection>& connection, int caller,
                             Frame frame) {
  if (frame.header.type == MessageType::kError && frame.header.id == 0) {
    log_farewell(frame);  // The caller closes its connection and says why.
    return true;
  }
  if (frame.header.type != MessageType::kRequest) {
    protocol_error(connection, "a message other than a request on its own connection");
    return false;
  }
  const size_t bytes = frame_bytes(frame);
  bool go_on = true;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (state_ == State::kStopped) {
      return false;
    }
    ++in_flight_requests_;
    inbound_bytes_ += bytes;
    if (inbound_bytes_ > options_.inbound_queue_bytes()) {
      paused_.push_back(connection);
      go_on = false;
    }
  }
  // RRef control messages keep their order of arrival (on one thread); they never block.
  Executor& executor =
      (frame.header.flags & MessageHeader::kOrdered) ? *ordered_ : *request_pool_;
  executor.post([this, connection, caller, bytes, frame = std::move(frame)]() mutable {
    handle_request(connection, caller, frame.header, *frame.body, std::move(frame.buffers));
    request_done(bytes);
  });
  return go_on;
}

void Agent::request_done(size_t bytes) {
  std::vector<std::shared_ptr<Connection>> resume;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    --in_flight_requests_;
    inbound_bytes_ -= bytes;
    if (!paused_.empty() && inbound_bytes_ <= options_.inbound_queue_bytes() / 2) {
      resume.swap(paused_);
    }
    idle_.notify_all();
  }
  for (const auto& connection : resume) {
    connection->resume_reading();
  }
}

bool Agent::on_reply_frame(const std::shared_ptr<Connection>& connection, int peer, Frame frame) {
  const MessageHeader& header = frame.header;
  if (header.type == MessageType::kError && header.id == 0) {
    // The peer closes this connection and says why (a protocol error it saw).
    const std::string why = log_farewell(frame);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = outgoing_.find(peer);
    if (it != outgoing_.end() && it->second.connection == connection) {
      it->second.farewell = why;
    }
    return true;
  }
  if (header.type != MessageType::kResponse && header.type != MessageType::kError) {
    protocol_error(connection, "a message other than a reply on this worker's connection");
    return false;
  }
  completion_->post([this, peer, frame = std::move(frame)]() mutable {
    handle_reply(peer, frame.header, *frame.body, std::move(frame.buffers));
  });
  return true;
}

// Closes a connection whose peer broke the protocol, telling the peer why first, so that both
// sides say what happened.
void Agent::protocol_error(const std::shared_ptr<Connection>& connection, const std::string& why) {
  connection->close_after(farewell(connection.get(), "it sent " + why), why, kFarewellLinger);
}

std::string Agent::log_farewell(const Frame& frame) {
  DecodedMessage farewell;
  std::string why = "the peer closed the connection without saying why";
  if (!decode_body(frame.header, *frame.body, {}, limits_, &farewell)) {
    why = farewell.error_message;
  }
  TORCH_WARN("rpc: worker '", self().name, "' was told: ", why);
  return why;
}

EncodedMessage Agent::farewell(Connection* connection, const std::string& why) {
  const std::string text = "worker '" + self().name + "' closed the connection with " +
                           connection->peer_address() + ": " + why;
  TORCH_WARN("rpc: ", text);
  return encode_error(0, text, self().name);
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
      const std::shared_ptr<void> context = intercept_receive(
          {MessageInfo::Kind::kRequest, caller, request.callable, header.id}, request.args,
          request.metadata);
      c10::IValue value = (*function)(std::move(request.args));
      if (value.isFuture()) {
        // async_execution: the reply goes when the returned future completes, on whichever
        // thread completes it, and the request counts as in flight until then. The future may
        // outlive the agent: the callback holds it weakly.
        {
          std::lock_guard<std::mutex> lock(mutex_);
          ++in_flight_requests_;
        }
        value.toFuture()->addCallback(
            [weak = weak_from_this(), connection, id = header.id, caller,
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
      message =
          encode_response(id, rrefs_->prepare_to_send(values[0], caller, &forks), metadata);
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
  request_pool_->post([this, future, callable, args = std::move(args),
                       prepare = std::move(prepare)]() mutable {
    auto remote_error = [me = self().name](const std::exception_ptr& error) {
      return std::make_exception_ptr(RemoteError(
          {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, me, error_text(error)));
    };
    try {
      auto function = find_function(callable);
      TORCH_CHECK_VALUE(function != nullptr, "no function or class is registered as '", callable,
                        "'");
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
  TORCH_INTERNAL_ASSERT(!error, "rpc: a message to this worker itself did not decode: ",
                        error.value_or(""));
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
    ordered_->post([this, peer] { rrefs_->on_peer_lost(peer); });
  }
  const std::string worker = workers_[peer].name;
  fail_calls(std::move(failed), [worker, why, stopping](const PendingCall& call) {
    if (stopping) {
      return DISTOPTIM_RPC_ERROR(DistributedError, "rpc: the agent shut down before worker '" +
                                                       worker + "' answered '" + call.function +
                                                       "'");
    }
    return DISTOPTIM_RPC_ERROR(PeerLostError, "rpc: lost the connection to worker '" + worker +
                                                  "' (" + why + "); the call to '" +
                                                  call.function + "' failed");
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
                                                    uint16_t flags, SendInterception intercept) {
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

void Agent::barrier(const std::string& round, bool wait) {
  // Every store operation ends by the barrier's deadline: a store host that stopped answering
  // fails it with TimeoutError, one that died with PeerLostError, both naming the store.
  comm::DeadlineStore& store = *rendezvous_.store;
  const std::string prefix = std::string(kStorePrefix) + "shutdown/" + round + "/";
  const auto deadline = std::chrono::steady_clock::now() + options_.shutdown_timeout();
  store.set(prefix + std::to_string(rank_), std::vector<uint8_t>{1}, deadline);
  if (!wait) {
    return;
  }
  // A worker already known to be dead that has not arrived never will: fail now, not at the
  // deadline. (A worker that refused us is alive: it is waited for.)
  const auto check_lost = [&] {
    std::map<int, std::string> lost;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      lost = dead_peers_;
    }
    for (const auto& [peer, why] : lost) {
      if (!store.check({prefix + std::to_string(peer)}, deadline)) {
        DISTOPTIM_THROW(PeerLostError, "rpc shutdown: worker '", self().name, "' cannot pass barrier '",
                        round, "': worker ", describe_missing({peer}, workers_),
                        " is lost (", why, ")");
      }
    }
  };
  const std::vector<int> missing =
      comm::wait_for_rank_keys(store, prefix, world_size_, deadline, check_lost);
  DISTOPTIM_CHECK_WITH(TimeoutError, missing.empty(), "rpc shutdown: worker '", self().name,
                       "' waited ", options_.shutdown_timeout().count(), " ms at barrier '", round,
                       "' for workers that never arrived: ", describe_missing(missing, workers_));
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
      DISTOPTIM_CHECK_WITH(TimeoutError, calls_done && requests_left == 0,
                           "rpc shutdown: worker '", self().name, "' still had ", pending_->size(),
                           " call(s) and ", requests_left, " request(s) outstanding after ",
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
