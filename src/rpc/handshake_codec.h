#pragma once

// The handshake codec (message.h is the whole wire codec's face; handshake.h runs the protocol):
// one step of the connection handshake to wire.proto's Handshake and back.
//
// Pure (no I/O, no globals), so that it can be fuzzed with the rest of the decoder. A step comes
// from a peer that has not proven itself yet: decoding checks that it carries its nonces and proof
// at exactly their sizes and a refusal within its bound, and a malformed step yields an error
// string, never an exception or a crash.

#include <cstddef>
#include <cstdint>
#include <string>

#include "frame_header.h"

namespace distoptim {
namespace rpc {
namespace wire {
class Handshake;
}  // namespace wire

namespace detail {

/// One step of the connection handshake (wire.proto's Handshake). Which fields a step carries is
/// checked by the decoder: nonces and proofs have exactly their sizes.
struct HandshakeMessage {
  static constexpr size_t kNonceBytes = 32;
  static constexpr size_t kProofBytes = 32;      // HMAC-SHA256
  static constexpr size_t kSignatureBytes = 64;  // Ed25519 (member_key.h)
  static constexpr size_t kMaxRefusalBytes = 1024;
  enum class Step : uint8_t { kChallenge = 1, kProof = 2, kAccept = 3, kRefuse = 4 };

  Step step = Step::kChallenge;
  std::string server_nonce;  // kChallenge, kProof
  std::string client_nonce;  // kProof
  int32_t client_id = -1;    // kProof
  int32_t server_id = -1;    // kChallenge, kProof
  std::string proof;         // kProof, kAccept
  std::string signature;     // kProof, kAccept: the sender's member key signs what `proof` covers
  std::string refusal;       // kRefuse
  // Same-host memory reads (handshake.h), all optional: the sender's process id and the address
  // of its own nonce in its memory (kChallenge, kProof), and whether the sender could read the
  // peer's nonce there (kProof, kAccept).
  int32_t pid = 0;
  uint64_t probe_address = 0;
  bool reads_peer = false;
};

/// Writes every field of `step` into `out`, as it travels.
void encode_handshake_step(const HandshakeMessage& step, wire::Handshake* out);
/// Reads a received step into `out`, which is left as it was when the step is malformed.
Status decode_handshake_step(const wire::Handshake& in, HandshakeMessage* out);

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
