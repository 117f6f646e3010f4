// Who holds the other end of a connection, as the kernel says (src/rpc/transport/peer_user.h):
// both ways of asking for a TCP peer, from both ends, over IPv4, IPv6 and an IPv4 client of a
// dual-stack listener.

#include "transport/peer_user.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <utility>

#include <gtest/gtest.h>

namespace distoptim {
namespace rpc {
namespace detail {
namespace peer_user_test {

struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  Fd(Fd&& other) noexcept : fd(std::exchange(other.fd, -1)) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// The loopback address of `family` on `port` (0: any port), or, with `any`, the wildcard.
sockaddr_storage address_of(int family, uint16_t port, bool any = false) {
  sockaddr_storage address{};
  if (family == AF_INET) {
    auto& v4 = reinterpret_cast<sockaddr_in&>(address);
    v4.sin_family = AF_INET;
    v4.sin_port = htons(port);
    v4.sin_addr.s_addr = htonl(any ? INADDR_ANY : INADDR_LOOPBACK);
  } else {
    auto& v6 = reinterpret_cast<sockaddr_in6&>(address);
    v6.sin6_family = AF_INET6;
    v6.sin6_port = htons(port);
    v6.sin6_addr = any ? in6addr_any : in6addr_loopback;
  }
  return address;
}

socklen_t size_of(int family) {
  return family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
}

// A connected pair on loopback: the client's socket and the one the listener accepted. A
// listener of `listen_family` (with `dual_stack`, IPv6 on the wildcard taking IPv4 too), a client
// of `client_family`. Empty fds when this machine cannot make them (no IPv6, say).
std::pair<Fd, Fd> connected_pair(int listen_family, bool dual_stack, int client_family) {
  Fd listener(::socket(listen_family, SOCK_STREAM, 0));
  if (listener.fd < 0) return {Fd(-1), Fd(-1)};
  if (dual_stack) {
    const int off = 0;
    ::setsockopt(listener.fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof(off));
  }
  sockaddr_storage bound = address_of(listen_family, 0, dual_stack);
  if (::bind(listener.fd, reinterpret_cast<sockaddr*>(&bound), size_of(listen_family)) != 0 ||
      ::listen(listener.fd, 1) != 0) {
    return {Fd(-1), Fd(-1)};
  }
  socklen_t size = sizeof(bound);
  ::getsockname(listener.fd, reinterpret_cast<sockaddr*>(&bound), &size);
  const uint16_t port =
      ntohs(listen_family == AF_INET ? reinterpret_cast<sockaddr_in&>(bound).sin_port
                                     : reinterpret_cast<sockaddr_in6&>(bound).sin6_port);
  Fd client(::socket(client_family, SOCK_STREAM, 0));
  sockaddr_storage target = address_of(client_family, port);
  if (client.fd < 0 ||
      ::connect(client.fd, reinterpret_cast<sockaddr*>(&target), size_of(client_family)) != 0) {
    return {Fd(-1), Fd(-1)};
  }
  Fd accepted(::accept(listener.fd, nullptr, nullptr));
  return {std::move(client), std::move(accepted)};
}

TEST(PeerUser, BothLookupsNameThisUserAtEitherEndOfALoopbackConnection) {
  const uint32_t me = ::geteuid();
  struct Case {
    const char* name;
    int listen_family;
    bool dual_stack;
    int client_family;
  };
  int checked = 0;
  for (const Case& c :
       {Case{"IPv4", AF_INET, false, AF_INET}, Case{"IPv6", AF_INET6, false, AF_INET6},
        Case{"IPv4 client, dual-stack listener", AF_INET6, true, AF_INET}}) {
    auto [client, accepted] = connected_pair(c.listen_family, c.dual_stack, c.client_family);
    if (client.fd < 0 || accepted.fd < 0) {
      // IPv4 loopback is always there; the others only where the machine has IPv6.
      EXPECT_NE(c.listen_family, AF_INET) << c.name << ": no loopback connection";
      continue;
    }
    for (const auto& [end, fd] : {std::pair<const char*, int>{"client", client.fd},
                                  std::pair<const char*, int>{"accepted", accepted.fd}}) {
      const std::string where = std::string(c.name) + ", the " + end + "'s end";
      EXPECT_EQ(tcp_peer_user(fd, PeerLookup::kSockDiag), std::optional<uint32_t>(me)) << where;
      EXPECT_EQ(tcp_peer_user(fd, PeerLookup::kProcTable), std::optional<uint32_t>(me)) << where;
      EXPECT_EQ(peer_user(fd), std::optional<uint32_t>(me)) << where;
    }
    ++checked;
  }
  EXPECT_GE(checked, 1);
}

}  // namespace peer_user_test
}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
