#pragma once

// Same-host memory lending on one connection: a frame's large tensors stay in the sender's memory
// and the peer reads them from there (peer_memory.h), one copy instead of two through the
// kernel's socket buffers; the stream carries their addresses. The sender keeps them alive until
// the peer's kRelease for their frame. Both directions of a connection live here: what this side
// lends (its write side) and what it reads of what the peer lends (its read side).

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <asio/buffer.hpp>
#include <asio/io_context.hpp>

#include "../message.h"

namespace distoptim {
namespace rpc {
namespace detail {

/// The lending of one Connection, owned by it. Off until enable(), which the connection runs once
/// the handshake proved both sides can read each other's memory (handshake.h).
///
/// Threading: the lending side (lend, withdraw, release_oldest, release_all_after_grace,
/// lent_frames) may be called from any thread; its queue is guarded by a mutex of its own, taken
/// inside the connection's write mutex, never the other way round. The reading side and enable()
/// are confined to the connection's I/O thread. enabled() and bytes_read() are any thread.
class MemoryLending {
 public:
  /// Tensors of at least this many bytes are lent rather than written into the stream.
  static constexpr size_t kPeerMemoryBytes = size_t{256} << 10;

  /// `io` runs the timer that keeps a closed connection's lent tensors alive for a while.
  explicit MemoryLending(asio::io_context& io) : io_(io) {}
  MemoryLending(const MemoryLending&) = delete;
  MemoryLending& operator=(const MemoryLending&) = delete;

  /// I/O thread only. From now on large tensors are lent to process `peer_pid`, and tensors it
  /// announces in its memory are read from there.
  void enable(int32_t peer_pid);
  /// Whether enable() ran. Any thread.
  bool enabled() const { return enabled_.load(std::memory_order_acquire); }
  /// I/O thread only. Whether frames may announce tensors in the peer's memory and send kRelease
  /// (WireLimits::peer_memory).
  bool peer_lends() const { return peer_pid_ > 0; }

  /// Lends the tensors of `tensors` of at least kPeerMemoryBytes, if enabled: marks them in
  /// `in_memory` and writes their addresses in `addresses` (8 bytes each; both left empty when
  /// none is lent), and keeps them until the peer releases them. Returns the frame's number among
  /// those that lend, 0 if it lends nothing. The peer releases frames in the order it reads them:
  /// the caller sends frames in the order they were lent (under its write mutex).
  uint64_t lend(const std::vector<at::Tensor>& tensors, std::vector<bool>* in_memory,
                std::string* addresses);
  /// The frame numbered `lent` (lend's return) was dropped before any byte of it was written: the
  /// peer will not read its tensors.
  void withdraw(uint64_t lent);
  /// The peer's kRelease: it has read the tensors of the oldest frame that lent some, which may
  /// go. False if nothing is lent (the peer breaks the protocol).
  bool release_oldest();
  /// The connection closed: what the peer was lent stays alive a while longer, in case it is
  /// reading it right now, then goes.
  void release_all_after_grace();
  /// Frames whose tensors were lent and not yet released.
  size_t lent_frames();

  /// I/O thread only, for the frame being read: which of its tensors lie in the peer's memory
  /// (decode_tensor_lengths fills it).
  std::vector<bool>* frame_in_peer_memory() { return &in_peer_memory_; }
  bool in_peer_memory(size_t tensor) const { return in_peer_memory_[tensor]; }
  /// I/O thread only. Makes room for the addresses of the frame's `tensors` tensors; the stream
  /// carries the address of a tensor in the peer's memory into address_slot(tensor).
  void expect_addresses(size_t tensors) { peer_addresses_.assign(tensors * 8, '\0'); }
  asio::mutable_buffer address_slot(size_t tensor) {
    return asio::buffer(&peer_addresses_[tensor * 8], 8);
  }
  /// I/O thread only. Reads the frame's tensors that lie in the peer's memory into their
  /// `buffers` (allocated to their announced lengths), and sets `*any` when there was one: the
  /// peer is then owed a release_message(). An error text naming the tensor if the peer's memory
  /// does not hold what it announced.
  Status read_borrowed(std::vector<at::Tensor>& buffers, bool* any);
  /// The kRelease frame that tells the peer it may free what it lent for the frame just read.
  static EncodedMessage release_message();
  /// Bytes read from the peer's memory since enable(). Any thread.
  uint64_t bytes_read() const { return bytes_read_.load(std::memory_order_relaxed); }

 private:
  asio::io_context& io_;
  std::atomic<bool> enabled_{false};

  // Lending, guarded by mutex_: the tensors of each frame that lent, oldest first, numbered.
  std::mutex mutex_;
  uint64_t lent_count_ = 0;
  std::deque<std::pair<uint64_t, std::vector<at::Tensor>>> lent_;

  // Reading what the peer lends, I/O thread only.
  int32_t peer_pid_ = 0;  // enable()'s peer; 0: none
  std::vector<bool> in_peer_memory_;
  std::string peer_addresses_;  // 8 bytes per tensor of the frame being read
  std::atomic<uint64_t> bytes_read_{0};
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
