// Reading a same-host peer's memory (process_vm_readv), with errors that say what was missing.

#include "peer_memory.h"

#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <c10/util/StringUtil.h>

namespace distoptim {
namespace rpc {
namespace detail {

int32_t own_pid() { return static_cast<int32_t>(::getpid()); }

bool peer_memory_holds(int32_t pid, uint64_t address, const std::string& expected) {
  if (pid <= 0 || address == 0 || expected.empty()) {
    return false;
  }
  std::vector<char> seen(expected.size());
  return !read_peer_memory(pid, address, seen.data(), seen.size()) &&
         std::memcmp(seen.data(), expected.data(), seen.size()) == 0;
}

Status read_peer_memory(int32_t pid, uint64_t address, void* into, size_t length) {
  size_t done = 0;
  while (done < length) {
    iovec local{static_cast<char*>(into) + done, length - done};
    iovec remote{reinterpret_cast<void*>(static_cast<uintptr_t>(address + done)), length - done};
    const ssize_t got = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (got < 0 && errno == EINTR) {
      continue;
    }
    if (got <= 0) {
      // A partial read stops where the peer's mapping ends: the next attempt fails there.
      return c10::str("no ", length, " readable bytes at 0x", std::hex, address, std::dec,
                      " in process ", pid, " (",
                      got < 0 ? std::strerror(errno) : "end of its mapping", ")");
    }
    done += static_cast<size_t>(got);
  }
  return std::nullopt;
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
