#pragma once

// The cryptography of the connection handshake (agent.cpp describes the protocol): fresh nonces,
// HMAC-SHA256 proofs keyed by the workers' shared secret, and their constant-time comparison.
// OpenSSL's libcrypto does the work.

#include <cstdint>
#include <string>

namespace distoptim {
namespace rpc {
namespace detail {

/// Which side of a pipe a proof speaks for: the worker that connected, or the one that accepted.
/// A proof for one role never verifies as the other, so a peer cannot echo a proof back.
enum class HandshakeRole { kConnecting, kAccepting };

/// HandshakeMessage::kNonceBytes bytes from the operating system's random source.
std::string random_nonce();

/// HMAC-SHA256 under `secret` of the role and everything the handshake agreed on: both nonces
/// and both worker ids. An empty secret is a valid key (workers configured without one still
/// prove they speak the same protocol and agree on who is who).
std::string handshake_proof(const std::string& secret, HandshakeRole role,
                            const std::string& server_nonce, const std::string& client_nonce,
                            int32_t client_id, int32_t server_id);

/// Equality of two proofs in time independent of where they differ.
bool proofs_equal(const std::string& a, const std::string& b);

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
