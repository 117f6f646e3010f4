// A Connection's write side (connection.h): frames in the order they are sent, from any thread,
// one writer at a time on the socket: the caller's own direct write when nothing is queued, else
// the I/O thread's gathered writes. Large tensors are lent rather than written (memory_lending.h).

#include "connection.h"

#include <sys/socket.h>
#include <sys/uio.h>

#include <asio/dispatch.hpp>
#include <asio/write.hpp>

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

// Messages gathered into one write: enough to batch a burst, few enough that one slow write
// does not delay the completion of many.
constexpr size_t kMaxMessagesPerWrite = 64;
// Pieces of a frame a direct write sends in one sendmsg (a frame with more tensors is queued).
constexpr size_t kMaxDirectPieces = 64;

}  // namespace

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

// Under write_mutex_, so that frames are lent in the order they go out: the peer releases them
// in the order it reads them.
void Connection::prepare_locked(Outgoing& out) {
  out.lent = lending_.lend(out.message.tensors, &out.in_memory, &out.addresses);
  out.lengths = encode_tensor_lengths(out.message.tensors, out.in_memory);
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
  if (state() == State::kClosed) {
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
      if (it->lent != 0) lending_.withdraw(it->lent);
      queue_.erase(it);
      return;
    }
  }
}

// One gathered write at a time, of up to kMaxMessagesPerWrite queued messages in order. The
// tensors' memory is written where it lies; `in_flight_` keeps it alive meanwhile.
void Connection::write_next() {
  std::lock_guard<std::mutex> lock(write_mutex_);
  if (writing_ || state() == State::kClosed) {
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
                      const std::string why = error ? error_text(error) : std::string();
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

std::deque<Connection::Outgoing> Connection::take_unsent() {
  std::deque<Outgoing> unsent;
  std::lock_guard<std::mutex> lock(write_mutex_);
  unsent.swap(queue_);
  return unsent;
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
