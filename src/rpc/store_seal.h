#pragma once

// What a worker writes to its group's store (addresses, member keys, names, a dynamic group's list
// of joins and left marks, a shutdown barrier's failure), sealed with the job's shared secret, so
// that a process that can reach the store but does not know the secret cannot redirect a worker (a
// forged address), impersonate one (a forged record or name) or have it dropped (a forged left
// mark): a reader takes only values whose seal verifies. A sealed value is the payload, a newline,
// "hmac-sha256:" and 64 hex digits of HMAC-SHA256(secret, "distoptim-rpc-store/1", key, payload),
// so a value sealed for one key is worthless under another. Without a secret (a job that has none)
// values are written and read as they are. What sealing cannot stop: a process that reaches the
// store can delete or overwrite a value, which readers then find forged (and say so) or missing;
// counters (store.add: a dynamic group's count of joins, a barrier's arrivals) carry no seal.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace distoptim {
namespace rpc {
namespace detail {

/// `payload` sealed for `key` under `secret` (as it is when `secret` is empty).
std::vector<uint8_t> seal(const std::string& secret, const std::string& key,
                          const std::string& payload);

/// The payload of `value` read under `key`, or nullopt when its seal does not verify under
/// `secret` (missing, malformed, or made for another key or with another secret). With an empty
/// `secret`, `value` as it is.
std::optional<std::string> unseal(const std::string& secret, const std::string& key,
                                  const std::vector<uint8_t>& value);

/// The payload of `value` without checking its seal (`value` itself when it has none): only to
/// name what a value that does not verify claims.
std::string unverified_payload(const std::vector<uint8_t>& value);

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
