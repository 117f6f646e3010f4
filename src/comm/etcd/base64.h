#pragma once

// Base64 (RFC 4648, standard alphabet, padded): how etcd's JSON gateway carries keys and values.

#include <optional>
#include <string>

namespace distoptim {
namespace comm {
namespace etcd {

std::string base64_encode(const std::string& bytes);

/// The bytes `text` encodes, or nullopt when it is not padded standard base64 (the gateway's
/// answers are untrusted: a bad character or length is an error, never skipped).
std::optional<std::string> base64_decode(const std::string& text);

}  // namespace etcd
}  // namespace comm
}  // namespace distoptim
