#include "handshake.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <c10/util/Exception.h>

#include "message.h"

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

void append_u32(std::string* out, uint32_t value) {
  for (int byte = 0; byte < 4; ++byte) {
    out->push_back(static_cast<char>((value >> (8 * byte)) & 0xff));
  }
}

}  // namespace

std::string random_nonce() {
  std::string nonce(HandshakeMessage::kNonceBytes, '\0');
  TORCH_CHECK(RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()),
                         static_cast<int>(nonce.size())) == 1,
              "rpc: the random source failed to produce a handshake nonce");
  return nonce;
}

std::string handshake_proof(const std::string& secret, HandshakeRole role,
                            const std::string& server_nonce, const std::string& client_nonce,
                            int32_t client_id, int32_t server_id) {
  // Fixed-size fields only, so no two different inputs encode the same.
  std::string data = role == HandshakeRole::kConnecting ? "distoptim-rpc-handshake/1 connecting"
                                                        : "distoptim-rpc-handshake/1 accepting ";
  TORCH_INTERNAL_ASSERT(server_nonce.size() == HandshakeMessage::kNonceBytes &&
                        client_nonce.size() == HandshakeMessage::kNonceBytes);
  data += server_nonce;
  data += client_nonce;
  append_u32(&data, static_cast<uint32_t>(client_id));
  append_u32(&data, static_cast<uint32_t>(server_id));
  std::string proof(HandshakeMessage::kProofBytes, '\0');
  unsigned int length = 0;
  // An empty key still needs a valid pointer.
  static const unsigned char kNoKey = 0;
  const unsigned char* key =
      secret.empty() ? &kNoKey : reinterpret_cast<const unsigned char*>(secret.data());
  TORCH_CHECK(HMAC(EVP_sha256(), key, static_cast<int>(secret.size()),
                   reinterpret_cast<const unsigned char*>(data.data()), data.size(),
                   reinterpret_cast<unsigned char*>(proof.data()), &length) != nullptr &&
                  length == proof.size(),
              "rpc: HMAC-SHA256 failed");
  return proof;
}

bool proofs_equal(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
