#pragma once

// The RPC wire format (docs/wire_format.md describes it whole): one frame per request, response
// or error on a TCP connection: a fixed 24-byte header, one 8-byte length per tensor, a protobuf
// `Body` (wire.proto) with every non-tensor value, then each tensor's bytes, sent from and
// received into tensor storage without a copy.
//
// Every connection begins with a three-message handshake (kHandshake) before any request travels
// on it; handshake.h describes it.
//
// Everything here is pure (no I/O, no globals) so that the decoder can be fuzzed on its own.
// Decoding treats its input as hostile: every length is checked before anything is allocated,
// and a malformed message yields an error string, never an exception or a crash.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <distoptim/rpc/interceptor.h>

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

/// A message ready to send. `tensors` are dense (contiguous) CPU tensors whose bytes are sent as
/// they lie in memory; the message keeps them alive until they are written.
struct EncodedMessage {
  std::string header;
  std::string body;
  std::vector<at::Tensor> tensors;
};

/// Encoders throw c10::TypeError / c10::ValueError for values that cannot travel (a CUDA or
/// sparse tensor, an unsupported IValue kind, a dict with keys other than strings or ints).
/// `metadata` past its bounds (interceptor.h) is a c10::ValueError.
EncodedMessage encode_request(uint64_t id, const std::string& callable,
                              const std::vector<c10::IValue>& args, int64_t timeout_ms,
                              int32_t caller_id = -1, uint16_t flags = 0,
                              const CallMetadata& metadata = {});
EncodedMessage encode_response(uint64_t id, const c10::IValue& result,
                               const CallMetadata& metadata = {});
EncodedMessage encode_error(uint64_t id, const std::string& message, const std::string& worker);

/// One step of the connection handshake (wire.proto's Handshake). Which fields a step carries is
/// checked by the decoder: nonces and proofs have exactly their sizes.
struct HandshakeMessage {
  static constexpr size_t kNonceBytes = 32;
  static constexpr size_t kProofBytes = 32;  // HMAC-SHA256
  static constexpr size_t kMaxRefusalBytes = 1024;
  enum class Step : uint8_t { kChallenge = 1, kProof = 2, kAccept = 3, kRefuse = 4 };

  Step step = Step::kChallenge;
  std::string server_nonce;  // kChallenge, kProof
  std::string client_nonce;  // kProof
  int32_t client_id = -1;    // kProof
  int32_t server_id = -1;    // kChallenge, kProof
  std::string proof;         // kProof, kAccept
  std::string refusal;       // kRefuse
  // Same-host memory reads (handshake.h), all optional: the sender's process id and the address
  // of its own nonce in its memory (kChallenge, kProof), and whether the sender could read the
  // peer's nonce there (kProof, kAccept).
  int32_t pid = 0;
  uint64_t probe_address = 0;
  bool reads_peer = false;
};

EncodedMessage encode_handshake(const HandshakeMessage& handshake);

/// A received message, decoded.
struct DecodedMessage {
  MessageHeader header;
  // kRequest
  std::string callable;
  std::vector<c10::IValue> args;
  int64_t timeout_ms = 0;
  int32_t caller_id = -1;  // as sent; range-checked by the agent, which knows the world size
  // kResponse
  c10::IValue result;
  // kRequest, kResponse
  CallMetadata metadata;
  // kError
  std::string error_message;
  std::string error_worker;
  // kHandshake
  HandshakeMessage handshake;
};

/// Decodes a body and its tensors. `tensor_buffers` are the byte buffers (kByte, 1-D, each a whole
/// allocation: no storage offset) the transport filled, of the lengths check_announced_sizes
/// accepted; on success they become typed tensors over the same memory (not views: once the buffers
/// go, each tensor alone holds its memory).
Status decode_body(const MessageHeader& header, std::string_view body,
                   std::vector<at::Tensor> tensor_buffers, const WireLimits& limits,
                   DecodedMessage* message);

/// Ids of an RRef as they travel (layer 4's RRef protocol builds on them).
struct RRefIds {
  int32_t owner_id = -1;
  int32_t rref_created_on = -1;
  int64_t rref_local_id = -1;
  int32_t fork_created_on = -1;
  int64_t fork_local_id = -1;
  std::string type_name;
};

/// How an RRef reference sits inside a c10::IValue between the decoder and the RRef layer.
class RRefReference : public c10::RRefInterface {
 public:
  explicit RRefReference(RRefIds ids) : ids_(std::move(ids)) {}
  const RRefIds& ids() const { return ids_; }
  c10::worker_id_t owner() const override { return static_cast<c10::worker_id_t>(ids_.owner_id); }
  std::string ownerName() const override { return {}; }
  bool isOwner() const override { return false; }
  bool confirmedByOwner() const override { return false; }
  const c10::TypePtr type() const override;

 private:
  RRefIds ids_;
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
