#include "peer_user.h"

#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

namespace distoptim {
namespace rpc {
namespace detail {

namespace {

// An endpoint as /proc/net/tcp6 spells addresses: 16 bytes, an IPv4 address mapped into IPv6.
struct Endpoint {
  std::array<uint8_t, 16> address{};
  uint16_t port = 0;
  bool operator==(const Endpoint& other) const {
    return address == other.address && port == other.port;
  }
};

// A TCP endpoint (IPv4 or IPv6) as /proc/net/tcp6 would list it; false for another family.
bool endpoint_of(const sockaddr_storage& address, Endpoint* out) {
  if (address.ss_family == AF_INET) {
    const auto& v4 = reinterpret_cast<const sockaddr_in&>(address);
    out->address = {};
    out->address[10] = out->address[11] = 0xff;
    std::memcpy(out->address.data() + 12, &v4.sin_addr, 4);
    out->port = ntohs(v4.sin_port);
    return true;
  }
  if (address.ss_family == AF_INET6) {
    const auto& v6 = reinterpret_cast<const sockaddr_in6&>(address);
    std::memcpy(out->address.data(), &v6.sin6_addr, 16);
    out->port = ntohs(v6.sin6_port);
    return true;
  }
  return false;
}

// "0100007F:1F90" (tcp: the address's 4 bytes as one native-endian word in hex) or 32 hex
// digits (tcp6: four such words), then the port in hex. False on anything else.
bool parse_endpoint(const std::string& text, Endpoint* out) {
  const size_t colon = text.find(':');
  if (colon == std::string::npos || (colon != 8 && colon != 32)) return false;
  std::array<uint8_t, 16> bytes{};
  const size_t words = colon / 8;
  for (size_t w = 0; w < words; ++w) {
    char* end = nullptr;
    const std::string digits = text.substr(w * 8, 8);
    const uint32_t word = static_cast<uint32_t>(std::strtoul(digits.c_str(), &end, 16));
    if (end != digits.c_str() + 8) return false;
    // The kernel prints each 32-bit word of the address as it lies in memory, read as a
    // native-endian integer: copying the integer's bytes back gives the address's bytes.
    const size_t at = words == 1 ? 12 : w * 4;
    std::memcpy(bytes.data() + at, &word, sizeof(word));
  }
  if (words == 1) bytes[10] = bytes[11] = 0xff;  // v4-mapped
  char* end = nullptr;
  const std::string port = text.substr(colon + 1);
  const unsigned long value = std::strtoul(port.c_str(), &end, 16);
  if (port.empty() || *end != '\0' || value > 0xffff) return false;
  out->address = bytes;
  out->port = static_cast<uint16_t>(value);
  return true;
}

// The uid of the socket listed in `table` (/proc/net/tcp or tcp6) as local `local`, remote
// `remote`.
std::optional<uint32_t> owner_in(const char* table, const Endpoint& local, const Endpoint& remote) {
  std::ifstream in(table);
  std::string line;
  std::getline(in, line);  // the header
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string slot, local_text, remote_text, state, queues, timer, retransmits;
    uint32_t uid = 0;
    if (!(fields >> slot >> local_text >> remote_text >> state >> queues >> timer >> retransmits >>
          uid)) {
      continue;
    }
    Endpoint listed_local, listed_remote;
    if (parse_endpoint(local_text, &listed_local) && parse_endpoint(remote_text, &listed_remote) &&
        listed_local == local && listed_remote == remote) {
      return uid;
    }
  }
  return std::nullopt;
}

// Whether `endpoint` is an IPv4 address (mapped into IPv6 as above).
bool is_v4(const Endpoint& endpoint) {
  static const std::array<uint8_t, 12> kMapped{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::equal(kMapped.begin(), kMapped.end(), endpoint.address.begin());
}

// Closes a file descriptor when it goes.
struct OwnedFd {
  int fd;
  ~OwnedFd() {
    if (fd >= 0) ::close(fd);
  }
};

// What the kernel's socket diagnostics say of the TCP socket whose local end is `local` and
// remote end `remote`: one lookup by the four addresses (NETLINK_SOCK_DIAG, as ss asks),
// however many sockets the machine holds.
struct DiagAnswer {
  bool answered = false;        // false: the kernel's diagnostics could not be asked
  std::optional<uint32_t> uid;  // nullopt: no such socket in this network namespace
};
DiagAnswer ask_sock_diag(const Endpoint& local, const Endpoint& remote) {
  DiagAnswer answer;
  const OwnedFd netlink{::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG)};
  if (netlink.fd < 0) return answer;
  // The kernel answers at once; the bound is for a kernel that does not.
  const timeval bound{1, 0};
  ::setsockopt(netlink.fd, SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof(bound));
  struct {
    nlmsghdr header;
    inet_diag_req_v2 request;
  } message{};
  message.header.nlmsg_len = sizeof(message);
  message.header.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  message.header.nlmsg_flags = NLM_F_REQUEST;  // one socket, not a dump
  inet_diag_req_v2& request = message.request;
  request.sdiag_protocol = IPPROTO_TCP;
  request.idiag_states = ~0u;
  // IPv4 ends, mapped or not, are looked up as IPv4: a dual-stack socket's IPv4 connections are
  // among the IPv4 sockets.
  const bool v4 = is_v4(local) && is_v4(remote);
  request.sdiag_family = v4 ? AF_INET : AF_INET6;
  const size_t from = v4 ? 12 : 0, bytes = v4 ? 4 : 16;
  std::memcpy(request.id.idiag_src, local.address.data() + from, bytes);
  std::memcpy(request.id.idiag_dst, remote.address.data() + from, bytes);
  request.id.idiag_sport = htons(local.port);
  request.id.idiag_dport = htons(remote.port);
  request.id.idiag_cookie[0] = request.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  if (::sendto(netlink.fd, &message, sizeof(message), 0, reinterpret_cast<sockaddr*>(&kernel),
               sizeof(kernel)) != static_cast<ssize_t>(sizeof(message))) {
    return answer;
  }
  alignas(nlmsghdr) char buffer[8192];
  const ssize_t received = ::recv(netlink.fd, buffer, sizeof(buffer), 0);
  if (received <= 0) return answer;
  const auto* reply = reinterpret_cast<const nlmsghdr*>(buffer);
  // NLMSG_OK's test, without its comparison of signed and unsigned: the header arrived whole and
  // the length it claims lies within what arrived.
  const auto length = static_cast<size_t>(received);
  if (length < sizeof(nlmsghdr) || reply->nlmsg_len < sizeof(nlmsghdr) ||
      reply->nlmsg_len > length) {
    return answer;
  }
  if (reply->nlmsg_type == NLMSG_ERROR) {
    if (reply->nlmsg_len < NLMSG_LENGTH(sizeof(nlmsgerr))) return answer;
    const auto* error = static_cast<const nlmsgerr*>(NLMSG_DATA(reply));
    // No such socket: the other end is not on this machine, or is gone.
    answer.answered = error->error == -ENOENT;
    return answer;
  }
  if (reply->nlmsg_type != SOCK_DIAG_BY_FAMILY ||
      reply->nlmsg_len < NLMSG_LENGTH(sizeof(inet_diag_msg))) {
    return answer;
  }
  answer.answered = true;
  answer.uid = static_cast<const inet_diag_msg*>(NLMSG_DATA(reply))->idiag_uid;
  return answer;
}

// The TCP connection `fd`'s two ends as the peer's socket sees them: its local end is our remote
// one. False when `fd` is no connected TCP socket.
bool peer_ends(int fd, Endpoint* peer_local, Endpoint* peer_remote) {
  sockaddr_storage ours{}, theirs{};
  socklen_t size = sizeof(ours);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ours), &size) != 0) return false;
  size = sizeof(theirs);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&theirs), &size) != 0) return false;
  return endpoint_of(theirs, peer_local) && endpoint_of(ours, peer_remote);
}

}  // namespace

std::optional<uint32_t> tcp_peer_user(int fd, PeerLookup how) {
  Endpoint local, remote;
  if (!peer_ends(fd, &local, &remote)) return std::nullopt;
  if (how == PeerLookup::kSockDiag) return ask_sock_diag(local, remote).uid;
  if (auto uid = owner_in("/proc/net/tcp", local, remote)) return uid;
  return owner_in("/proc/net/tcp6", local, remote);
}

std::optional<uint32_t> peer_user(int fd) {
  sockaddr_storage ours{};
  socklen_t size = sizeof(ours);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ours), &size) != 0) return std::nullopt;
  if (ours.ss_family == AF_UNIX) {
    ucred credentials{};
    socklen_t credentials_size = sizeof(credentials);
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &credentials_size) != 0) {
      return std::nullopt;
    }
    return credentials.uid;
  }
  Endpoint local, remote;
  if (!peer_ends(fd, &local, &remote)) return std::nullopt;
  // One lookup by the kernel; only where its diagnostics cannot be asked, a read of the tables,
  // whose cost grows with the machine's sockets.
  const DiagAnswer answer = ask_sock_diag(local, remote);
  if (answer.answered) return answer.uid;
  return tcp_peer_user(fd, PeerLookup::kProcTable);
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
