// The agent's connections (agent.h): accepting callers and running their handshake, connecting
// to peers (tried again while a connection is lost before its handshake ends), reading their
// frames, the inbound bound (backpressure) and protocol errors. Calls, requests and replies are
// in agent.cpp.

#include "agent.h"

#include <algorithm>

#include <asio/steady_timer.hpp>

#include <ATen/ATen.h>

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

// Accepted connections whose peer has not proven itself yet, beyond one per worker of the job:
// past that many, the oldest is closed (see Agent::on_accepted).
constexpr size_t kExtraUnprovenConnections = 64;
// Connection attempts to a peer whose connection is lost before its handshake ends (the peer's
// listener was busy, or it evicted us among stalled connections) before the peer counts as lost.
constexpr int kConnectAttempts = 5;
constexpr std::chrono::milliseconds kReconnectDelay{100};
// How long a connection closed for a protocol error waits for the peer to read why.
constexpr std::chrono::milliseconds kFarewellLinger{1000};

size_t frame_bytes(const Frame& frame) {
  size_t bytes = frame.body->size();
  for (const at::Tensor& buffer : frame.buffers) bytes += buffer.nbytes();
  return bytes;
}

}  // namespace

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
    if (outcome.peer_memory) connection->enable_peer_memory(outcome.peer_pid);
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
          ordered_->post([this, caller] { on_peer_gone(caller); });
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
                                  if (outcome.peer_memory) {
                                    connection->enable_peer_memory(outcome.peer_pid);
                                  }
                                  on_connected(peer, connection);
                                } else {
                                  on_outgoing_lost(peer, connection, outcome.why, outcome.refused);
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
  Executor& executor = (frame.header.flags & MessageHeader::kOrdered) ? *ordered_ : *request_pool_;
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
  // A reply to a caller that only waits completes its future here, when that cannot overtake a
  // reply still queued for the completion thread: one thread hand-off (tens of microseconds on a
  // virtual machine) fewer per blocking call. Every other reply goes to the completion thread,
  // where the future's callbacks may run.
  if (pending_->waited_only(header.id, peer) && completion_->quiescent()) {
    handle_reply(peer, frame.header, *frame.body, std::move(frame.buffers));
    return true;
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

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
