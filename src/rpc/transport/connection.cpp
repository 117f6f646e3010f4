// A Connection's lifecycle (connection.h): how it is made, its deadline, and how it ends, at once
// (fail) or after a farewell (close_after), as the one state machine that enter() moves.

#include "connection.h"

#include "peer_user.h"

#include <sys/socket.h>

#include <asio/dispatch.hpp>

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

std::string endpoint_text(const asio::ip::tcp::endpoint& endpoint) {
  const asio::ip::address address = endpoint.address();
  return (address.is_v6() ? "[" + address.to_string() + "]" : address.to_string()) + ":" +
         std::to_string(endpoint.port());
}

// The peer of a TCP socket as "ip:port", with Nagle's delay off (set before the socket is held
// as a generic one, whose options know no protocol).
std::string prepare_tcp(asio::ip::tcp::socket& socket) {
  asio::error_code ignored;
  socket.set_option(asio::ip::tcp::no_delay(true), ignored);
  const auto remote = socket.remote_endpoint(ignored);
  return ignored ? std::string("an unknown address") : endpoint_text(remote);
}

// The peer of a Unix-domain socket: the listener's name, or the accepted process's id (the
// kernel's word, SO_PEERCRED).
std::string unix_peer_text(asio::local::stream_protocol::socket& socket,
                           const std::string& unix_name) {
  if (!unix_name.empty()) return "the Unix socket '@" + unix_name.substr(1) + "'";
  ucred credentials{};
  socklen_t size = sizeof(credentials);
  if (::getsockopt(socket.native_handle(), SOL_SOCKET, SO_PEERCRED, &credentials, &size) == 0) {
    return "process " + std::to_string(credentials.pid) + " on this host (Unix socket)";
  }
  return "a process on this host (Unix socket)";
}

}  // namespace

Connection::Connection(asio::io_context& io, asio::ip::tcp::socket socket)
    : io_(io), socket_(io), unix_socket_(false), deadline_(io), lending_(io) {
  peer_address_ = prepare_tcp(socket);
  socket_ = asio::generic::stream_protocol::socket(std::move(socket));
}

Connection::Connection(asio::io_context& io, asio::local::stream_protocol::socket socket,
                       const std::string& unix_name)
    : io_(io), socket_(io), unix_socket_(true), deadline_(io), lending_(io) {
  peer_address_ = unix_peer_text(socket, unix_name);
  socket_ = asio::generic::stream_protocol::socket(std::move(socket));
}

Connection::~Connection() = default;

std::optional<uint32_t> Connection::peer_user() {
  return detail::peer_user(socket_.native_handle());
}

std::string Connection::error_text(const asio::error_code& error) {
  return error == asio::error::eof ? std::string("end of file") : error.message();
}

// The one place the lifecycle moves, always forward (its callers check the state it leaves).
// kClosed is stored under write_mutex_: a send() that found the connection open has queued or
// written its frame before fail() takes the queue and closes the socket, and no send() after it
// touches the socket.
void Connection::enter(State next) {
  TORCH_INTERNAL_ASSERT(next > state(), "a connection's state moves forward only");
  if (next == State::kClosed) {
    std::lock_guard<std::mutex> lock(write_mutex_);
    state_.store(next, std::memory_order_release);
    return;
  }
  state_.store(next, std::memory_order_release);
}

void Connection::arm_deadline(std::chrono::milliseconds timeout, std::string why) {
  deadline_.expires_after(timeout);
  deadline_.async_wait([weak = weak_from_this(), generation = ++deadline_generation_,
                        why = std::move(why)](const asio::error_code& error) {
    if (auto self = weak.lock(); self && !error && generation == self->deadline_generation_) {
      self->fail(why);
    }
  });
}

void Connection::disarm_deadline() {
  ++deadline_generation_;
  deadline_.cancel();
}

void Connection::enable_peer_memory(int32_t peer_pid) {
  lending_.enable(peer_pid);
  limits_.peer_memory = true;
}

void Connection::set_farewell(FarewellMaker make_farewell) {
  make_farewell_ = std::move(make_farewell);
}

void Connection::violation(const std::string& why) {
  if (make_farewell_ && state() != State::kClosingAfterFarewell) {
    close_after(make_farewell_(why), why);
  } else {
    fail(why);
  }
}

void Connection::close(const std::string& why) {
  asio::dispatch(io_, [self = shared_from_this(), why] { self->fail(why); });
}

void Connection::close_after(EncodedMessage farewell, const std::string& why,
                             std::chrono::milliseconds linger) {
  asio::dispatch(io_, [self = shared_from_this(), farewell = std::move(farewell), why,
                       linger]() mutable { self->say_farewell(std::move(farewell), why, linger); });
}

// Once the farewell is written our side of the stream ends, and the connection closes when the
// peer closes its side (so the farewell is not lost to a reset) or after `linger`. The steps run
// in this order because the last one reads again, and a read can complete at once from the inbox
// (read_then), frames, violations and all: every earlier step must hold by then.
void Connection::say_farewell(EncodedMessage farewell, const std::string& why,
                              std::chrono::milliseconds linger) {
  // First: the first farewell stands, and a closed connection says none.
  if (state() != State::kOpen) {
    return;
  }
  // Before reading again: frames read from now on are dropped, and a bad one closes at once
  // instead of starting a second farewell (violation).
  enter(State::kClosingAfterFarewell);
  // Before reading again: what is read next, the inbox included, is checked against these.
  limit_reads_to_small_frames();
  // Before reading again, as fail() cancels the deadline: armed after a read that failed at
  // once, it would wait on a closed connection.
  arm_deadline(linger, why);
  // Before the write starts: it is the farewell that this write (or the outstanding one's
  // successor) carries, ahead of what was queued.
  queue_farewell(std::move(farewell));
  // Before reading again: whatever closes the connection from here (the peer, the linger, a bad
  // frame) reports `why`, the reason the peer was told.
  report_closed_as(why);
  // After the farewell is queued; when a write is outstanding, its end starts this one.
  write_next();
  // Last: reads the peer's close (and its releases of what it was lent) with all the above in
  // place.
  read_until_peer_closes();
}

// What the peer still sends is read only to be dropped: small frames, and its releases of what
// it was lent, which free this side's memory.
void Connection::limit_reads_to_small_frames() {
  limits_ = handshake_limits();
  limits_.handshake_only = false;
  limits_.peer_memory = lending_.peer_lends();
}

// Nothing queued goes out before the farewell, except a frame already partly written (the stream
// must not end mid-frame). Once the farewell is written, our side of the stream ends.
void Connection::queue_farewell(EncodedMessage farewell) {
  Outgoing out{std::move(farewell), {}, [weak = weak_from_this()](const std::string&) {
                 if (auto self = weak.lock()) {
                   asio::error_code ignored;
                   self->socket_.shutdown(asio::socket_base::shutdown_send, ignored);
                 }
               }};
  out.lengths = encode_tensor_lengths(out.message.tensors);  // nothing lent: no tensors
  std::lock_guard<std::mutex> lock(write_mutex_);
  auto first_unwritten = queue_.begin();
  if (first_unwritten != queue_.end() && first_unwritten->written > 0) ++first_unwritten;
  queue_.erase(first_unwritten, queue_.end());
  queue_.push_back(std::move(out));
}

void Connection::report_closed_as(const std::string& why) {
  on_closed_ = [on_closed = std::move(on_closed_), why](const std::string&) {
    if (on_closed) on_closed(why);
  };
}

// Reads even when the frame handler had paused reading: the peer's end of file closes the
// connection as soon as the peer has read the farewell.
void Connection::read_until_peer_closes() {
  if (!reading_) {
    paused_ = false;
    read_header();
  }
}

void Connection::fail(const std::string& why) {
  if (state() == State::kClosed) {
    return;
  }
  // First: from here on no send() queues or writes, and no read goes on.
  enter(State::kClosed);
  std::deque<Outgoing> unsent = take_unsent();
  asio::error_code ignored;
  deadline_.cancel();
  socket_.shutdown(asio::socket_base::shutdown_both, ignored);
  socket_.close(ignored);
  lending_.release_all_after_grace();
  waiting_for_budget_ = false;
  // What a frame still being received holds goes with its reservation, at once: the connection
  // object may outlive its close a while (listed, or held by a handler), and a peer that
  // announces large frames and closes must not pin more than the budget. The socket is closed,
  // so no read writes into these buffers any more.
  frame_ = Frame();
  in_frame_ = false;
  release_reservation();
  inbox_.reset();
  inbox_begin_ = inbox_end_ = 0;
  targets_ = {};
  lengths_ = {};
  length_bytes_ = {};
  for (Outgoing& out : unsent) {
    if (out.on_written) out.on_written(why);
  }
  // Dropping the handlers also drops whatever they hold (often this connection).
  on_frame_ = nullptr;
  make_farewell_ = nullptr;
  ClosedHandler on_closed = std::move(on_closed_);
  on_closed_ = nullptr;
  if (on_closed) {
    on_closed(why);
  }
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
