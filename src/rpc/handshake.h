#pragma once

// The connection handshake: every connection starts with three messages (wire.proto's Handshake)
// before any call travels on it.
//   1. the accepting worker sends a challenge: a fresh random nonce and its id;
//   2. the connecting worker answers with its own fresh nonce, its id, and a proof:
//      HMAC-SHA256(secret, "connecting", both nonces, both ids);
//   3. the accepting worker checks the proof and either refuses (and closes the connection) or
//      accepts with its own proof, HMAC-SHA256(secret, "accepting", the same fields), which the
//      connecting worker checks in turn before it sends any call.
// So both ends prove they know the secret without sending it, a recorded proof is worthless on
// another connection (fresh nonces on both sides), and each connection is bound to the
// authenticated id of the worker at its other end: requests claiming another caller id are
// refused. Each proof and acceptance is also signed with the sender's member key (member_key.h)
// over the same fields, and checked against the key that worker id published in the group's
// store (member_keys.h): knowing the secret proves membership of the job, the signature proves
// which member. The accepting side checks the secret first and looks a key up only for a peer
// that proved it.
// Same-host memory reads (transport/peer_memory.h) ride on the same three messages: the challenge
// and the proof each carry the sender's process id and the address of its own nonce in its
// memory; the connecting worker says in its proof whether it read the challenger's nonce there,
// the accepting worker says in its acceptance whether it read the prover's. Only when both did
// may either side leave large tensors in its memory for the other to read. A peer that lies
// gains nothing: a read at a wrong address fails, and a frame pointing at memory the reader
// cannot read closes the connection. Until the proof is checked, the accepting worker admits one
// small handshake frame (frame_header.h's handshake_limits) and nothing else, within a deadline.
//
// States, accepting side: kChallenged -> (proof ok) kAccepted | (else) kRefused.
// Connecting side: kAwaitingChallenge -> (challenge) kProved -> (accept ok) kAccepted |
// (refusal, bad proof) kRefused. A connection lost or past its deadline in any state fails.
// OpenSSL's libcrypto does the cryptography.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "member_key.h"
#include "member_keys.h"

namespace distoptim {
namespace rpc {
namespace detail {

/// Which side of a connection a proof speaks for: the worker that connected, or the one that
/// accepted. A proof for one role never verifies as the other, so a peer cannot echo a proof back.
enum class HandshakeRole { kConnecting, kAccepting };

/// Sets OpenSSL's libcrypto up now rather than at the first handshake. It registers its own
/// clean-up with atexit then: a function registered with atexit after this call runs before it.
void initialize_crypto();

/// HandshakeMessage::kNonceBytes bytes from the operating system's random source.
std::string random_nonce();

/// HMAC-SHA256 of `data` under `secret` (32 bytes; an empty secret is a valid key).
std::string hmac_sha256(const std::string& secret, const std::string& data);

/// HMAC-SHA256 under `secret` of the role and everything the handshake agreed on: both nonces
/// and both worker ids. An empty secret is a valid key (workers configured without one still
/// prove they speak the same protocol and agree on who is who).
std::string handshake_proof(const std::string& secret, HandshakeRole role,
                            const std::string& server_nonce, const std::string& client_nonce,
                            int32_t client_id, int32_t server_id);

/// The member key's signature of what handshake_proof covers (the same role, nonces and ids).
std::string handshake_signature(const MemberKey& key, HandshakeRole role,
                                const std::string& server_nonce, const std::string& client_nonce,
                                int32_t client_id, int32_t server_id);

/// Equality of two proofs in time independent of where they differ.
bool proofs_equal(const std::string& a, const std::string& b);

class Connection;
class RefusalLog;

/// What both sides of a handshake need to know.
struct HandshakeConfig {
  std::string secret;
  int self_id = -1;
  std::string self_name;
  // Accepting side: why a connection may not prove worker id `id` (outside a static group's
  // range, or a worker that left a dynamic one), or nothing. Null: any id is taken.
  std::function<std::optional<std::string>(int id)> refuse_id;
  std::chrono::milliseconds timeout{10000};  // the whole handshake, from its first byte
  bool peer_memory = true;                   // offer same-host memory reads
  // Both sides: only a process of this process's effective user on this machine may be the
  // peer (Connection::peer_user); any other is refused before a byte of it is read. Set when
  // the worker has no secret (RpcBackendOptions::insecure_without_secret).
  bool same_user_only = false;
  // Where refused connections are logged, at a bounded rate; a warning each when null.
  std::shared_ptr<RefusalLog> refusals;
  // Accepting side, once a peer has proven worker id `id` on `connection` and before it is
  // accepted: why it may not be (that id already has a live connection here), or nothing, and
  // then the id is `connection`'s. Null: every proven peer is accepted.
  std::function<std::optional<std::string>(const Connection* connection, int id)> admit;
  // This worker's own member key: its proofs and acceptances are signed with it. Required.
  std::shared_ptr<const MemberKey> own_key;
  // Calls `done`, on the I/O thread, with the public key worker `id` published (or nullopt and
  // why there is none): the peer's signature must verify under it. Required.
  std::function<void(int id, MemberKeys::Resolved done)> member_key;
};

struct HandshakeOutcome {
  bool accepted = false;
  int peer = -1;             // the authenticated worker id, once accepted
  std::string why;           // why not
  bool refused = false;      // a side refused (a wrong secret, a bad proof): do not retry
  bool peer_memory = false;  // both sides read each other's memory (Connection::enable_peer_memory)
  int32_t peer_pid = 0;
};

/// Runs the accepting side on a connection just accepted (on the I/O thread). `done` runs once.
/// On refusal the connection is closed after the refusal is written; on acceptance reading is
/// paused, for the caller to resume with its own handlers.
void accept_handshake(const std::shared_ptr<Connection>& connection, const HandshakeConfig& config,
                      std::function<void(HandshakeOutcome)> done);
/// Runs the connecting side towards worker `peer` (on the I/O thread). `done` runs once.
void connect_handshake(const std::shared_ptr<Connection>& connection, const HandshakeConfig& config,
                       int peer, std::function<void(HandshakeOutcome)> done);

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
