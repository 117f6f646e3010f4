#pragma once

// One connection of the rpc layer's transport: framed messages over TCP, or over a Unix-domain
// socket between workers on one host, on Asio (docs/wire_format.md has the frame layout,
// docs/threading.md the threads). The library owns every byte of a connection from its first:
// until the peer has proven the shared secret, a connection admits only a small handshake frame
// (frame_header.h's handshake_limits) within a deadline, so nothing an unauthenticated peer sends
// reaches a parser that allocates more than that bound. How connections begin is listener.h;
// the same-host lending of large tensors memory_lending.h. The class is implemented by job:
// its lifecycle in connection.cpp, reading in connection_reading.cpp, writing in
// connection_writing.cpp.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <asio/generic/stream_protocol.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/local/stream_protocol.hpp>
#include <asio/steady_timer.hpp>

#include "../message.h"
#include "memory_lending.h"
#include "receive_budget.h"

namespace distoptim {
namespace rpc {
namespace detail {

/// One received frame: its header, body and tensors (as byte buffers).
struct Frame {
  MessageHeader header;
  std::shared_ptr<std::string> body;
  std::vector<at::Tensor> buffers;
};

/// A framed connection over TCP or a Unix-domain socket. Threading: the read side and the handlers
/// are confined to the I/O thread of its io_context; the write side is guarded by a mutex, so that
/// send() can write from the calling thread when nothing is queued (a thread hand-off fewer per
/// message: waking a sleeping I/O thread costs tens of microseconds on a virtual machine). send(),
/// drop_queued(), close() and resume_reading() may be called from any thread. Callbacks run on the
/// I/O thread and must not block. `on_closed` runs exactly once, when the connection fails or is
/// closed, and no `on_frame` runs after it.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  /// Returns whether to go on reading; false pauses reading until resume_reading().
  using FrameHandler = std::function<bool(Frame frame)>;
  using ClosedHandler = std::function<void(const std::string& why)>;
  using WrittenHandler = std::function<void(const std::string& error)>;
  /// The message that tells the peer why the connection closes for a protocol error.
  using FarewellMaker = std::function<EncodedMessage(const std::string& why)>;

  Connection(asio::io_context& io, asio::ip::tcp::socket socket);
  /// A Unix-domain socket, accepted (`unix_name` empty) or connected to `unix_name`.
  Connection(asio::io_context& io, asio::local::stream_protocol::socket socket,
             const std::string& unix_name);
  ~Connection();

  /// I/O thread only. Sets the handlers and the limits frames are checked against, and starts
  /// (or goes on) reading.
  void read_frames(const WireLimits& limits, FrameHandler on_frame, ClosedHandler on_closed);
  /// I/O thread only. Closes the connection (reason `why`) unless disarmed before `timeout`.
  void arm_deadline(std::chrono::milliseconds timeout, std::string why);
  void disarm_deadline();
  /// I/O thread only, once the peer has proven itself. From then on a frame larger than
  /// ReceiveBudget::kUnreservedBytes is allocated and read only once `budget` has reserved its
  /// announced size (else the connection reads nothing until it can), and frame_stalled() can
  /// tell when a frame stops arriving.
  void set_receive_budget(std::shared_ptr<ReceiveBudget> budget);
  /// Any thread: the budget may have room now for the frame this connection waits to read.
  void retry_reservation();
  /// I/O thread only; called at a fixed interval (Peers' stall check). Whether a frame is being
  /// read and no byte of it arrived during the last `checks` intervals: its peer stalls. A frame
  /// waiting for the budget is never stalled (the wait is this worker's).
  bool frame_stalled(int checks);
  /// I/O thread only. When a frame breaks the framing or `limits` (a bad header, an absurd
  /// length), the connection writes `make_farewell(why)` and closes (close_after); without one it
  /// closes at once.
  void set_farewell(FarewellMaker make_farewell);

  /// Writes `message`, after those sent before it: from the calling thread, as far as the socket
  /// takes it without blocking, when nothing is queued and no handler is given; the rest (or the
  /// whole, queued) from the I/O thread. `on_written` (optional) runs on the I/O thread once the
  /// frame is written or has failed.
  void send(EncodedMessage message, WrittenHandler on_written = {});
  /// Drops a queued message not yet being written, by its header id (a call that timed out).
  void drop_queued(uint64_t id);
  /// Closes the connection: queued writes fail, `on_closed(why)` runs.
  void close(const std::string& why);
  /// How long a connection closed with a farewell waits for the peer to read it.
  static constexpr std::chrono::milliseconds kFarewellLinger{1000};
  /// Writes `farewell`, then closes (a refusal, a protocol error the peer should hear about);
  /// closes after at most `linger` even if the peer does not read.
  void close_after(EncodedMessage farewell, const std::string& why,
                   std::chrono::milliseconds linger = kFarewellLinger);
  /// Reading goes on after a frame handler returned false. Called from inside a frame handler,
  /// it holds for that frame: reading goes on whatever the handler returns.
  void resume_reading();

  /// I/O thread only, once the handshake proved both sides can read each other's memory
  /// (handshake.h), before frames are read again. From then on tensors of at least
  /// MemoryLending::kPeerMemoryBytes are left in this process's memory for process `peer_pid` to
  /// read (memory_lending.h), kept until the peer's kRelease for their frame, and such tensors
  /// the peer announces are read from its memory.
  void enable_peer_memory(int32_t peer_pid);
  /// Whether enable_peer_memory ran, and the bytes read from the peer's memory since (for
  /// diagnostics: rpc::get_debug_info). Any thread.
  bool peer_memory_enabled() const { return lending_.enabled(); }
  uint64_t peer_memory_bytes_read() const { return lending_.bytes_read(); }
  /// Frames whose tensors this side lent (left in its memory) and the peer has not read yet.
  /// Any thread.
  size_t lent_frames() { return lending_.lent_frames(); }

  /// Whether the connection has closed (failed, or close() ran): nothing sent on it reaches the
  /// peer any more. Any thread; once true it stays true.
  bool closed() const { return state() == State::kClosed; }
  /// Whether every frame sent so far has been written to the socket (or the connection closed).
  /// Any thread.
  bool writes_done() {
    std::lock_guard<std::mutex> lock(write_mutex_);
    return state() == State::kClosed || (!writing_ && queue_.empty());
  }

  /// The peer's address as "ip:port", or for a Unix-domain socket the listener's name or the
  /// connecting process's id (fixed at construction).
  const std::string& peer_address() const { return peer_address_; }
  /// The uid of the process at the other end, if it runs on this machine (peer_user.h): asks
  /// the kernel (for TCP, one socket-diagnostics lookup), so call it once per connection; nullopt:
  /// not known to be on this machine (or closed). I/O thread only.
  std::optional<uint32_t> peer_user();
  /// Whether the connection is a Unix-domain socket (same host) rather than TCP.
  bool unix_socket() const { return unix_socket_; }

 private:
  // The connection's lifecycle, forward only: kOpen, then either kClosed at once (fail: an error,
  // a deadline, close()) or first kClosingAfterFarewell (close_after: the farewell is written,
  // what the peer sends is read and dropped, until the peer closes or the linger ends) and then
  // kClosed. enter() is the only place that changes it. (Until the peer has proven itself the
  // connection is open too: the handshake is the caller's, held in the limits it reads with.)
  enum class State : uint8_t { kOpen, kClosingAfterFarewell, kClosed };
  void enter(State next);
  State state() const { return state_.load(std::memory_order_acquire); }

  struct Outgoing {
    EncodedMessage message;
    std::string lengths;
    WrittenHandler on_written;
    size_t written = 0;  // bytes of the frame a direct write already sent
    // Tensors left in this process's memory: which, and their addresses (8 bytes each, sent in
    // place of their bytes); `lent` numbers the frame among those that lend (0: none).
    std::vector<bool> in_memory{};
    std::string addresses{};
    uint64_t lent = 0;
  };

  static std::string error_text(const asio::error_code& error);

  // Lifecycle (connection.cpp).
  void violation(const std::string& why);
  void fail(const std::string& why);
  // close_after's steps on the I/O thread, in their order (connection.cpp says why).
  void say_farewell(EncodedMessage farewell, const std::string& why,
                    std::chrono::milliseconds linger);
  void limit_reads_to_small_frames();
  void queue_farewell(EncodedMessage farewell);
  void report_closed_as(const std::string& why);
  void read_until_peer_closes();

  // Reading (connection_reading.cpp).
  void read_then(std::function<void()> next);
  bool read_ended(const asio::error_code& error);
  void read_header();
  void on_header();
  void read_payload();
  bool read_from_peer_memory();
  void release_reservation();
  void deliver_frame();

  // Writing (connection_writing.cpp).
  // Prepares `out`'s lengths, and lends its large tensors to the peer when it may.
  void prepare_locked(Outgoing& out);
  // Calls add(data, size) for each piece of the frame's bytes (header, tensor lengths, body,
  // tensors), from `out.written` on.
  template <class Add>
  static void for_each_piece(const Outgoing& out, Add add);
  // send()'s direct write; write_mutex_ held. Returns whether the whole frame went.
  bool write_directly(Outgoing& out);
  void write_next();
  // Takes what is queued and not written (the connection closed).
  std::deque<Outgoing> take_unsent();

  asio::io_context& io_;
  asio::generic::stream_protocol::socket socket_;  // TCP or Unix-domain
  const bool unix_socket_;
  asio::steady_timer deadline_;
  // Counts arm_deadline/disarm_deadline calls: an expiry already queued when the deadline was
  // disarmed (cancel() cannot recall it) finds the count moved on and does nothing.
  uint64_t deadline_generation_ = 0;
  std::string peer_address_;
  // Read from any thread (closed(), and the write side under write_mutex_); changed by enter()
  // on the I/O thread.
  std::atomic<State> state_{State::kOpen};
  MemoryLending lending_;

  // I/O thread only:
  WireLimits limits_;
  std::shared_ptr<FrameHandler> on_frame_;
  ClosedHandler on_closed_;
  FarewellMaker make_farewell_;
  // The read loop's flags, which overlap (a handler may start the next read while it runs; a
  // frame waits for the budget between two reads): no lifecycle, which is state_.
  bool reading_ = false;  // a read is outstanding
  bool paused_ = false;   // the frame handler returned false
  char header_bytes_[MessageHeader::kEncodedSize];
  // Bytes read beyond the field a read wanted, for the next reads (read_then): allocated at the
  // first small read, kInboxBytes per connection.
  static constexpr size_t kInboxBytes = 4096;
  static constexpr int kMaxInlineReads = 16;
  std::unique_ptr<char[]> inbox_;
  size_t inbox_begin_ = 0;
  size_t inbox_end_ = 0;
  int inline_depth_ = 0;           // read_then's nesting of fields taken from the inbox
  bool delivering_ = false;        // the frame handler runs
  bool resume_requested_ = false;  // resume_reading() ran while it did
  // What read_then fills (one read at a time), kept across reads so that a frame's reads
  // allocate no list of their own.
  std::vector<asio::mutable_buffer> targets_;
  std::string length_bytes_;
  std::vector<size_t> lengths_;  // of frame_'s tensors
  static constexpr size_t kKeptTensorLengths = 64;
  Frame frame_;
  // Receiving bounds (set_receive_budget): the budget, what frame_ holds of it, and whether
  // frame_ waits for it; whether a frame is being read, the count of reads that brought some of
  // it (bumped by the reads themselves: no clock or timer per frame), and what the last stall
  // check saw of that count.
  std::shared_ptr<ReceiveBudget> budget_;
  size_t reserved_ = 0;
  bool waiting_for_budget_ = false;
  bool in_frame_ = false;
  uint64_t progress_ = 0;
  uint64_t progress_checked_ = 0;
  int stalled_checks_ = 0;

  // The write side, any thread, under write_mutex_: one writer at a time on the socket (a direct
  // write or the I/O thread's gathered one), frames in order, and no write once closed. Lock
  // order: write_mutex_, then lending_'s own.
  std::mutex write_mutex_;
  bool writing_ = false;  // the I/O thread's write is outstanding
  std::deque<Outgoing> queue_;
  std::vector<Outgoing> in_flight_;
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
