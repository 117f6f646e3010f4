#include "agent.h"

#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <random>

#include <ATen/ATen.h>
#include <tensorpipe/tensorpipe.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <distoptim/comm/errors.h>
#include <distoptim/comm/store_wait.h>

#include "handshake.h"
#include "registry_internal.h"

namespace tp = tensorpipe;

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

constexpr const char* kStorePrefix = "distoptim/rpc/";
// TensorPipe prefers the transport of highest priority both ends can use: shared memory on one
// host, TCP otherwise (PyTorch's agent ranks them the same way).
constexpr int64_t kUvPriority = 100;
constexpr int64_t kShmPriority = 200;
// Pipes of refused peers left open for them to read the refusal (see Agent::refuse).
constexpr size_t kKeptRefusedPipes = 16;
// Accepted pipes whose peer has not proven itself yet, beyond one per worker of the job: past
// that many, the oldest is closed (see Agent::accept_next).
constexpr size_t kExtraUnprovenPipes = 64;

template <class E>
std::exception_ptr make_error(std::string message) {
  return std::make_exception_ptr(
      E({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, std::move(message)));
}

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

// What a handshake message may be: a small body and nothing else.
WireLimits handshake_limits() {
  WireLimits limits;
  limits.max_body_bytes = 4096;
  limits.max_tensors = 0;
  limits.max_message_bytes = 4096;
  return limits;
}

std::string unique_shm_address() {
  std::random_device random;
  return "shm://distoptim_rpc_" + std::to_string(::getpid()) + "_" + std::to_string(random());
}

}  // namespace

Agent::Agent(const std::string& name, int rank, int world_size, const RpcBackendOptions& options)
    : rank_(rank), world_size_(world_size), options_(options) {
  request_pool_ = std::make_unique<Executor>(options.num_worker_threads());
  ordered_ = std::make_unique<Executor>(1);
  completion_ = std::make_unique<Executor>(1);
  timer_ = std::thread([this] { run_timer(); });
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
    // Only now, with every worker known, take peers' pipes (TensorPipe holds them till then).
    accept_next();
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

void Agent::start_listening() {
  std::string address = options_.listen_address();
  if (address.empty()) {
    if (rendezvous_.master_addr.empty() || comm::is_loopback_address(rendezvous_.master_addr)) {
      address = "127.0.0.1";
    } else {
      auto [error, host_address] = tp::transport::uv::lookupAddrForHostname();
      DISTOPTIM_CHECK_WITH(DistributedError, !error, "init_rpc: cannot find this host's address (",
                           error.what(), "); set RpcBackendOptions::listen_address");
      address = host_address;
    }
  }
  context_ = std::make_shared<tp::Context>(
      tp::ContextOptions().name("distoptim-rpc-" + std::to_string(rank_)));
  context_->registerTransport(kUvPriority, "uv", tp::transport::uv::create());
  std::vector<std::string> urls = {"uv://" + address + ":0"};
  if (options_.enable_shared_memory()) {
    auto shm = tp::transport::shm::create();
    if (shm->isViable()) {
      context_->registerTransport(kShmPriority, "shm", shm);
      urls.push_back(unique_shm_address());
    }
  }
  context_->registerChannel(0, "basic", tp::channel::basic::create());
  listener_ = context_->listen(urls);
}

void Agent::exchange_addresses(const std::string& name) {
  comm::DeadlineStore& store = *rendezvous_.store;
  const std::string key_prefix = std::string(kStorePrefix) + "worker/";
  const std::string url = listener_->url("uv");
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
  urls_.resize(world_size_);
  for (int id = 0; id < world_size_; ++id) {
    const std::vector<uint8_t> peer_name = store.get(key_prefix + std::to_string(id), deadline);
    const std::vector<uint8_t> peer_url =
        store.get(key_prefix + std::to_string(id) + "/url", deadline);
    workers_[id] = WorkerInfo{std::string(peer_name.begin(), peer_name.end()), id};
    urls_[id] = std::string(peer_url.begin(), peer_url.end());
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

void Agent::accept_next() {
  listener_->accept([this](const tp::Error& error, std::shared_ptr<tp::Pipe> pipe) {
    if (error) {
      return;  // The listener closed (shutdown) or failed; no more peers can connect.
    }
    // Connections that never answer the challenge must not pile up: a job's workers open at
    // most one pipe each to us and prove themselves within milliseconds, so beyond
    // world_size + kExtraUnprovenPipes pipes waiting for a proof, the oldest is a peer that
    // stalls, and it is closed.
    std::shared_ptr<tp::Pipe> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (state_ == State::kStopped) {
        return;
      }
      incoming_.push_back(pipe);
      unproven_.push_back(pipe);
      if (unproven_.size() > static_cast<size_t>(world_size_) + kExtraUnprovenPipes) {
        evicted = std::move(unproven_.front());
        unproven_.pop_front();
      }
    }
    if (evicted) {
      evicted->close();  // Its pending read fails, and challenge() forgets it.
    }
    challenge(pipe);
    accept_next();
  });
}

// Connection handshake. Every pipe starts with three messages (wire.proto's Handshake):
//   1. the accepting worker sends a challenge: a fresh random nonce and its id;
//   2. the connecting worker answers with its own fresh nonce, its id, and a proof:
//      HMAC-SHA256(secret, "connecting", both nonces, both ids);
//   3. the accepting worker checks the proof and either refuses (and closes the pipe) or
//      accepts with its own proof, HMAC-SHA256(secret, "accepting", the same fields), which the
//      connecting worker checks in turn before it sends any call.
// So both ends prove they know the secret without sending it, a recorded proof is worthless on
// another pipe (fresh nonces on both sides), and each pipe is bound to the authenticated id of
// the worker at its other end: requests claiming another caller id are refused. The accepting
// worker reads nothing from a pipe but the proof until it has checked it.

void Agent::read_handshake(const std::shared_ptr<tp::Pipe>& pipe, HandshakeCallback done) {
  pipe->readDescriptor([pipe, done](const tp::Error& error, tp::Descriptor descriptor) {
    if (error) {
      done(std::string(error.what()), true, {});
      return;
    }
    MessageHeader header;
    Status status = decode_header(descriptor.metadata, &header);
    if (!status && header.type != MessageType::kHandshake) {
      status = "a message other than the handshake before the handshake ended";
    }
    if (!status) {
      std::vector<size_t> payload_lengths;
      std::vector<size_t> tensor_lengths;
      for (const auto& payload : descriptor.payloads) payload_lengths.push_back(payload.length);
      for (const auto& tensor : descriptor.tensors) tensor_lengths.push_back(tensor.length);
      status = check_announced_sizes(header, payload_lengths, tensor_lengths, handshake_limits());
    }
    if (status) {
      done(status, false, {});
      return;
    }
    auto body = std::make_shared<std::string>(header.body_length, '\0');
    tp::Allocation allocation;
    allocation.payloads.push_back({body->data()});
    pipe->read(std::move(allocation), [header, body, done](const tp::Error& error) {
      if (error) {
        done(std::string(error.what()), true, {});
        return;
      }
      DecodedMessage message;
      Status status = decode_body(header, *body, {}, handshake_limits(), &message);
      done(status, false, status ? HandshakeMessage() : std::move(message.handshake));
    });
  });
}

// Accepting side: steps 1 and 3.
void Agent::challenge(const std::shared_ptr<tp::Pipe>& pipe) {
  using Step = HandshakeMessage::Step;
  HandshakeMessage question;
  question.step = Step::kChallenge;
  question.server_nonce = random_nonce();
  question.server_id = rank_;
  write(pipe, encode_handshake(question), [](const std::string&) {});
  read_handshake(
      pipe, [this, pipe, question](Status failure, bool pipe_failed, HandshakeMessage answer) {
        if (pipe_failed) {
          forget_incoming(pipe);  // The peer left before proving anything.
          return;
        }
        std::string why;
        if (failure) {
          why = "it sent " + *failure;
        } else if (answer.step != Step::kProof || answer.server_nonce != question.server_nonce ||
                   answer.server_id != rank_) {
          why = "its answer is not a proof for this worker's challenge";
        } else if (answer.client_id < 0 || answer.client_id >= world_size_) {
          why = "it claims worker id " + std::to_string(answer.client_id) + ", outside [0, " +
                std::to_string(world_size_) + ")";
        } else if (!proofs_equal(answer.proof,
                                 handshake_proof(options_.shared_secret(),
                                                 HandshakeRole::kConnecting, question.server_nonce,
                                                 answer.client_nonce, answer.client_id, rank_))) {
          why = "it did not prove that it knows the shared secret";
        }
        if (!why.empty()) {
          refuse(pipe, why);
          return;
        }
        HandshakeMessage accept;
        accept.step = Step::kAccept;
        accept.proof =
            handshake_proof(options_.shared_secret(), HandshakeRole::kAccepting,
                            question.server_nonce, answer.client_nonce, answer.client_id, rank_);
        {
          std::lock_guard<std::mutex> lock(mutex_);
          unproven_.erase(std::remove(unproven_.begin(), unproven_.end(), pipe), unproven_.end());
        }
        write(pipe, encode_handshake(accept), [](const std::string&) {});
        read_next(pipe, answer.client_id, /*outgoing=*/false);
      });
}

void Agent::refuse(const std::shared_ptr<tp::Pipe>& pipe, const std::string& why) {
  // The peer is named as it names itself: nothing it said can be trusted.
  TORCH_WARN("rpc: worker '", self().name, "' refused a connection from a peer calling itself '",
             pipe->getRemoteName(), "': ", why);
  HandshakeMessage refusal;
  refusal.step = HandshakeMessage::Step::kRefuse;
  refusal.refusal = "worker '" + self().name + "' refused the connection: " + why;
  write(pipe, encode_handshake(refusal), [](const std::string&) {});
  // Closing the pipe now could cut the refusal off in flight (the peer would see only an end of
  // file); the peer closes it once it has read why. Nothing more is read from it, and only the
  // last kKeptRefusedPipes stay open, so refused peers cannot pile up connections.
  std::shared_ptr<tp::Pipe> oldest;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    incoming_.erase(std::remove(incoming_.begin(), incoming_.end(), pipe), incoming_.end());
    unproven_.erase(std::remove(unproven_.begin(), unproven_.end(), pipe), unproven_.end());
    refused_.push_back(pipe);
    if (refused_.size() > kKeptRefusedPipes) {
      oldest = std::move(refused_.front());
      refused_.pop_front();
    }
  }
  if (oldest) {
    oldest->close();
  }
}

void Agent::forget_incoming(const std::shared_ptr<tp::Pipe>& pipe) {
  std::lock_guard<std::mutex> lock(mutex_);
  incoming_.erase(std::remove(incoming_.begin(), incoming_.end(), pipe), incoming_.end());
  unproven_.erase(std::remove(unproven_.begin(), unproven_.end(), pipe), unproven_.end());
}

// Connecting side: step 2, then the check of step 3. Calls made meanwhile wait in `held`.
void Agent::answer_challenge(const std::shared_ptr<tp::Pipe>& pipe, int peer) {
  using Step = HandshakeMessage::Step;
  read_handshake(pipe, [this, pipe, peer](Status failure, bool pipe_failed,
                                          HandshakeMessage question) {
    if (!failure && (question.step != Step::kChallenge || question.server_id != peer)) {
      failure = "a handshake that is not a challenge from worker id " + std::to_string(peer);
    }
    if (failure) {
      pipe->close();
      on_pipe_failed(peer, pipe_failed ? *failure : "it broke the handshake: it sent " + *failure);
      return;
    }
    HandshakeMessage answer;
    answer.step = Step::kProof;
    answer.server_nonce = question.server_nonce;
    answer.client_nonce = random_nonce();
    answer.client_id = rank_;
    answer.server_id = peer;
    answer.proof = handshake_proof(options_.shared_secret(), HandshakeRole::kConnecting,
                                   answer.server_nonce, answer.client_nonce, rank_, peer);
    write(pipe, encode_handshake(answer), [this, peer](const std::string& error) {
      if (!error.empty()) on_pipe_failed(peer, error);
    });
    read_handshake(pipe, [this, pipe, peer, answer](Status failure, bool pipe_failed,
                                                    HandshakeMessage verdict) {
      std::string why;
      if (failure) {
        why = pipe_failed ? *failure : "it broke the handshake: it sent " + *failure;
      } else if (verdict.step == Step::kRefuse) {
        why = verdict.refusal.empty() ? "it refused the connection" : verdict.refusal;
      } else if (verdict.step != Step::kAccept ||
                 !proofs_equal(
                     verdict.proof,
                     handshake_proof(options_.shared_secret(), HandshakeRole::kAccepting,
                                     answer.server_nonce, answer.client_nonce, rank_, peer))) {
        why = "it did not prove that it knows the shared secret";
      }
      if (!why.empty()) {
        pipe->close();
        on_pipe_failed(peer, why);
        return;
      }
      read_next(pipe, peer, /*outgoing=*/true);
      release_held(peer, pipe);
    });
  });
}

// Writes the calls made during the handshake, in order, then lets new calls write directly.
// New calls go on being held while a batch is written, so the order on the pipe stays the order
// in which calls were made.
void Agent::release_held(int peer, const std::shared_ptr<tp::Pipe>& pipe) {
  while (true) {
    std::vector<EncodedMessage> batch;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = outgoing_.find(peer);
      if (it == outgoing_.end() || it->second.pipe != pipe) {
        return;  // The pipe failed meanwhile; its calls were failed with it.
      }
      if (it->second.held.empty()) {
        it->second.ready = true;
        return;
      }
      batch.swap(it->second.held);
    }
    for (EncodedMessage& message : batch) {
      write(pipe, std::move(message), [this, peer](const std::string& error) {
        if (!error.empty()) on_pipe_failed(peer, error);
      });
    }
  }
}

// Runs on TensorPipe's loop: check what the peer announces, allocate exactly that, read it.
void Agent::read_next(const std::shared_ptr<tp::Pipe>& pipe, int peer, bool outgoing) {
  pipe->readDescriptor(
      [this, pipe, peer, outgoing](const tp::Error& error, tp::Descriptor descriptor) {
        if (error) {
          if (outgoing) {
            on_pipe_failed(peer, error.what());
          } else {
            // A caller's pipe closed: it died or stopped. Forks it held are gone with it.
            forget_incoming(pipe);
            if (peer != rank_) {
              completion_->post([this, peer] { rrefs_->on_peer_lost(peer); });
            }
          }
          return;
        }
        MessageHeader header;
        Status status = decode_header(descriptor.metadata, &header);
        std::vector<size_t> payload_lengths;
        std::vector<size_t> tensor_lengths;
        for (const auto& payload : descriptor.payloads) {
          payload_lengths.push_back(payload.length);
        }
        for (const auto& tensor : descriptor.tensors) {
          if (tensor.sourceDevice.type != tp::kCpuDeviceType ||
              (tensor.targetDevice && tensor.targetDevice->type != tp::kCpuDeviceType)) {
            status = "a tensor on a device other than the CPU";
          }
          tensor_lengths.push_back(tensor.length);
        }
        if (!status) {
          status = check_announced_sizes(header, payload_lengths, tensor_lengths, limits_);
        }
        if (status) {
          // The peer broke the protocol: nothing it sends on this pipe can be trusted any more.
          pipe->close();
          if (outgoing) {
            on_pipe_failed(peer, "it sent a malformed message: " + *status);
          }
          return;
        }
        auto body = std::make_shared<std::string>(header.body_length, '\0');
        std::vector<at::Tensor> buffers;
        tp::Allocation allocation;
        allocation.payloads.push_back({body->data()});
        for (size_t length : tensor_lengths) {
          at::Tensor buffer = at::empty({static_cast<int64_t>(length)}, at::kByte);
          allocation.tensors.push_back({tp::CpuBuffer{buffer.data_ptr()}});
          buffers.push_back(std::move(buffer));
        }
        pipe->read(std::move(allocation),
                   [this, pipe, peer, outgoing, header, body, buffers](const tp::Error& error) {
                     if (error) {
                       if (outgoing) {
                         on_pipe_failed(peer, error.what());
                       }
                       return;
                     }
                     read_next(pipe, peer, outgoing);
                     on_message(pipe, peer, outgoing, header, body, buffers);
                   });
      });
}

void Agent::on_message(const std::shared_ptr<tp::Pipe>& pipe, int peer, bool outgoing,
                       MessageHeader header, std::shared_ptr<std::string> body,
                       std::vector<at::Tensor> buffers) {
  if (header.type == MessageType::kHandshake) {
    return;  // The handshake is over; a late copy changes nothing.
  }
  if (header.type == MessageType::kRequest) {
    if (outgoing) {
      return;  // Requests come on the pipes peers open to us, never on ours to them.
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (state_ == State::kStopped) {
        return;
      }
      ++in_flight_requests_;
    }
    // RRef control messages keep their order of arrival (on one thread); they never block.
    Executor& executor = (header.flags & MessageHeader::kOrdered) ? *ordered_ : *request_pool_;
    executor.post([this, pipe, peer, header, body, buffers = std::move(buffers)]() mutable {
      handle_request(pipe, peer, header, *body, std::move(buffers));
      std::lock_guard<std::mutex> lock(mutex_);
      --in_flight_requests_;
      idle_.notify_all();
    });
  } else if (outgoing) {
    completion_->post([this, peer, header, body, buffers = std::move(buffers)]() mutable {
      handle_reply(peer, header, *body, std::move(buffers));
    });
  }
}

void Agent::handle_request(const std::shared_ptr<tp::Pipe>& pipe, int pipe_peer,
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
    } else if (request.caller_id != pipe_peer) {
      failure = "malformed request: caller id " + std::to_string(request.caller_id) +
                " on the connection of worker id " + std::to_string(pipe_peer);
    } else if (ordered != RRefContext::is_control(request.callable)) {
      failure = "'" + request.callable + "' cannot be called " +
                (ordered ? "as an ordered control message" : "by name");
    } else if (ordered) {
      caller = request.caller_id;
      auto result = rrefs_->handle_control(request.callable, std::move(request.args), caller);
      // The reply may wait (a fetch of a value still being created); it is written by whoever
      // completes `result`.
      result->addCallback([this, pipe, id = header.id, caller](c10::ivalue::Future& done) {
        reply(pipe, id, caller, done);
      });
      return;
    } else if (auto function = find_function(request.callable)) {
      caller = request.caller_id;
      for (c10::IValue& arg : request.args) {
        arg = rrefs_->receive(arg);
      }
      auto result = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
      result->markCompleted((*function)(std::move(request.args)));
      reply(pipe, header.id, caller, *result);
      return;
    } else {
      failure = "no function or class is registered as '" + request.callable + "'";
    }
  } catch (...) {
    failure = error_text(std::current_exception());
  }
  // A failed write means the caller is gone; its side reports that.
  write(pipe, encode_error(header.id, *failure, me), [](const std::string&) {});
}

void Agent::reply(const std::shared_ptr<tp::Pipe>& pipe, uint64_t id, int caller,
                  const c10::ivalue::Future& result) {
  EncodedMessage message;
  if (result.hasError()) {
    message = encode_error(id, error_text(result.exception_ptr()), self().name);
  } else {
    ForkBatch forks;
    try {
      message = encode_response(id, rrefs_->prepare_to_send(result.constValue(), caller, &forks));
    } catch (...) {
      rrefs_->rollback(forks);
      message = encode_error(id, error_text(std::current_exception()), self().name);
    }
  }
  write(pipe, std::move(message), [](const std::string&) {});
}

c10::intrusive_ptr<c10::ivalue::Future> Agent::run_locally(const std::string& callable,
                                                           std::vector<c10::IValue> args) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    DISTOPTIM_CHECK_WITH(DistributedError, state_ == State::kRunning,
                         "rpc: the agent is shutting down; cannot run '", callable, "'");
    ++in_flight_requests_;
  }
  request_pool_->post([this, future, callable, args = std::move(args)]() mutable {
    try {
      auto function = find_function(callable);
      TORCH_CHECK_VALUE(function != nullptr, "no function or class is registered as '", callable,
                        "'");
      future->markCompleted((*function)(std::move(args)));
    } catch (...) {
      future->setErrorIfNeeded(
          std::make_exception_ptr(RemoteError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                              self().name, error_text(std::current_exception()))));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    --in_flight_requests_;
    idle_.notify_all();
  });
  return future;
}

void Agent::handle_reply(int peer, const MessageHeader& header, const std::string& body,
                         std::vector<at::Tensor> buffers) {
  PendingCall call;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pending_.find(header.id);
    // Late replies (the call timed out) and replies from a worker the call did not go to are
    // dropped.
    if (it == pending_.end() || it->second.to != peer) {
      return;
    }
    call = std::move(it->second);
    pending_.erase(it);
    if (call.has_deadline) {
      auto range = deadlines_.equal_range(call.deadline);
      for (auto d = range.first; d != range.second; ++d) {
        if (d->second == header.id) {
          deadlines_.erase(d);
          break;
        }
      }
    }
    idle_.notify_all();
  }
  const std::string& worker = workers_[peer].name;
  DecodedMessage reply;
  if (Status error = decode_body(header, body, std::move(buffers), limits_, &reply)) {
    call.future->setError(make_error<DistributedError>("rpc: worker '" + worker +
                                                       "' sent a malformed reply to '" +
                                                       call.function + "': " + *error));
  } else if (header.type == MessageType::kError) {
    call.future->setError(std::make_exception_ptr(RemoteError(
        {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, worker, reply.error_message)));
  } else {
    try {
      call.future->markCompleted(rrefs_->receive(reply.result));
    } catch (...) {
      call.future->setError(make_error<DistributedError>(
          "rpc: worker '" + worker + "' sent an unusable reply to '" + call.function +
          "': " + error_text(std::current_exception())));
    }
  }
}

void Agent::on_pipe_failed(int peer, const std::string& why) {
  std::vector<PendingCall> failed;
  bool stopping = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping = state_ != State::kRunning;
    outgoing_.erase(peer);
    lost_peers_.emplace(peer, why);
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->second.to == peer) {
        if (it->second.has_deadline) {
          auto range = deadlines_.equal_range(it->second.deadline);
          for (auto d = range.first; d != range.second; ++d) {
            if (d->second == it->first) {
              deadlines_.erase(d);
              break;
            }
          }
        }
        failed.push_back(std::move(it->second));
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
    idle_.notify_all();
  }
  if (!stopping) {
    completion_->post([this, peer] { rrefs_->on_peer_lost(peer); });
  }
  const std::string worker = workers_[peer].name;
  fail_calls(std::move(failed), [worker, why, stopping](const PendingCall& call) {
    if (stopping) {
      return make_error<DistributedError>("rpc: the agent shut down before worker '" + worker +
                                          "' answered '" + call.function + "'");
    }
    return make_error<PeerLostError>("rpc: lost the connection to worker '" + worker + "' (" + why +
                                     "); the call to '" + call.function + "' failed");
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

void Agent::write(const std::shared_ptr<tp::Pipe>& pipe, EncodedMessage message,
                  std::function<void(const std::string& error)> on_written) {
  auto holder = std::make_shared<EncodedMessage>(std::move(message));
  tp::Message out;
  out.metadata = holder->header;
  tp::Message::Payload payload;
  payload.data = holder->body.data();
  payload.length = holder->body.size();
  out.payloads.push_back(std::move(payload));
  for (const at::Tensor& tensor : holder->tensors) {
    tp::Message::Tensor entry;
    entry.buffer = tp::CpuBuffer{tensor.data_ptr()};
    entry.length = tensor.nbytes();
    out.tensors.push_back(std::move(entry));
  }
  // `holder` keeps the body and the tensors' memory alive until TensorPipe is done with them.
  pipe->write(std::move(out), [holder, on_written = std::move(on_written)](const tp::Error& error) {
    on_written(error ? error.what() : std::string());
  });
}

Agent::Outgoing& Agent::pipe_to(int peer) {
  auto it = outgoing_.find(peer);
  if (it != outgoing_.end()) {
    return it->second;
  }
  Outgoing& out = outgoing_[peer];
  out.pipe = context_->connect(urls_[peer], tp::PipeOptions().remoteName(workers_[peer].name));
  answer_challenge(out.pipe, peer);
  return out;
}

c10::intrusive_ptr<c10::ivalue::Future> Agent::send(int to, const std::string& function,
                                                    std::vector<c10::IValue> args,
                                                    std::chrono::milliseconds timeout,
                                                    uint16_t flags) {
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
  ForkBatch forks;
  EncodedMessage message;
  try {
    for (c10::IValue& arg : args) {
      arg = rrefs_->prepare_to_send(arg, to, &forks);
    }
    message = encode_request(id, function, args, effective.count(), rank_, flags);
  } catch (...) {
    rrefs_->rollback(forks);
    throw;
  }
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  std::shared_ptr<tp::Pipe> pipe;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (state_ != State::kRunning) {
      lock.unlock();
      rrefs_->rollback(forks);
      DISTOPTIM_CHECK_WITH(DistributedError, false,
                           "rpc: the agent is shutting down; cannot call '", function,
                           "' on worker '", workers_[to].name, "'");
    }
    auto lost = lost_peers_.find(to);
    if (lost != lost_peers_.end()) {
      const std::string why = lost->second;
      lock.unlock();
      rrefs_->rollback(forks);
      future->setError(make_error<PeerLostError>("rpc: lost the connection to worker '" +
                                                 workers_[to].name + "' (" + why +
                                                 "); cannot call '" + function + "'"));
      return future;
    }
    Outgoing& out = pipe_to(to);
    PendingCall call;
    call.future = future;
    call.to = to;
    call.function = function;
    if (effective.count() > 0) {
      call.has_deadline = true;
      call.deadline = std::chrono::steady_clock::now() + effective;
      const bool earliest = deadlines_.empty() || call.deadline < deadlines_.begin()->first;
      deadlines_.emplace(call.deadline, id);
      if (earliest) {
        timer_wake_.notify_one();
      }
    }
    pending_.emplace(id, std::move(call));
    if (!out.ready) {
      out.held.push_back(std::move(message));
      return future;
    }
    pipe = out.pipe;
  }
  write(pipe, std::move(message), [this, id, to](const std::string& error) {
    if (!error.empty()) {
      on_pipe_failed(to, error);
    }
    (void)id;
  });
  return future;
}

void Agent::run_timer() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (state_ != State::kStopped) {
    if (deadlines_.empty()) {
      timer_wake_.wait(lock);
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    // A copy: wait_until reads the deadline again after waking, when the entry may be gone.
    const auto earliest = deadlines_.begin()->first;
    if (now < earliest) {
      timer_wake_.wait_until(lock, earliest);
      continue;
    }
    std::vector<PendingCall> expired;
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      auto it = pending_.find(deadlines_.begin()->second);
      deadlines_.erase(deadlines_.begin());
      if (it != pending_.end()) {
        expired.push_back(std::move(it->second));
        pending_.erase(it);
      }
    }
    idle_.notify_all();
    lock.unlock();
    fail_calls(std::move(expired), [this](const PendingCall& call) {
      return make_error<TimeoutError>("rpc: the call to '" + call.function + "' on worker '" +
                                      workers_[call.to].name + "' timed out");
    });
    lock.lock();
  }
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
  const std::vector<int> missing = comm::wait_for_rank_keys(store, prefix, world_size_, deadline);
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
      rrefs_->release_all_users(std::chrono::steady_clock::now() + options_.shutdown_timeout());
      {
        std::unique_lock<std::mutex> lock(mutex_);
        const bool idle = idle_.wait_for(lock, options_.shutdown_timeout(), [this] {
          return pending_.empty() && in_flight_requests_ == 0;
        });
        DISTOPTIM_CHECK_WITH(TimeoutError, idle, "rpc shutdown: worker '", self().name,
                             "' still had ", pending_.size(), " call(s) and ", in_flight_requests_,
                             " request(s) outstanding after ", options_.shutdown_timeout().count(),
                             " ms");
      }
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
  if (listener_) {
    listener_->close();
  }
  if (context_) {
    context_->close();
    context_->join();  // After this no TensorPipe callback runs any more.
  }
  std::vector<PendingCall> left;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    state_ = State::kStopped;
    for (auto& [id, call] : pending_) {
      left.push_back(std::move(call));
    }
    pending_.clear();
    deadlines_.clear();
    outgoing_.clear();
    incoming_.clear();
    unproven_.clear();
    refused_.clear();
  }
  timer_wake_.notify_all();
  idle_.notify_all();
  // Fail what is left before joining the request pool: a request blocked on a nested call
  // is waiting for exactly these futures.
  fail_calls(std::move(left), [this](const PendingCall& call) {
    return make_error<DistributedError>("rpc: the agent shut down before worker '" +
                                        workers_[call.to].name + "' answered '" + call.function +
                                        "'");
  });
  request_pool_->stop();
  ordered_->stop();
  completion_->stop();
  if (rrefs_) {
    owned_at_stop_ = rrefs_->close();
  }
  if (timer_.joinable()) {
    timer_.join();
  }
  listener_.reset();
  context_.reset();
  rendezvous_.store.reset();
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
