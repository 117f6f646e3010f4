#pragma once

// A worker's own identity key: an Ed25519 key pair made at init_rpc, whose private half never
// leaves the process. Its public half is published in the worker's record in the group's store
// (group.h) and fixed there by the first record of that worker id (member_keys.h); every
// connection handshake (handshake.h) is signed with it, so that a process that knows the job's
// shared secret still cannot prove another worker's id. OpenSSL's libcrypto does the signing.

#include <memory>
#include <optional>
#include <string>

struct evp_pkey_st;

namespace distoptim {
namespace rpc {
namespace detail {

class MemberKey {
 public:
  static constexpr size_t kPublicKeyBytes = 32;  // Ed25519
  static constexpr size_t kSignatureBytes = 64;

  /// A fresh key pair from the operating system's random source.
  static MemberKey generate();
  /// The key pair whose private half is `private_key` (kPublicKeyBytes raw bytes, as
  /// private_key() returns); c10::ValueError for another size.
  static MemberKey from_private_key(const std::string& private_key);

  /// The public half, kPublicKeyBytes raw bytes.
  const std::string& public_key() const { return public_key_; }
  /// The private half, raw. Only for tests that play a member whose key has leaked.
  std::string private_key() const;
  /// The signature of `data` (kSignatureBytes).
  std::string sign(const std::string& data) const;

 private:
  explicit MemberKey(std::shared_ptr<evp_pkey_st> key);

  std::shared_ptr<evp_pkey_st> key_;
  std::string public_key_;
};

/// Whether `signature` is a valid signature of `data` under `public_key` (raw bytes); false for
/// keys and signatures of the wrong size.
bool member_signature_valid(const std::string& public_key, const std::string& data,
                            const std::string& signature);

/// The running agent's own member key (DistributedError without one). Only for tests that play
/// a member whose key has leaked.
std::shared_ptr<const MemberKey> current_member_key();

/// Lower-case hex of `bytes`, and back (nullopt for anything but an even count of hex digits).
std::string to_hex(const std::string& bytes);
std::optional<std::string> from_hex(const std::string& hex);

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
