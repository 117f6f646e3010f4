#pragma once

// The RPC secret distrun makes for a job whose ranks all run on this node, so that a job started
// with distrun is authenticated by default: only processes that can read the secret's file (its
// owner's) pass the RPC handshake (docs/rpc.md). Each rank finds the file's path in
// DISTOPTIM_RPC_SECRET_FILE, which init_rpc reads when no shared_secret is given; the secret
// itself never appears in a command line or an environment.

#include <string>

namespace distoptim {
namespace launcher {

/// The variable that names the secret's file to the ranks (read by rpc::init_rpc).
constexpr const char* kRpcSecretFileVariable = "DISTOPTIM_RPC_SECRET_FILE";

/// A fresh secret (32 bytes from the kernel's random source, as 64 hex digits) in a file only
/// this user can read, in a directory of its own under $TMPDIR (or /tmp); both are removed when
/// the object is destroyed. Throws std::runtime_error naming the path if it cannot be made.
class JobSecret {
 public:
  JobSecret();
  ~JobSecret();
  JobSecret(const JobSecret&) = delete;
  JobSecret& operator=(const JobSecret&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string directory_;
  std::string path_;
};

}  // namespace launcher
}  // namespace distoptim
