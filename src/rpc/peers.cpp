#include "peers.h"

#include <algorithm>
#include <unordered_set>

#include <asio/post.hpp>
#include <asio/steady_timer.hpp>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace distoptim {
namespace rpc {
namespace detail {

Peers::Peers(const std::string& address, WireLimits limits, size_t receive_budget_bytes,
             std::chrono::milliseconds frame_stall_timeout, bool unix_sockets)
    : limits_(limits),
      stall_timeout_(frame_stall_timeout),
      unix_sockets_(unix_sockets),
      budget_(std::make_shared<ReceiveBudget>(receive_budget_bytes)),
      io_work_(io_.get_executor()),
      stall_check_(io_) {
  listener_ = std::make_shared<Listener>(io_, address, 0, unix_sockets);
  io_loop_ = std::make_unique<IoLoop>(io_, kIoLoopThreads);
}

Peers::~Peers() {
  stop();
  join();
}

void Peers::join() { io_loop_->join(); }

const std::string& Peers::listen_address() const { return listener_->address(); }
int Peers::listen_port() const { return listener_->port(); }

void Peers::start(HandshakeConfig handshake, const WorkerTable& workers, PeerEvents events) {
  handshake_ = std::move(handshake);
  handshake_.admit = [this](const Connection* connection, int caller) {
    return admit_caller(connection, caller);
  };
  handshake_.refuse_id = [&workers](int id) { return workers.refuse_id(id); };
  workers_ = &workers;
  events_ = std::move(events);
  closures_ =
      std::make_unique<RefusalLog>(handshake_.self_name, std::chrono::seconds(10), 5, "closed");
  asio::post(io_, [this] {
    listener_->start([this](std::shared_ptr<Connection> connection) { on_accepted(connection); });
    if (stall_timeout_.count() > 0) check_stalls();
  });
}

std::map<std::string, int64_t> Peers::debug_info() {
  std::vector<std::shared_ptr<Connection>> open;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    open = incoming_;
    for (const auto& [peer, outgoing] : outgoing_) {
      if (outgoing.connection) open.push_back(outgoing.connection);
    }
  }
  int64_t unix_socket = 0;
  int64_t peer_memory = 0;
  int64_t bytes_read = 0;
  int64_t lent_frames = 0;
  int64_t writing = 0;
  for (const auto& connection : open) {
    unix_socket += connection->unix_socket() ? 1 : 0;
    peer_memory += connection->peer_memory_enabled() ? 1 : 0;
    bytes_read += static_cast<int64_t>(connection->peer_memory_bytes_read());
    lent_frames += static_cast<int64_t>(connection->lent_frames());
    writing += connection->writes_done() ? 0 : 1;
  }
  int64_t accepted = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    accepted = static_cast<int64_t>(accepted_.size());
  }
  return {{"connections", static_cast<int64_t>(open.size())},
          {"connections.accepted", accepted},
          {"connections.writing", writing},
          {"peer_memory.lent_frames", lent_frames},
          {"unix_socket.connections", unix_socket},
          {"peer_memory.connections", peer_memory},
          {"peer_memory.bytes_read", bytes_read},
          {"receive_budget.reserved_bytes", static_cast<int64_t>(budget_->reserved())}};
}

void Peers::wait_writes_done(std::chrono::steady_clock::time_point deadline) {
  std::vector<std::shared_ptr<Connection>> open;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    open = incoming_;
    for (const auto& [peer, outgoing] : outgoing_) {
      if (outgoing.connection) open.push_back(outgoing.connection);
    }
  }
  for (const auto& connection : open) {
    while (!connection->writes_done() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
}

std::map<int, std::string> Peers::dead_peers() {
  std::lock_guard<std::mutex> lock(mutex_);
  return dead_;
}

bool Peers::refused_us(int peer) {
  std::lock_guard<std::mutex> lock(mutex_);
  return refused_.count(peer) > 0;
}

std::optional<std::string> Peers::send(int peer, EncodedMessage message) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (stopped_) return std::string("the agent stopped");
  auto lost = lost_.find(peer);
  if (lost != lost_.end()) return lost->second;
  auto [it, created] = outgoing_.try_emplace(peer);
  Outgoing& out = it->second;
  if (out.ready) {
    // Under the lock, so that messages reach the connection in the order they were sent.
    out.connection->send(std::move(message));
  } else {
    out.held.push_back(std::move(message));
  }
  lock.unlock();
  // On the I/O thread, never inline: the caller may hold its own lock, and a failed connect
  // calls back into it (on_peer_lost).
  if (created) asio::post(io_, [this, peer] { connect_to(peer); });
  return std::nullopt;
}

// A message of a call past its deadline is dropped if not yet written, so that a stalled peer
// cannot make a worker hold the arguments of calls that already failed.
void Peers::drop_queued(int peer, uint64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = outgoing_.find(peer);
  if (it == outgoing_.end()) return;
  auto& held = it->second.held;
  const size_t before = held.size();
  held.erase(std::remove_if(held.begin(), held.end(),
                            [&](const EncodedMessage& message) {
                              MessageHeader header;
                              return !decode_header(message.header, &header) && header.id == id;
                            }),
             held.end());
  if (held.size() == before && it->second.connection) it->second.connection->drop_queued(id);
}

void Peers::lose(int peer, const std::string& why) {
  std::shared_ptr<Connection> connection;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = outgoing_.find(peer);
    if (it != outgoing_.end()) {
      connection = std::move(it->second.connection);
      outgoing_.erase(it);
    }
    lost_.emplace(peer, why);
  }
  if (connection) connection->close(why);
  if (events_.on_peer_lost) events_.on_peer_lost(peer, why);
}

// Accepting side: every connection proves itself within the handshake timeout, and at most
// (workers known) + kExtraUnprovenConnections wait at once: a job's workers open one connection
// each and prove themselves within milliseconds, so past that the oldest is a peer that stalls.
void Peers::on_accepted(const std::shared_ptr<Connection>& connection) {
  std::shared_ptr<Connection> evicted;
  std::vector<std::shared_ptr<Connection>> over_limit;
  const std::shared_ptr<const WorkerTable::Snapshot> table = workers_->snapshot();
  const size_t known = table->entries.size();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) {
      connection->close("the agent is stopping");
      return;
    }
    incoming_.push_back(connection);
    unproven_.push_back(connection);
    accepted_.push_back(connection);
    if (unproven_.size() > known + kExtraUnprovenConnections) {
      evicted = std::move(unproven_.front());
      unproven_.pop_front();
    }
    over_limit = over_accepted_locked(*table);
  }
  if (evicted) {
    evicted->close("too many connections waiting to prove themselves; this was the oldest");
  }
  for (const auto& oldest : over_limit) {
    oldest->close("too many connections open or closing; this was the oldest of no known member");
  }
  accept_handshake(connection, handshake_, [this, connection](HandshakeOutcome outcome) {
    if (!outcome.accepted) {
      forget_incoming(connection);
      return;
    }
    if (outcome.peer_memory) connection->enable_peer_memory(outcome.peer_pid);
    on_caller_proven(connection, outcome.peer);
  });
}

// Descriptors are bounded even when each connection is: an attacker who proves an identity that
// is taken is refused, and the refusal lingers up to Connection::kFarewellLinger for the peer to
// read it; in a dynamic group any id up to kMaxDynamicId may be proven. Those, and unproven ones,
// go first, oldest first; a known member's proven connection never.
std::vector<std::shared_ptr<Connection>> Peers::over_accepted_locked(
    const WorkerTable::Snapshot& table) {
  accepted_.erase(std::remove_if(accepted_.begin(), accepted_.end(),
                                 [](const auto& connection) { return connection->closed(); }),
                  accepted_.end());
  std::vector<std::shared_ptr<Connection>> closing;
  size_t open = accepted_.size();
  const size_t limit = max_accepted_connections(table.entries.size());
  if (open <= limit) return closing;
  std::unordered_set<const Connection*> members;
  for (const auto& [caller, connection] : callers_) {
    if (table.find(caller) != nullptr) members.insert(connection);
  }
  for (auto it = accepted_.begin(); open > limit && it != accepted_.end();) {
    if (members.count(it->get()) != 0) {
      ++it;
      continue;
    }
    closing.push_back(std::move(*it));
    it = accepted_.erase(it);
    --open;
  }
  return closing;
}

// Every quarter of frame_stall_timeout: a frame that got no byte during the last four checks
// has stalled for at least frame_stall_timeout (the first of them may come just after its last
// byte), at most 1.25 times it.
void Peers::check_stalls() {
  std::vector<std::shared_ptr<Connection>> open;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) return;
    open = incoming_;
    for (const auto& [peer, outgoing] : outgoing_) {
      if (outgoing.connection) open.push_back(outgoing.connection);
    }
  }
  for (const auto& connection : open) {
    if (connection->frame_stalled(kStallChecks)) {
      const std::string why = "no byte of the frame it was sending arrived for " +
                              std::to_string(stall_timeout_.count()) + " ms (frame_stall_timeout)";
      closures_->refused(connection->peer_address(), why);
      connection->close("it stalled: " + why);
    }
  }
  stall_check_.expires_after(std::max(stall_timeout_ / kStallChecks, std::chrono::milliseconds(1)));
  stall_check_.async_wait([this](const asio::error_code& error) {
    if (!error) check_stalls();
  });
}

void Peers::on_caller_proven(const std::shared_ptr<Connection>& connection, int caller) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    unproven_.erase(std::remove(unproven_.begin(), unproven_.end(), connection), unproven_.end());
  }
  if (events_.on_caller_proven) events_.on_caller_proven(caller);
  connection->set_receive_budget(budget_);
  std::weak_ptr<Connection> weak = connection;
  Connection* raw = connection.get();
  connection->set_farewell([this, raw](const std::string& why) { return farewell(raw, why); });
  connection->read_frames(
      limits_,
      [this, weak, caller](Frame frame) {
        auto self = weak.lock();
        return self && on_request_frame(self, caller, std::move(frame));
      },
      [this, weak, raw, caller](const std::string&) {
        if (auto self = weak.lock()) forget_incoming(self);
        if (release_caller(raw, caller) && caller != handshake_.self_id) {
          events_.on_caller_gone(caller);
        }
      });
}

std::optional<std::string> Peers::admit_caller(const Connection* connection, int caller) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto [it, inserted] = callers_.emplace(caller, connection);
  if (inserted || it->second == connection) return std::nullopt;
  return "worker id " + std::to_string(caller) +
         " already has a live connection to this worker (one identity, one connection)";
}

bool Peers::release_caller(const Connection* connection, int caller) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = callers_.find(caller);
  if (it == callers_.end() || it->second != connection) return false;
  callers_.erase(it);
  return true;
}

void Peers::forget_incoming(const std::shared_ptr<Connection>& connection) {
  std::lock_guard<std::mutex> lock(mutex_);
  incoming_.erase(std::remove(incoming_.begin(), incoming_.end(), connection), incoming_.end());
  unproven_.erase(std::remove(unproven_.begin(), unproven_.end(), connection), unproven_.end());
  // A closed connection gives its place back at once (one refused in the handshake stays
  // counted while its farewell lingers, until it closes or the next accept finds it closed).
  if (connection->closed()) {
    accepted_.erase(std::remove(accepted_.begin(), accepted_.end(), connection), accepted_.end());
  }
}

// Connecting side. Messages sent meanwhile wait in `held`.
void Peers::connect_to(int peer) {
  const std::shared_ptr<const WorkerTable::Snapshot> table = workers_->snapshot();
  const WorkerTable::Entry* entry = table->find(peer);
  if (entry == nullptr) {
    on_outgoing_lost(peer, nullptr, "no worker has id " + std::to_string(peer), /*refused=*/true);
    return;
  }
  // Not even a connection to an address whose worker published no key this worker takes (its
  // record is not sealed with the job's secret): the address may be anyone's.
  handshake_.member_key(peer, [this, peer, host = entry->host, port = entry->port](
                                  std::optional<std::string> key, const std::string& why) {
    if (!key) {
      on_outgoing_lost(peer, nullptr,
                       "worker id " + std::to_string(peer) + " has no member key here: " + why,
                       /*refused=*/true);
      return;
    }
    open_connection(peer, host, port);
  });
}

void Peers::open_connection(int peer, const std::string& host, int port) {
  bool via_unix = false;
  if (unix_sockets_) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = outgoing_.find(peer);
    via_unix = it != outgoing_.end() && !it->second.tcp_only;
  }
  connect(io_, host, port, via_unix,
          [this, peer, via_unix](std::shared_ptr<Connection> connection, const std::string& error) {
            if (!connection && via_unix) {
              // Nothing listens on the name here: the peer is on another host (or does not
              // listen on one); TCP it is, for this peer from now on.
              {
                std::lock_guard<std::mutex> lock(mutex_);
                auto it = outgoing_.find(peer);
                if (it != outgoing_.end()) it->second.tcp_only = true;
              }
              connect_to(peer);
              return;
            }
            if (!connection) {
              on_outgoing_lost(peer, nullptr, "cannot connect: " + error, /*refused=*/false);
              return;
            }
            {
              std::lock_guard<std::mutex> lock(mutex_);
              auto it = outgoing_.find(peer);
              if (stopped_ || it == outgoing_.end()) {
                connection->close("the agent is stopping");
                return;
              }
              it->second.connection = connection;
            }
            connect_handshake(connection, handshake_, peer,
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

// The handshake succeeded: read replies, then write the messages sent meanwhile, in order, and
// let new ones be written directly.
void Peers::on_connected(int peer, const std::shared_ptr<Connection>& connection) {
  connection->set_receive_budget(budget_);
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
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = outgoing_.find(peer);
  if (it == outgoing_.end() || it->second.connection != connection) {
    return;  // Lost meanwhile; its messages were dropped with it.
  }
  std::vector<EncodedMessage> held;
  held.swap(it->second.held);
  it->second.ready = true;
  // Sent while the lock is held: a message sent now queues behind these on the connection.
  for (EncodedMessage& message : held) {
    connection->send(std::move(message));
  }
}

// A connection to `peer` failed. Before its handshake ended, a lost connection is tried again a
// few times (the messages wait in `held`); a refusal, or a loss after the handshake, loses the
// peer. A peer lost other than by refusal counts as dead (graceful shutdown does not wait for it).
void Peers::on_outgoing_lost(int peer, const std::shared_ptr<Connection>& connection,
                             const std::string& why, bool refused) {
  std::string reason = why;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = outgoing_.find(peer);
    if (it == outgoing_.end() || (connection && it->second.connection != connection)) {
      return;
    }
    if (!stopped_ && !it->second.ready && connection && connection->unix_socket()) {
      // Whoever holds the peer's Unix name did not prove itself the peer (or the peer refused
      // us there): try its published TCP address, which only the peer can hold. A real refusal
      // comes again there.
      it->second.tcp_only = true;
      it->second.connection = nullptr;
      it->second.farewell.clear();
      asio::post(io_, [this, peer] { connect_to(peer); });
      return;
    }
    if (!it->second.farewell.empty()) {
      reason = it->second.farewell;
    }
    if (!stopped_ && !refused && !it->second.ready && ++it->second.attempts < kConnectAttempts) {
      it->second.connection = nullptr;
      auto timer = std::make_shared<asio::steady_timer>(io_, kReconnectDelay * it->second.attempts);
      timer->async_wait([this, peer, timer](const asio::error_code& error) {
        if (!error) connect_to(peer);
      });
      return;
    }
    if (refused) {
      refused_.insert(peer);
    } else {
      dead_.emplace(peer, reason);
    }
  }
  lose(peer, reason);
}

bool Peers::on_request_frame(const std::shared_ptr<Connection>& connection, int caller,
                             Frame frame) {
  if (frame.header.type == MessageType::kError && frame.header.id == 0) {
    log_farewell(frame);  // The caller closes its connection and says why.
    return true;
  }
  if (frame.header.type != MessageType::kRequest) {
    protocol_error(connection, "a message other than a request on its own connection");
    return false;
  }
  return events_.on_request(connection, caller, std::move(frame));
}

bool Peers::on_reply_frame(const std::shared_ptr<Connection>& connection, int peer, Frame frame) {
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
  events_.on_reply(peer, std::move(frame));
  return true;
}

// Closes a connection whose peer broke the protocol, telling the peer why first, so that both
// sides say what happened.
void Peers::protocol_error(const std::shared_ptr<Connection>& connection, const std::string& why) {
  connection->close_after(farewell(connection.get(), "it sent " + why), why);
}

std::string Peers::log_farewell(const Frame& frame) {
  DecodedMessage farewell;
  std::string why = "the peer closed the connection without saying why";
  if (!decode_body(frame.header, *frame.body, {}, limits_, &farewell)) {
    why = farewell.error_message;
  }
  TORCH_WARN("rpc: worker '", handshake_.self_name, "' was told: ", why);
  return why;
}

EncodedMessage Peers::farewell(Connection* connection, const std::string& why) {
  closures_->refused(connection->peer_address(), why);
  return encode_error(0,
                      "worker '" + handshake_.self_name + "' closed the connection with " +
                          connection->peer_address() + ": " + why,
                      handshake_.self_name);
}

void Peers::run_on_loop(std::function<void()> handler) { asio::post(io_, std::move(handler)); }

void Peers::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) return;
    stopped_ = true;
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
    stall_check_.cancel();
    listener_->close();
  });
  // Handlers run in the order they were posted: the connections are closed before the loop
  // stops, and whatever the closing queued (cancelled reads, writes, timers) is dropped with it.
  asio::post(io_, [this] { io_.stop(); });
  io_work_.reset();
  io_loop_->wait_stopped();
  std::lock_guard<std::mutex> lock(mutex_);
  outgoing_.clear();
  incoming_.clear();
  unproven_.clear();
  accepted_.clear();
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
