#include "connection.h"

#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include <asio/connect.hpp>
#include <asio/dispatch.hpp>
#include <asio/post.hpp>
#include <asio/read.hpp>
#include <asio/write.hpp>

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>

#include "peer_memory.h"

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

// Messages gathered into one write: enough to batch a burst, few enough that one slow write
// does not delay the completion of many.
constexpr size_t kMaxMessagesPerWrite = 64;
// Pieces of a frame a direct write sends in one sendmsg (a frame with more tensors is queued).
constexpr size_t kMaxDirectPieces = 64;
// How long tensors lent to a peer stay alive after their connection closed: the peer may be
// reading them at that moment, and must not read memory already reused.
constexpr std::chrono::seconds kLentGrace{10};

std::string describe(const asio::error_code& error) {
  return error == asio::error::eof ? std::string("end of file") : error.message();
}

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
    : io_(io), socket_(io), unix_socket_(false), deadline_(io) {
  peer_address_ = prepare_tcp(socket);
  socket_ = asio::generic::stream_protocol::socket(std::move(socket));
}

Connection::Connection(asio::io_context& io, asio::local::stream_protocol::socket socket,
                       const std::string& unix_name)
    : io_(io), socket_(io), unix_socket_(true), deadline_(io) {
  peer_address_ = unix_peer_text(socket, unix_name);
  socket_ = asio::generic::stream_protocol::socket(std::move(socket));
}

Connection::~Connection() = default;

void Connection::read_frames(const WireLimits& limits, FrameHandler on_frame,
                             ClosedHandler on_closed) {
  limits_ = limits;
  limits_.peer_memory = peer_pid_ > 0;
  on_frame_ = std::make_shared<FrameHandler>(std::move(on_frame));
  on_closed_ = std::move(on_closed);
  paused_ = false;
  if (!closed_ && !reading_) {
    read_header();
  }
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

// Reads exactly `targets_` (its caller fills them), then runs `next` unless the connection failed
// or closed meanwhile. Bytes come from the inbox first (what an earlier read got beyond the field
// it wanted); a rest that is small is read into the inbox, with one system call for a small frame's
// header, lengths and body (and often the next frame's), a large one straight into its targets.
// What the inbox satisfies runs `next` at once, unless this runs inside the frame handler (a
// handler calling read_frames must not see the next frame re-entrantly) or kMaxInlineReads fields
// deep: then posted.
void Connection::read_then(std::function<void()> next) {
  size_t left = 0;
  size_t kept = 0;  // targets still (partly) unfilled, moved to the front
  for (asio::mutable_buffer target : targets_) {
    const size_t take = std::min(target.size(), inbox_end_ - inbox_begin_);
    if (take > 0) {
      std::memcpy(target.data(), inbox_.get() + inbox_begin_, take);
      inbox_begin_ += take;
      target += take;
    }
    if (target.size() > 0) {
      targets_[kept++] = target;
      left += target.size();
    }
  }
  targets_.resize(kept);
  if (left == 0) {
    if (delivering_ || inline_depth_ >= kMaxInlineReads) {
      reading_ = true;
      asio::post(io_, [self = shared_from_this(), next = std::move(next)] {
        self->reading_ = false;
        if (!self->closed_) next();
      });
      return;
    }
    ++inline_depth_;
    next();
    --inline_depth_;
    return;
  }
  reading_ = true;
  if (left <= kInboxBytes / 2) {
    if (!inbox_) inbox_ = std::make_unique<char[]>(kInboxBytes);
    socket_.async_read_some(asio::buffer(inbox_.get(), kInboxBytes),
                            [self = shared_from_this(), next = std::move(next)](
                                const asio::error_code& error, size_t received) mutable {
                              if (self->read_ended(error)) return;
                              ++self->progress_;
                              self->inbox_begin_ = 0;
                              self->inbox_end_ = received;
                              self->read_then(std::move(next));
                            });
    return;
  }
  asio::async_read(
      socket_, targets_,
      // transfer_all's rule, counting each read that brought bytes for the stall check.
      [this](const asio::error_code& error, size_t transferred) -> size_t {
        if (transferred > 0) ++progress_;
        return error ? 0 : asio::detail::default_max_transfer_size;
      },
      [self = shared_from_this(), next = std::move(next)](const asio::error_code& error, size_t) {
        if (!self->read_ended(error)) next();
      });
}

// A read completed: whether the connection closed meanwhile or the read failed (then it fails).
bool Connection::read_ended(const asio::error_code& error) {
  reading_ = false;
  if (closed_) {
    return true;
  }
  if (error) {
    fail(describe(error));
    return true;
  }
  return false;
}

void Connection::read_header() {
  if (lengths_.capacity() > kKeptTensorLengths) {
    // A frame of many tensors does not leave its lists that large for the frames after it.
    lengths_ = {};
    targets_ = {};
  }
  targets_.assign(1, asio::buffer(header_bytes_));
  read_then([this] { on_header(); });
}

void Connection::on_header() {
  MessageHeader header;
  Status status = decode_header(std::string_view(header_bytes_, sizeof(header_bytes_)), &header);
  if (!status) {
    status = check_header(header, limits_);
  }
  if (status) {
    violation("it sent " + *status);
    return;
  }
  if (header.type == MessageType::kRelease) {
    // The peer has read the tensors of the oldest frame that lent some: they may go.
    std::vector<at::Tensor> released;
    {
      std::lock_guard<std::mutex> lock(write_mutex_);
      if (!lent_.empty()) {
        released = std::move(lent_.front().second);
        lent_.pop_front();
      }
    }
    if (released.empty()) {
      violation("it sent a release of memory it had not been lent");
    } else {
      read_header();
    }
    return;
  }
  frame_.header = header;
  in_frame_ = true;
  ++progress_;
  length_bytes_.assign(size_t{header.tensor_count} * 8, '\0');
  if (length_bytes_.empty()) {
    read_payload();
  } else {
    targets_.assign(1, asio::buffer(length_bytes_));
    read_then([this] { read_payload(); });
  }
}

// Allocates exactly what the (checked) header and lengths announce, and reads into it: the body
// into a string, each tensor into its own byte tensor, which the decoder then views as typed.
// A tensor left in the peer's memory is read from there (read_from_peer_memory): the stream
// carries its 8-byte address.
void Connection::read_payload() {
  if (Status status = decode_tensor_lengths(frame_.header, length_bytes_, limits_, &lengths_,
                                            &in_peer_memory_)) {
    violation("it sent " + *status);
    return;
  }
  size_t announced = frame_.header.body_length;
  for (size_t length : lengths_) announced += length;
  if (budget_ && !closing_ && reserved_ == 0) {
    if (announced > ReceiveBudget::kUnreservedBytes) {
      if (!budget_->reserve(announced, shared_from_this())) {
        waiting_for_budget_ = true;  // retry_reservation() reads it later
        return;
      }
      reserved_ = announced;
    }
  }
  std::string failure;
  try {
    frame_.body = std::make_shared<std::string>(frame_.header.body_length, '\0');
    frame_.buffers.clear();
    targets_.clear();
    peer_addresses_.assign(lengths_.size() * 8, '\0');
    targets_.reserve(lengths_.size() + 1);
    targets_.push_back(asio::buffer(*frame_.body));
    for (size_t i = 0; i < lengths_.size(); ++i) {
      // Allocated without the dispatcher (at::empty's dispatch costs more than the allocation).
      at::Tensor buffer(at::detail::empty_cpu({static_cast<int64_t>(lengths_[i])}, at::kByte));
      if (in_peer_memory_[i]) {
        targets_.push_back(asio::buffer(&peer_addresses_[i * 8], 8));
      } else if (lengths_[i] > 0) {
        targets_.push_back(asio::buffer(buffer.data_ptr(), lengths_[i]));
      }
      frame_.buffers.push_back(std::move(buffer));
    }
  } catch (const c10::Error& error) {
    failure = error.what_without_backtrace();
  } catch (const std::exception& error) {
    failure = error.what();
  }
  if (!failure.empty()) {
    // The limits admit frames larger than some machines' memory: such a frame closes its
    // connection, not the worker (an exception would end the I/O thread).
    frame_ = Frame();
    release_reservation();
    violation("it announced a frame of " + std::to_string(announced) +
              " bytes, which this worker cannot allocate (" + failure + ")");
    return;
  }
  read_then([this] { deliver_frame(); });
}

// Reads the frame's tensors that lie in the peer's memory, then tells the peer it may free
// them. False (the connection closing) if the peer's memory does not hold what it announced.
bool Connection::read_from_peer_memory() {
  bool any = false;
  for (size_t i = 0; i < in_peer_memory_.size(); ++i) {
    if (!in_peer_memory_[i]) continue;
    any = true;
    const uint64_t address = get_le(peer_addresses_, i * 8, 8);
    at::Tensor& buffer = frame_.buffers[i];
    if (Status error = read_peer_memory(peer_pid_, address, buffer.data_ptr(), buffer.nbytes())) {
      violation("it announced tensor " + std::to_string(i) + " in its memory, and there are " +
                *error);
      return false;
    }
    peer_memory_bytes_read_ += buffer.nbytes();
  }
  if (any) {
    MessageHeader release;
    release.type = MessageType::kRelease;
    send(EncodedMessage{encode_header(release), {}, {}});
  }
  return true;
}

void Connection::deliver_frame() {
  if (!closing_ && !read_from_peer_memory()) {
    return;
  }
  // The frame is whole: from here on it counts against the inbound queue (Dispatcher), if any.
  in_frame_ = false;
  release_reservation();
  Frame frame = std::move(frame_);
  frame_ = Frame();
  if (closing_) {  // close_after: nothing more is handed on
    read_header();
    return;
  }
  // A copy of the handler: it may replace itself (read_frames) while it runs.
  std::shared_ptr<FrameHandler> handler = on_frame_;
  delivering_ = true;
  resume_requested_ = false;
  const bool go_on = handler && *handler && (*handler)(std::move(frame));
  delivering_ = false;
  // Closed, or reading again (the handler called read_frames).
  if (closed_ || reading_) {
    return;
  }
  if (go_on || resume_requested_) {
    read_header();
  } else {
    paused_ = true;
  }
}

void Connection::set_receive_budget(std::shared_ptr<ReceiveBudget> budget) {
  budget_ = std::move(budget);
}

void Connection::release_reservation() {
  if (reserved_ > 0) {
    const size_t bytes = reserved_;
    reserved_ = 0;
    budget_->release(bytes);
  }
}

void Connection::retry_reservation() {
  asio::post(io_, [self = shared_from_this()] {
    if (self->waiting_for_budget_ && !self->closed_) {
      self->waiting_for_budget_ = false;
      self->read_payload();
    }
  });
}

bool Connection::frame_stalled(int checks) {
  if (!budget_ || !in_frame_ || waiting_for_budget_ || closed_ || closing_) {
    stalled_checks_ = 0;
    return false;
  }
  if (progress_ != progress_checked_) {
    progress_checked_ = progress_;
    stalled_checks_ = 0;
    return false;
  }
  return ++stalled_checks_ >= checks;
}

void Connection::resume_reading() {
  asio::dispatch(io_, [self = shared_from_this()] {
    if (self->delivering_) {
      // Run at once from inside the handler (dispatch): the pause it may still return is undone.
      self->resume_requested_ = true;
      return;
    }
    if (self->paused_ && !self->closed_ && !self->reading_) {
      self->paused_ = false;
      self->read_header();
    }
  });
}

template <class Add>
void Connection::for_each_piece(const Outgoing& out, Add add) {
  size_t skip = out.written;
  auto piece = [&](const void* data, size_t size) {
    if (skip >= size) {
      skip -= size;
      return;
    }
    add(static_cast<const char*>(data) + skip, size - skip);
    skip = 0;
  };
  piece(out.message.header.data(), out.message.header.size());
  piece(out.lengths.data(), out.lengths.size());
  piece(out.message.body.data(), out.message.body.size());
  for (size_t i = 0; i < out.message.tensors.size(); ++i) {
    const at::Tensor& tensor = out.message.tensors[i];
    if (!out.in_memory.empty() && out.in_memory[i]) {
      piece(&out.addresses[i * 8], 8);
    } else if (tensor.nbytes() > 0) {
      piece(tensor.data_ptr(), tensor.nbytes());
    }
  }
}

void Connection::enable_peer_memory(int32_t peer_pid) {
  peer_pid_ = peer_pid;
  limits_.peer_memory = true;
  peer_memory_enabled_ = true;
  std::lock_guard<std::mutex> lock(write_mutex_);
  lend_ = true;
}

void Connection::prepare_locked(Outgoing& out) {
  const std::vector<at::Tensor>& tensors = out.message.tensors;
  std::vector<at::Tensor> lent;
  if (lend_) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].nbytes() < kPeerMemoryBytes) continue;
      if (out.in_memory.empty()) {
        out.in_memory.assign(tensors.size(), false);
        out.addresses.assign(tensors.size() * 8, '\0');
      }
      out.in_memory[i] = true;
      std::string address;
      put_le(&address, reinterpret_cast<uintptr_t>(tensors[i].data_ptr()), 8);
      out.addresses.replace(i * 8, 8, address);
      lent.push_back(tensors[i]);
    }
  }
  out.lengths = encode_tensor_lengths(tensors, out.in_memory);
  if (!lent.empty()) {
    // In the order the frames go out: the peer releases them in the order it reads them.
    out.lent = ++lent_count_;
    lent_.emplace_back(out.lent, std::move(lent));
  }
}

// The connection closed: what the peer was lent stays alive a while longer, in case it is
// reading it right now.
void Connection::release_lent() {
  std::deque<std::pair<uint64_t, std::vector<at::Tensor>>> lent;
  {
    std::lock_guard<std::mutex> lock(write_mutex_);
    lent.swap(lent_);
  }
  if (lent.empty()) return;
  auto timer = std::make_shared<asio::steady_timer>(io_, kLentGrace);
  timer->async_wait([timer, lent = std::move(lent)](const asio::error_code&) {});
}

bool Connection::write_directly(Outgoing& out) {
  iovec pieces[kMaxDirectPieces];
  size_t count = 0;
  bool fits = true;
  size_t total = 0;
  for_each_piece(out, [&](const char* data, size_t size) {
    if (count == kMaxDirectPieces) {
      fits = false;
      return;
    }
    pieces[count].iov_base = const_cast<char*>(data);
    pieces[count].iov_len = size;
    ++count;
    total += size;
  });
  if (!fits) {
    return false;
  }
  msghdr message{};
  message.msg_iov = pieces;
  message.msg_iovlen = count;
  // Never blocks, never raises SIGPIPE; a full socket or an error leaves the rest (or all) to the
  // I/O thread's write, which waits for room or meets the error and closes the connection.
  const ssize_t sent = ::sendmsg(socket_.native_handle(), &message, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (sent <= 0) {
    return false;
  }
  out.written += static_cast<size_t>(sent);
  return static_cast<size_t>(sent) == total;
}

void Connection::send(EncodedMessage message, WrittenHandler on_written) {
  Outgoing out{std::move(message), {}, std::move(on_written)};
  std::unique_lock<std::mutex> lock(write_mutex_);
  if (write_closed_) {
    lock.unlock();
    if (out.on_written) {
      asio::dispatch(io_, [on_written = std::move(out.on_written)] {
        on_written("the connection is closed");
      });
    }
    return;
  }
  prepare_locked(out);
  const bool idle = !writing_ && queue_.empty();
  if (idle && !out.on_written && write_directly(out)) {
    return;
  }
  queue_.push_back(std::move(out));
  lock.unlock();
  if (idle) {
    asio::dispatch(io_, [self = shared_from_this()] { self->write_next(); });
  }
}

void Connection::drop_queued(uint64_t id) {
  std::lock_guard<std::mutex> lock(write_mutex_);
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    MessageHeader header;
    // A frame partly written stays: the stream must not end mid-frame.
    if (it->written == 0 && !decode_header(it->message.header, &header) && header.id == id) {
      if (it->lent != 0) {
        const uint64_t lent = it->lent;
        auto entry = std::find_if(lent_.begin(), lent_.end(),
                                  [lent](const auto& held) { return held.first == lent; });
        if (entry != lent_.end()) lent_.erase(entry);
      }
      queue_.erase(it);
      return;
    }
  }
}

// One gathered write at a time, of up to kMaxMessagesPerWrite queued messages in order. The
// tensors' memory is written where it lies; `in_flight_` keeps it alive meanwhile.
void Connection::write_next() {
  std::lock_guard<std::mutex> lock(write_mutex_);
  if (writing_ || write_closed_) {
    return;
  }
  in_flight_.clear();
  while (!queue_.empty() && in_flight_.size() < kMaxMessagesPerWrite) {
    in_flight_.push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
  if (in_flight_.empty()) {
    return;
  }
  std::vector<asio::const_buffer> buffers;
  for (const Outgoing& out : in_flight_) {
    for_each_piece(
        out, [&](const char* data, size_t size) { buffers.push_back(asio::buffer(data, size)); });
  }
  writing_ = true;
  asio::async_write(socket_, buffers,
                    [self = shared_from_this()](const asio::error_code& error, size_t) {
                      std::vector<Outgoing> done;
                      {
                        std::lock_guard<std::mutex> lock(self->write_mutex_);
                        self->writing_ = false;
                        done = std::move(self->in_flight_);
                        self->in_flight_.clear();
                      }
                      const std::string why = error ? describe(error) : std::string();
                      for (Outgoing& out : done) {
                        if (out.on_written) out.on_written(why);
                      }
                      if (error) {
                        self->fail(why);
                      } else {
                        self->write_next();
                      }
                    });
}

void Connection::close(const std::string& why) {
  asio::dispatch(io_, [self = shared_from_this(), why] { self->fail(why); });
}

void Connection::close_after(EncodedMessage farewell, const std::string& why,
                             std::chrono::milliseconds linger) {
  asio::dispatch(
      io_, [self = shared_from_this(), farewell = std::move(farewell), why, linger]() mutable {
        if (self->closed_ || self->closing_) {  // the first farewell stands
          return;
        }
        // Nothing more the peer sends is handed on; once the farewell is written our side of the
        // stream ends, and the connection closes when the peer closes its side (so the farewell is
        // not lost to a reset) or after `linger`.
        self->closing_ = true;
        self->limits_ = handshake_limits();
        self->limits_.handshake_only = false;
        self->limits_.peer_memory = self->peer_pid_ > 0;  // releases still come
        self->arm_deadline(linger, why);
        Outgoing out{
            std::move(farewell), {}, [weak = std::weak_ptr<Connection>(self)](const std::string&) {
              if (auto conn = weak.lock()) {
                asio::error_code ignored;
                conn->socket_.shutdown(asio::socket_base::shutdown_send, ignored);
              }
            }};
        out.lengths = encode_tensor_lengths(out.message.tensors);  // nothing lent: no tensors
        {
          // Nothing queued goes out before the farewell, except a frame already partly written.
          std::lock_guard<std::mutex> lock(self->write_mutex_);
          auto first_unwritten = self->queue_.begin();
          if (first_unwritten != self->queue_.end() && first_unwritten->written > 0)
            ++first_unwritten;
          self->queue_.erase(first_unwritten, self->queue_.end());
          self->queue_.push_back(std::move(out));
        }
        self->on_closed_ = [self_closed = self->on_closed_, why](const std::string&) {
          if (self_closed) self_closed(why);
        };
        self->write_next();
        if (!self->reading_) {
          self->paused_ = false;
          self->read_header();
        }
      });
}

void Connection::set_farewell(FarewellMaker make_farewell) {
  make_farewell_ = std::move(make_farewell);
}

void Connection::violation(const std::string& why) {
  if (make_farewell_ && !closing_) {
    close_after(make_farewell_(why), why);
  } else {
    fail(why);
  }
}

void Connection::fail(const std::string& why) {
  if (closed_) {
    return;
  }
  closed_ = true;
  ended_.store(true, std::memory_order_release);
  std::deque<Outgoing> unsent;
  {
    // No direct write uses the socket from here on.
    std::lock_guard<std::mutex> lock(write_mutex_);
    write_closed_ = true;
    unsent.swap(queue_);
  }
  asio::error_code ignored;
  deadline_.cancel();
  socket_.shutdown(asio::socket_base::shutdown_both, ignored);
  socket_.close(ignored);
  release_lent();
  waiting_for_budget_ = false;
  release_reservation();
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
