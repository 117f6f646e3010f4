#pragma once

// A well-formed handshake message for the message tests and the fuzz seeds: the proof step, with
// each field at its fixed size and recognisable contents.

#include <string>

#include "message.h"

namespace distoptim {
namespace rpc {
namespace detail {

inline HandshakeMessage sample_proof_step() {
  HandshakeMessage proof;
  proof.step = HandshakeMessage::Step::kProof;
  proof.server_nonce = std::string(HandshakeMessage::kNonceBytes, 's');
  proof.client_nonce = std::string(HandshakeMessage::kNonceBytes, 'c');
  proof.client_id = 2;
  proof.server_id = 0;
  proof.proof = std::string(HandshakeMessage::kProofBytes, 'p');
  proof.signature = std::string(HandshakeMessage::kSignatureBytes, 'g');
  return proof;
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
