#include "peer_user.h"

#include <netinet/in.h>
#include <sys/socket.h>

#include <array>
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

}  // namespace

std::optional<uint32_t> peer_user(int fd) {
  sockaddr_storage ours{}, theirs{};
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
  size = sizeof(theirs);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&theirs), &size) != 0) return std::nullopt;
  // The peer's socket: its local end is our remote one.
  Endpoint local, remote;
  if (!endpoint_of(theirs, &local) || !endpoint_of(ours, &remote)) return std::nullopt;
  if (auto uid = owner_in("/proc/net/tcp", local, remote)) return uid;
  return owner_in("/proc/net/tcp6", local, remote);
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
