// The handshake codec (handshake_codec.h): a handshake step's fields written into wire.proto's
// Handshake, and read back only when the step carries exactly its fields, of exactly their sizes.

#include "handshake_codec.h"

#include <c10/util/StringUtil.h>

#include "wire.pb.h"

namespace distoptim {
namespace rpc {
namespace detail {

void encode_handshake_step(const HandshakeMessage& step, wire::Handshake* out) {
  out->set_step(static_cast<wire::Handshake::Step>(step.step));
  out->set_server_nonce(step.server_nonce);
  out->set_client_nonce(step.client_nonce);
  out->set_client_id(step.client_id);
  out->set_server_id(step.server_id);
  out->set_proof(step.proof);
  out->set_signature(step.signature);
  out->set_refusal(step.refusal);
  out->set_pid(step.pid);
  out->set_probe_address(step.probe_address);
  out->set_reads_peer(step.reads_peer);
}

// Each step carries exactly its fields, of exactly their sizes.
Status decode_handshake_step(const wire::Handshake& in, HandshakeMessage* out) {
  using Step = HandshakeMessage::Step;
  const auto sized = [](const std::string& bytes, size_t size) { return bytes.size() == size; };
  switch (in.step()) {
    case wire::Handshake::CHALLENGE:
      if (!sized(in.server_nonce(), HandshakeMessage::kNonceBytes)) {
        return std::string("a handshake challenge without a nonce of its size");
      }
      break;
    case wire::Handshake::PROOF:
      if (!sized(in.server_nonce(), HandshakeMessage::kNonceBytes) ||
          !sized(in.client_nonce(), HandshakeMessage::kNonceBytes) ||
          !sized(in.proof(), HandshakeMessage::kProofBytes) ||
          !sized(in.signature(), HandshakeMessage::kSignatureBytes)) {
        return std::string("a handshake proof without nonces, proof and signature of their sizes");
      }
      break;
    case wire::Handshake::ACCEPT:
      if (!sized(in.proof(), HandshakeMessage::kProofBytes) ||
          !sized(in.signature(), HandshakeMessage::kSignatureBytes)) {
        return std::string("a handshake acceptance without a proof and signature of their sizes");
      }
      break;
    case wire::Handshake::REFUSE:
      if (in.refusal().size() > HandshakeMessage::kMaxRefusalBytes) {
        return c10::str("a handshake refusal of ", in.refusal().size(), " bytes (at most ",
                        HandshakeMessage::kMaxRefusalBytes, ")");
      }
      break;
    default:
      return c10::str("unknown handshake step ", static_cast<int>(in.step()));
  }
  out->step = static_cast<Step>(in.step());
  out->server_nonce = in.server_nonce();
  out->client_nonce = in.client_nonce();
  out->client_id = in.client_id();
  out->server_id = in.server_id();
  out->proof = in.proof();
  out->signature = in.signature();
  out->refusal = in.refusal();
  out->pid = in.pid();
  out->probe_address = in.probe_address();
  out->reads_peer = in.reads_peer();
  return std::nullopt;
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
