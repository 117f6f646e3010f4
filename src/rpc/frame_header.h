#pragma once

// The frame header codec (message.h is the whole wire codec's face; docs/wire_format.md has the
// frame): the fixed 24-byte header that starts every frame, the one 8-byte length per tensor that
// follows it, and the bounds (WireLimits) a receiver checks both against before it allocates
// anything they announce.
//
// Pure (no I/O, no globals), so that it can be fuzzed with the rest of the decoder. The header and
// the lengths are hostile input: a malformed or oversized one yields an error string, never an
// exception or a crash.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

namespace distoptim {
namespace rpc {
namespace detail {

/// kRelease (header only) tells a same-host peer that the tensors of the oldest of its frames that
/// lay in its memory have been read (see WireLimits::peer_memory); the transport consumes it.
enum class MessageType : uint8_t {
  kRequest = 1,
  kResponse = 2,
  kError = 3,
  kHandshake = 4,
  kRelease = 5
};

/// The fixed header that starts every frame.
struct MessageHeader {
  static constexpr uint32_t kMagic = 0x3152444f;  // "ODR1" little-endian.
  static constexpr uint8_t kVersion = 1;
  static constexpr size_t kEncodedSize = 24;

  /// The request must be handled in the order it arrived on its connection (RRef control messages:
  /// a fork's registration before its deletion). Bit 0 is reserved; unknown bits are rejected.
  static constexpr uint16_t kOrdered = 1 << 1;
  /// A request whose RRefs sent to the receiver, their owner, are released by the sender when
  /// the reply comes: the receiver sends no accept() for them (rref_context.h).
  static constexpr uint16_t kAcceptedByReply = 1 << 2;
  static constexpr uint16_t kKnownFlags = kOrdered | kAcceptedByReply;

  MessageType type = MessageType::kRequest;
  uint16_t flags = 0;
  uint64_t id = 0;
  uint32_t body_length = 0;
  uint32_t tensor_count = 0;
};

/// Bounds a receiver enforces. The defaults admit any message a sane peer sends.
struct WireLimits {
  size_t max_body_bytes = size_t{64} << 20;
  size_t max_tensors = 1 << 16;
  size_t max_message_bytes = size_t{16} << 30;  // body plus all tensors
  size_t max_nesting_depth = 64;
  size_t max_values = size_t{1} << 22;  // values of all kinds in one body
  size_t max_tensor_dims = 64;
  /// Only handshake messages are admitted (a connection whose peer has not proven itself yet).
  bool handshake_only = false;
  /// Tensors may be announced as lying in the sender's memory, to be read from there (a peer on
  /// the same host whose memory this process proved it can read, handshake.h); kRelease frames
  /// are admitted.
  bool peer_memory = false;
};

/// A tensor length with this bit set announces a tensor left in the sender's memory: the frame
/// carries its 8-byte address there instead of its bytes.
constexpr uint64_t kInSenderMemory = uint64_t{1} << 63;

/// What a connection admits before its peer has proven the shared secret: one small handshake
/// body, nothing else. Every byte a peer can make a worker allocate before then is bounded by it.
WireLimits handshake_limits();

/// An error text, or nothing on success.
using Status = std::optional<std::string>;

/// Every integer on the wire is little-endian: appends the low `bytes` bytes of `value` to `out`,
/// and reads `bytes` bytes of `in` from `offset` (the caller has checked the size).
void put_le(std::string* out, uint64_t value, int bytes);
uint64_t get_le(std::string_view in, size_t offset, int bytes);

std::string encode_header(const MessageHeader& header);
Status decode_header(std::string_view bytes, MessageHeader* header);

/// Checks what a peer announces (the body and tensor lengths) before anything is allocated for it.
Status check_announced_sizes(const MessageHeader& header,
                             const std::vector<size_t>& payload_lengths,
                             const std::vector<size_t>& tensor_lengths, const WireLimits& limits);

/// Checks a received header against `limits` before anything it announces is read.
Status check_header(const MessageHeader& header, const WireLimits& limits);

/// The bytes that follow the header on a connection: one little-endian u64 length per tensor,
/// with kInSenderMemory set for those in `in_sender_memory` (all false when empty).
std::string encode_tensor_lengths(const std::vector<at::Tensor>& tensors,
                                  const std::vector<bool>& in_sender_memory = {});
/// Decodes and checks them (`bytes` holds exactly header.tensor_count * 8 bytes). A length
/// marked kInSenderMemory is an error unless limits.peer_memory; `in_sender_memory` (optional)
/// receives the marks.
Status decode_tensor_lengths(const MessageHeader& header, std::string_view bytes,
                             const WireLimits& limits, std::vector<size_t>* lengths,
                             std::vector<bool>* in_sender_memory = nullptr);

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
