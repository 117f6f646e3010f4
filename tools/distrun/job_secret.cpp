#include "distrun/job_secret.h"

#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include <fmt/core.h>

namespace distoptim {
namespace launcher {

namespace {

constexpr size_t kSecretBytes = 32;

std::runtime_error system_error(const std::string& what, const std::string& path) {
  return std::runtime_error(fmt::format("cannot make the job's RPC secret: {} '{}': {}", what, path,
                                        std::strerror(errno)));
}

}  // namespace

JobSecret::JobSecret() {
  const char* tmpdir = std::getenv("TMPDIR");
  std::string pattern = std::string(tmpdir && *tmpdir ? tmpdir : "/tmp") + "/distrun-XXXXXX";
  std::vector<char> buffer(pattern.begin(), pattern.end());
  buffer.push_back('\0');
  // mkdtemp makes the directory with mode 0700: no other user can list or open what it holds.
  if (::mkdtemp(buffer.data()) == nullptr) throw system_error("mkdtemp", pattern);
  directory_ = buffer.data();
  path_ = directory_ + "/rpc_secret";

  std::array<unsigned char, kSecretBytes> bytes{};
  size_t filled = 0;
  while (filled < bytes.size()) {
    const ssize_t n = ::getrandom(bytes.data() + filled, bytes.size() - filled, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::rmdir(directory_.c_str());
      throw system_error("getrandom for", path_);
    }
    filled += static_cast<size_t>(n);
  }
  std::string hex;
  for (unsigned char b : bytes) hex += fmt::format("{:02x}", b);

  const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    ::rmdir(directory_.c_str());
    throw system_error("open", path_);
  }
  size_t done = 0;
  while (done < hex.size()) {
    const ssize_t n = ::write(fd, hex.data() + done, hex.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  const bool complete = done == hex.size();
  const bool closed = ::close(fd) == 0;
  if (!complete || !closed) {
    ::unlink(path_.c_str());
    ::rmdir(directory_.c_str());
    throw system_error("write", path_);
  }
}

JobSecret::~JobSecret() {
  ::unlink(path_.c_str());
  ::rmdir(directory_.c_str());
}

}  // namespace launcher
}  // namespace distoptim
