#pragma once

// Same-host memory reads: a worker reads a large tensor straight out of a peer process's memory
// (Linux cross-memory attach, process_vm_readv) instead of through the TCP stream, one copy
// instead of two through the kernel's socket buffers. The peer proves at the handshake that this
// works (handshake.h: each side reads the other's nonce at the address it announced), so a peer
// on another host, in another PID namespace, or where the kernel forbids it (ptrace rules,
// seccomp) simply keeps using the stream.

#include <cstddef>
#include <cstdint>
#include <string>

#include "../message.h"

namespace distoptim {
namespace rpc {
namespace detail {

/// This process's id as the handshake announces it.
int32_t own_pid();

/// Whether `expected.size()` bytes at `address` in process `pid` equal `expected`.
bool peer_memory_holds(int32_t pid, uint64_t address, const std::string& expected);

/// Reads `length` bytes at `address` in process `pid` into `into`; an error text if the peer's
/// memory does not hold that range (or the process is gone).
Status read_peer_memory(int32_t pid, uint64_t address, void* into, size_t length);

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
