#pragma once

// Which user's process holds the other end of a connection, when that process runs on this
// machine: the kernel's word, never the peer's. A worker without a shared secret accepts only
// processes of its own user on its own machine (RpcBackendOptions::insecure_without_secret), and
// this is how it knows. A Unix-domain socket carries its peer's credentials (SO_PEERCRED). A TCP
// connection's other end, if it is on this machine (in this network namespace), is a socket the
// kernel knows with its owner's uid: the one whose local address is our remote one and whose
// remote address is our local one. It is asked for that one socket by the kernel's socket
// diagnostics (NETLINK_SOCK_DIAG, as `ss` asks), a cost that does not grow with the machine's
// sockets; only where those cannot be asked are /proc/net/tcp and tcp6 read, line by line. A
// peer on another machine, or one that closed before the look, has no socket here: no user.

#include <cstdint>
#include <optional>

namespace distoptim {
namespace rpc {
namespace detail {

/// The user at the other end of the connected socket `fd`: for a Unix-domain socket the peer
/// process's effective uid (SO_PEERCRED), for a TCP one the owner of the socket at the other end
/// if that socket is on this machine; nullopt when the kernel does not say.
std::optional<uint32_t> peer_user(int fd);

/// The two ways peer_user finds a TCP peer's user, each on its own (for tests).
enum class PeerLookup { kSockDiag, kProcTable };
std::optional<uint32_t> tcp_peer_user(int fd, PeerLookup how);

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
