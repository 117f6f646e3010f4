#pragma once

// What the two files of the handshake tests share: handshake_test.cpp (proofs, forged records,
// hostile bytes) and secret_test.cpp (workers configured with different secrets, or none).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>

#include <distoptim/rpc.h>

namespace distoptim {
namespace rpc {
namespace handshake_test {

/// How many times the rpc function "record" (registered by handshake_test.cpp, which every build
/// of these tests has) ran in this process since rank 0 last ran a body in the test process
/// (which then counts anew, as a rank's own process would). "recorded" returns it.
extern std::atomic<int64_t> g_recorded;

/// env:// options with `secret`; start-up and shutdown bounded by 30 s, calls by 20 s.
inline RpcBackendOptions options_with_secret(const std::string& secret) {
  using namespace std::chrono_literals;
  return RpcBackendOptions("env://")
      .init_timeout(30s)
      .shutdown_timeout(30s)
      .rpc_timeout(20s)
      .shared_secret(secret);
}

/// The message of the PeerLostError `call` throws, or what it did instead.
inline std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const PeerLostError& error) {
    return error.what_without_backtrace();
  } catch (const std::exception& other) {
    return std::string("an unexpected exception: ") + other.what();
  }
  return "no exception";
}

}  // namespace handshake_test
}  // namespace rpc
}  // namespace distoptim
