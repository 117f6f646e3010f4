// A Connection's read side (connection.h), on the I/O thread: frames from the socket, each
// checked against the limits before anything is allocated, reserved from the receive budget
// when large, and handed to the frame handler, which may pause reading.

#include "connection.h"

#include <algorithm>
#include <cstring>

#include <asio/dispatch.hpp>
#include <asio/post.hpp>
#include <asio/read.hpp>

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/util/Exception.h>

namespace distoptim {
namespace rpc {
namespace detail {

void Connection::read_frames(const WireLimits& limits, FrameHandler on_frame,
                             ClosedHandler on_closed) {
  limits_ = limits;
  limits_.peer_memory = lending_.peer_lends();
  on_frame_ = std::make_shared<FrameHandler>(std::move(on_frame));
  on_closed_ = std::move(on_closed);
  paused_ = false;
  if (state() != State::kClosed && !reading_) {
    read_header();
  }
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
        if (self->state() != State::kClosed) next();
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
  if (state() == State::kClosed) {
    return true;
  }
  if (error) {
    fail(error_text(error));
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
    if (lending_.release_oldest()) {
      read_header();
    } else {
      violation("it sent a release of memory it had not been lent");
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
                                            lending_.frame_in_peer_memory())) {
    violation("it sent " + *status);
    return;
  }
  size_t announced = frame_.header.body_length;
  for (size_t length : lengths_) announced += length;
  if (budget_ && state() != State::kClosingAfterFarewell && reserved_ == 0) {
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
    lending_.expect_addresses(lengths_.size());
    targets_.reserve(lengths_.size() + 1);
    targets_.push_back(asio::buffer(*frame_.body));
    for (size_t i = 0; i < lengths_.size(); ++i) {
      // Allocated without the dispatcher (at::empty's dispatch costs more than the allocation).
      at::Tensor buffer(at::detail::empty_cpu({static_cast<int64_t>(lengths_[i])}, at::kByte));
      if (lending_.in_peer_memory(i)) {
        targets_.push_back(lending_.address_slot(i));
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
  if (Status error = lending_.read_borrowed(frame_.buffers, &any)) {
    violation("it announced " + *error);
    return false;
  }
  if (any) {
    send(MemoryLending::release_message());
  }
  return true;
}

void Connection::deliver_frame() {
  if (state() != State::kClosingAfterFarewell && !read_from_peer_memory()) {
    return;
  }
  // The frame is whole: from here on it counts against the inbound queue (Dispatcher), if any.
  in_frame_ = false;
  release_reservation();
  Frame frame = std::move(frame_);
  frame_ = Frame();
  if (state() == State::kClosingAfterFarewell) {  // nothing more is handed on
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
  if (state() == State::kClosed || reading_) {
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
    if (self->waiting_for_budget_ && self->state() != State::kClosed) {
      self->waiting_for_budget_ = false;
      self->read_payload();
    }
  });
}

bool Connection::frame_stalled(int checks) {
  if (!budget_ || !in_frame_ || waiting_for_budget_ || state() != State::kOpen) {
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
    if (self->paused_ && self->state() != State::kClosed && !self->reading_) {
      self->paused_ = false;
      self->read_header();
    }
  });
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
