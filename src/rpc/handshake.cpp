#include "handshake.h"

#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <c10/util/Exception.h>

#include "message.h"
#include "refusal_log.h"
#include "transport/connection.h"
#include "transport/peer_memory.h"

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

void append_u32(std::string* out, uint32_t value) {
  for (int byte = 0; byte < 4; ++byte) {
    out->push_back(static_cast<char>((value >> (8 * byte)) & 0xff));
  }
}

// `done` of a handshake, run at most once whichever of frame, close or deadline comes first.
std::function<void(HandshakeOutcome)> once(std::function<void(HandshakeOutcome)> done) {
  auto called = std::make_shared<bool>(false);
  return [called, done = std::move(done)](HandshakeOutcome outcome) {
    if (!*called) {
      *called = true;
      done(std::move(outcome));
    }
  };
}

// Decodes a handshake frame, or says what is wrong with it.
Status decode_handshake_frame(const Frame& frame, HandshakeMessage* message) {
  DecodedMessage decoded;
  Status status =
      decode_body(frame.header, *frame.body, frame.buffers, handshake_limits(), &decoded);
  if (!status) {
    *message = std::move(decoded.handshake);
  }
  return status;
}

uint64_t address_of(const std::string& bytes) {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(bytes.data()));
}

// Announces this process and where its nonce lies in its memory, if the worker offers reads.
void offer_peer_memory(const HandshakeConfig& config, const std::string& own_nonce,
                       HandshakeMessage* message) {
  if (config.peer_memory) {
    message->pid = own_pid();
    message->probe_address = address_of(own_nonce);
  }
}

// Whether this process can read the peer's nonce where the peer said it lies.
bool reads_peer(const HandshakeConfig& config, const HandshakeMessage& peer,
                const std::string& peer_nonce) {
  return config.peer_memory && peer_memory_holds(peer.pid, peer.probe_address, peer_nonce);
}

HandshakeOutcome failed(std::string why, bool refused = false) {
  HandshakeOutcome outcome;
  outcome.why = std::move(why);
  outcome.refused = refused;
  return outcome;
}

// The refusal a connecting peer reads, logged here too (at a bounded rate). The peer is named by
// its address: nothing it said can be trusted.
EncodedMessage refusal(Connection* connection, const HandshakeConfig& config,
                       const std::string& why) {
  if (config.refusals) {
    config.refusals->refused(connection->peer_address(), why);
  } else {
    TORCH_WARN("rpc: worker '", config.self_name, "' refused a connection from ",
               connection->peer_address(), ": ", why);
  }
  HandshakeMessage message;
  message.step = HandshakeMessage::Step::kRefuse;
  message.refusal = "worker '" + config.self_name + "' refused the connection: " + why;
  return encode_handshake(message);
}

// Under same_user_only: why `connection`'s peer may not be ours (another user's process, or
// one not on this machine), or nothing.
std::optional<std::string> foreign_peer(Connection* connection, const HandshakeConfig& config) {
  if (!config.same_user_only) return std::nullopt;
  const std::optional<uint32_t> user = connection->peer_user();
  const uint32_t self = ::geteuid();
  if (user == self) return std::nullopt;
  return (user ? "its other end is a process of another user (uid " + std::to_string(*user) +
                     ", this worker's is " + std::to_string(self) + ")"
               : std::string("its other end is not a process on this machine")) +
         ", and without a shared secret worker '" + config.self_name +
         "' accepts only its own user's processes on this machine (give every worker the same "
         "RpcBackendOptions::shared_secret, or set insecure_without_secret to accept anyone)";
}

std::string deadline_text(const HandshakeConfig& config) {
  return "it did not complete the handshake within " + std::to_string(config.timeout.count()) +
         " ms";
}

}  // namespace

void initialize_crypto() {
  // Not 0: with no option asked for, OpenSSL returns at once without starting.
  TORCH_CHECK(OPENSSL_init_crypto(OPENSSL_INIT_ADD_ALL_DIGESTS, nullptr) == 1,
              "rpc: OpenSSL's libcrypto failed to start");
}

std::string random_nonce() {
  std::string nonce(HandshakeMessage::kNonceBytes, '\0');
  TORCH_CHECK(RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()),
                         static_cast<int>(nonce.size())) == 1,
              "rpc: the random source failed to produce a handshake nonce");
  return nonce;
}

std::string hmac_sha256(const std::string& secret, const std::string& data) {
  std::string mac(32, '\0');
  unsigned int length = 0;
  // An empty key still needs a valid pointer.
  static const unsigned char kNoKey = 0;
  const unsigned char* key =
      secret.empty() ? &kNoKey : reinterpret_cast<const unsigned char*>(secret.data());
  TORCH_CHECK(HMAC(EVP_sha256(), key, static_cast<int>(secret.size()),
                   reinterpret_cast<const unsigned char*>(data.data()), data.size(),
                   reinterpret_cast<unsigned char*>(mac.data()), &length) != nullptr &&
                  length == mac.size(),
              "rpc: HMAC-SHA256 failed");
  return mac;
}

namespace {

// What a proof and a signature cover: the role and everything the handshake agreed on, in
// fixed-size fields only, so that no two different inputs encode the same.
std::string handshake_transcript(HandshakeRole role, const std::string& server_nonce,
                                 const std::string& client_nonce, int32_t client_id,
                                 int32_t server_id) {
  std::string data = role == HandshakeRole::kConnecting ? "distoptim-rpc-handshake/1 connecting"
                                                        : "distoptim-rpc-handshake/1 accepting ";
  TORCH_INTERNAL_ASSERT(server_nonce.size() == HandshakeMessage::kNonceBytes &&
                        client_nonce.size() == HandshakeMessage::kNonceBytes);
  data += server_nonce;
  data += client_nonce;
  append_u32(&data, static_cast<uint32_t>(client_id));
  append_u32(&data, static_cast<uint32_t>(server_id));
  return data;
}

}  // namespace

std::string handshake_proof(const std::string& secret, HandshakeRole role,
                            const std::string& server_nonce, const std::string& client_nonce,
                            int32_t client_id, int32_t server_id) {
  std::string proof = hmac_sha256(
      secret, handshake_transcript(role, server_nonce, client_nonce, client_id, server_id));
  TORCH_INTERNAL_ASSERT(proof.size() == HandshakeMessage::kProofBytes);
  return proof;
}

std::string handshake_signature(const MemberKey& key, HandshakeRole role,
                                const std::string& server_nonce, const std::string& client_nonce,
                                int32_t client_id, int32_t server_id) {
  return key.sign(handshake_transcript(role, server_nonce, client_nonce, client_id, server_id));
}

bool proofs_equal(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

void accept_handshake(const std::shared_ptr<Connection>& connection, const HandshakeConfig& config,
                      std::function<void(HandshakeOutcome)> done) {
  using Step = HandshakeMessage::Step;
  done = once(std::move(done));
  if (std::optional<std::string> why = foreign_peer(connection.get(), config)) {
    connection->close_after(refusal(connection.get(), config, *why), "refused: " + *why);
    done(failed(*why, /*refused=*/true));
    return;
  }
  HandshakeMessage question;
  question.step = Step::kChallenge;
  question.server_nonce = random_nonce();
  question.server_id = config.self_id;
  // The nonce at a fixed address for the peer to read, kept as long as the handshake runs.
  auto probe = std::make_shared<const std::string>(question.server_nonce);
  offer_peer_memory(config, *probe, &question);
  connection->arm_deadline(config.timeout, deadline_text(config));
  connection->send(encode_handshake(question));
  Connection* raw = connection.get();  // The handlers run only while the connection lives.
  // A peer that breaks the framing (a request before the proof, an absurd length) hears why.
  connection->set_farewell(
      [raw, config](const std::string& why) { return refusal(raw, config, why); });
  auto on_frame = [raw, config, question, probe, done](Frame frame) {
    HandshakeMessage answer;
    std::string why;
    if (Status failure = decode_handshake_frame(frame, &answer)) {
      why = "it sent " + *failure;
    } else if (answer.step != Step::kProof || answer.server_nonce != question.server_nonce ||
               answer.server_id != config.self_id) {
      why = "its answer is not a proof for this worker's challenge";
    } else if (std::optional<std::string> bad_id =
                   config.refuse_id ? config.refuse_id(answer.client_id) : std::nullopt) {
      why = *bad_id;
    } else if (!proofs_equal(
                   answer.proof,
                   handshake_proof(config.secret, HandshakeRole::kConnecting, question.server_nonce,
                                   answer.client_nonce, answer.client_id, config.self_id))) {
      why = "it did not prove that it knows the shared secret";
    }
    if (!why.empty()) {
      raw->close_after(refusal(raw, config, why), "refused: " + why);
      done(failed(why, /*refused=*/true));
      return false;
    }
    // The secret is proven; which member it is, by the key that id published (which may have to
    // be read from the store first: reading stays paused meanwhile).
    std::weak_ptr<Connection> weak = raw->shared_from_this();
    config.member_key(answer.client_id, [weak, config, question, probe, answer, done](
                                            std::optional<std::string> key,
                                            const std::string& no_key) {
      auto connection = weak.lock();
      if (!connection || connection->closed()) return;  // its close already ran `done`
      Connection* raw = connection.get();
      std::string why;
      if (!key) {
        why =
            "worker id " + std::to_string(answer.client_id) + " has no member key here: " + no_key;
      } else if (!member_signature_valid(
                     *key,
                     handshake_transcript(HandshakeRole::kConnecting, question.server_nonce,
                                          answer.client_nonce, answer.client_id, config.self_id),
                     answer.signature)) {
        why = "it proved the shared secret but not the member key worker id " +
              std::to_string(answer.client_id) + " published (another process claims its id)";
      } else if (config.admit) {
        why = config.admit(raw, answer.client_id).value_or("");
      }
      if (!why.empty()) {
        raw->close_after(refusal(raw, config, why), "refused: " + why);
        done(failed(why, /*refused=*/true));
        return;
      }
      HandshakeMessage accept;
      accept.step = Step::kAccept;
      accept.proof =
          handshake_proof(config.secret, HandshakeRole::kAccepting, question.server_nonce,
                          answer.client_nonce, answer.client_id, config.self_id);
      accept.signature =
          handshake_signature(*config.own_key, HandshakeRole::kAccepting, question.server_nonce,
                              answer.client_nonce, answer.client_id, config.self_id);
      accept.reads_peer = answer.reads_peer && reads_peer(config, answer, answer.client_nonce);
      raw->disarm_deadline();
      raw->send(encode_handshake(accept));
      HandshakeOutcome outcome;
      outcome.accepted = true;
      outcome.peer = answer.client_id;
      outcome.peer_memory = accept.reads_peer;
      outcome.peer_pid = answer.pid;
      done(std::move(outcome));
    });
    return false;
  };
  connection->read_frames(handshake_limits(), std::move(on_frame),
                          [done](const std::string& why) { done(failed(why)); });
}

namespace {

// The connecting side, once the key worker `peer` published is known.
void prove_to(const std::shared_ptr<Connection>& connection, const HandshakeConfig& config,
              int peer, const std::string& peer_key, std::function<void(HandshakeOutcome)> done) {
  using Step = HandshakeMessage::Step;
  connection->arm_deadline(config.timeout, deadline_text(config));
  Connection* raw = connection.get();
  auto answer = std::make_shared<HandshakeMessage>();  // our proof, once the challenge is in
  auto peer_pid = std::make_shared<int32_t>(0);
  auto on_frame = [raw, config, peer, peer_key, answer, peer_pid, done](Frame frame) {
    HandshakeMessage message;
    Status failure = decode_handshake_frame(frame, &message);
    if (answer->step != Step::kProof) {
      if (!failure && message.step == Step::kRefuse) {  // refused before any challenge
        const std::string why =
            message.refusal.empty() ? "it refused the connection" : message.refusal;
        done(failed(why, /*refused=*/true));
        raw->close(why);
        return false;
      }
      if (!failure && (message.step != Step::kChallenge || message.server_id != peer)) {
        failure = "a handshake that is not a challenge from worker id " + std::to_string(peer);
      }
      if (failure) {
        raw->close("it broke the handshake: it sent " + *failure);
        return false;
      }
      answer->step = Step::kProof;
      answer->server_nonce = message.server_nonce;
      answer->client_nonce = random_nonce();
      answer->client_id = config.self_id;
      answer->server_id = peer;
      answer->proof =
          handshake_proof(config.secret, HandshakeRole::kConnecting, answer->server_nonce,
                          answer->client_nonce, config.self_id, peer);
      answer->signature =
          handshake_signature(*config.own_key, HandshakeRole::kConnecting, answer->server_nonce,
                              answer->client_nonce, config.self_id, peer);
      answer->reads_peer = reads_peer(config, message, message.server_nonce);
      *peer_pid = message.pid;
      // answer->client_nonce stays where it is until the handshake ends: the peer may read it.
      offer_peer_memory(config, answer->client_nonce, answer.get());
      raw->send(encode_handshake(*answer));
      return true;
    }
    std::string why;
    bool refused = true;
    if (failure) {
      why = "it broke the handshake: it sent " + *failure;
    } else if (message.step == Step::kRefuse) {
      why = message.refusal.empty() ? "it refused the connection" : message.refusal;
    } else if (message.step != Step::kAccept ||
               !proofs_equal(
                   message.proof,
                   handshake_proof(config.secret, HandshakeRole::kAccepting, answer->server_nonce,
                                   answer->client_nonce, config.self_id, peer))) {
      why = "it did not prove that it knows the shared secret";
    } else if (!member_signature_valid(
                   peer_key,
                   handshake_transcript(HandshakeRole::kAccepting, answer->server_nonce,
                                        answer->client_nonce, config.self_id, peer),
                   message.signature)) {
      why = "it proved the shared secret but not the member key worker id " + std::to_string(peer) +
            " published (another process answers at its address)";
    } else {
      refused = false;
    }
    if (refused) {
      done(failed(why, /*refused=*/true));
      raw->close(why);
      return false;
    }
    raw->disarm_deadline();
    HandshakeOutcome outcome;
    outcome.accepted = true;
    outcome.peer = peer;
    outcome.peer_memory = answer->reads_peer && message.reads_peer;
    outcome.peer_pid = *peer_pid;
    done(std::move(outcome));
    return false;
  };
  connection->read_frames(handshake_limits(), std::move(on_frame),
                          [done](const std::string& why) { done(failed(why)); });
}

}  // namespace

void connect_handshake(const std::shared_ptr<Connection>& connection, const HandshakeConfig& config,
                       int peer, std::function<void(HandshakeOutcome)> done) {
  done = once(std::move(done));
  if (std::optional<std::string> why = foreign_peer(connection.get(), config)) {
    done(failed(*why, /*refused=*/true));
    connection->close(*why);
    return;
  }
  config.member_key(peer, [connection, config, peer, done](std::optional<std::string> key,
                                                           const std::string& no_key) {
    if (!key) {
      const std::string why =
          "worker id " + std::to_string(peer) + " has no member key here: " + no_key;
      done(failed(why, /*refused=*/true));
      connection->close(why);
      return;
    }
    prove_to(connection, config, peer, *key, done);
  });
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
