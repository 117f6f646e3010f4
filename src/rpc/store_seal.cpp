#include "store_seal.h"

#include "handshake.h"
#include "member_key.h"

namespace distoptim {
namespace rpc {
namespace detail {

namespace {

constexpr const char* kSealTag = "\nhmac-sha256:";

std::string mac_hex(const std::string& secret, const std::string& key, const std::string& payload) {
  // Lengths first, so that no (key, payload) pair encodes as another.
  const std::string data = "distoptim-rpc-store/1 " + std::to_string(key.size()) + " " +
                           std::to_string(payload.size()) + " " + key + payload;
  return to_hex(hmac_sha256(secret, data));
}

}  // namespace

std::vector<uint8_t> seal(const std::string& secret, const std::string& key,
                          const std::string& payload) {
  const std::string value =
      secret.empty() ? payload : payload + kSealTag + mac_hex(secret, key, payload);
  return {value.begin(), value.end()};
}

std::optional<std::string> unseal(const std::string& secret, const std::string& key,
                                  const std::vector<uint8_t>& value) {
  const std::string text(value.begin(), value.end());
  if (secret.empty()) return text;
  const size_t at = text.rfind(kSealTag);
  if (at == std::string::npos) return std::nullopt;
  const std::string payload = text.substr(0, at);
  const std::string mac = text.substr(at + std::string(kSealTag).size());
  if (!proofs_equal(mac, mac_hex(secret, key, payload))) return std::nullopt;
  return payload;
}

std::string unverified_payload(const std::vector<uint8_t>& value) {
  const std::string text(value.begin(), value.end());
  return text.substr(0, text.rfind(kSealTag));
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
