#include "member_key.h"

#include <openssl/evp.h>

#include <c10/util/Exception.h>

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

std::shared_ptr<EVP_PKEY> owned(EVP_PKEY* key) { return {key, EVP_PKEY_free}; }

std::string raw_public_key(EVP_PKEY* key) {
  std::string bytes(MemberKey::kPublicKeyBytes, '\0');
  size_t length = bytes.size();
  TORCH_CHECK(EVP_PKEY_get_raw_public_key(key, reinterpret_cast<unsigned char*>(bytes.data()),
                                          &length) == 1 &&
                  length == bytes.size(),
              "rpc: OpenSSL could not read a member key's public half");
  return bytes;
}

const unsigned char* bytes_of(const std::string& text) {
  return reinterpret_cast<const unsigned char*>(text.data());
}

}  // namespace

MemberKey::MemberKey(std::shared_ptr<EVP_PKEY> key)
    : key_(std::move(key)), public_key_(raw_public_key(key_.get())) {}

MemberKey MemberKey::generate() {
  std::unique_ptr<EVP_PKEY_CTX, decltype(&EVP_PKEY_CTX_free)> context(
      EVP_PKEY_CTX_new_id(EVP_PKEY_ED25519, nullptr), EVP_PKEY_CTX_free);
  EVP_PKEY* key = nullptr;
  TORCH_CHECK(context && EVP_PKEY_keygen_init(context.get()) == 1 &&
                  EVP_PKEY_keygen(context.get(), &key) == 1,
              "rpc: OpenSSL could not make a member key (Ed25519)");
  return MemberKey(owned(key));
}

MemberKey MemberKey::from_private_key(const std::string& private_key) {
  TORCH_CHECK_VALUE(private_key.size() == kPublicKeyBytes, "rpc: a member's private key has ",
                    kPublicKeyBytes, " bytes, not ", private_key.size());
  EVP_PKEY* key = EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, nullptr, bytes_of(private_key),
                                               private_key.size());
  TORCH_CHECK(key != nullptr, "rpc: OpenSSL could not read a member's private key");
  return MemberKey(owned(key));
}

std::string MemberKey::private_key() const {
  std::string bytes(kPublicKeyBytes, '\0');
  size_t length = bytes.size();
  TORCH_CHECK(EVP_PKEY_get_raw_private_key(
                  key_.get(), reinterpret_cast<unsigned char*>(bytes.data()), &length) == 1 &&
                  length == bytes.size(),
              "rpc: OpenSSL could not read a member key's private half");
  return bytes;
}

std::string MemberKey::sign(const std::string& data) const {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> context(EVP_MD_CTX_new(),
                                                                  EVP_MD_CTX_free);
  std::string signature(kSignatureBytes, '\0');
  size_t length = signature.size();
  // Ed25519 signs the message itself: no digest is named.
  TORCH_CHECK(context &&
                  EVP_DigestSignInit(context.get(), nullptr, nullptr, nullptr, key_.get()) == 1 &&
                  EVP_DigestSign(context.get(), reinterpret_cast<unsigned char*>(signature.data()),
                                 &length, bytes_of(data), data.size()) == 1 &&
                  length == signature.size(),
              "rpc: OpenSSL could not sign with the member key");
  return signature;
}

bool member_signature_valid(const std::string& public_key, const std::string& data,
                            const std::string& signature) {
  if (public_key.size() != MemberKey::kPublicKeyBytes ||
      signature.size() != MemberKey::kSignatureBytes) {
    return false;
  }
  const std::shared_ptr<EVP_PKEY> key = owned(EVP_PKEY_new_raw_public_key(
      EVP_PKEY_ED25519, nullptr, bytes_of(public_key), public_key.size()));
  if (!key) return false;
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> context(EVP_MD_CTX_new(),
                                                                  EVP_MD_CTX_free);
  return context &&
         EVP_DigestVerifyInit(context.get(), nullptr, nullptr, nullptr, key.get()) == 1 &&
         EVP_DigestVerify(context.get(), bytes_of(signature), signature.size(), bytes_of(data),
                          data.size()) == 1;
}

std::string to_hex(const std::string& bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * bytes.size());
  for (unsigned char byte : bytes) {
    hex += kDigits[byte >> 4];
    hex += kDigits[byte & 15];
  }
  return hex;
}

std::optional<std::string> from_hex(const std::string& hex) {
  if (hex.size() % 2 != 0) return std::nullopt;
  const auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  std::string bytes;
  bytes.reserve(hex.size() / 2);
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int high = digit(hex[i]);
    const int low = digit(hex[i + 1]);
    if (high < 0 || low < 0) return std::nullopt;
    bytes.push_back(static_cast<char>(high * 16 + low));
  }
  return bytes;
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
