#pragma once

// "HOST:PORT" and "[IPV6]:PORT" addresses, as init methods and the etcd store take them.

#include <string>
#include <utility>

namespace distoptim {
namespace comm {
namespace detail {

/// Splits `text` into host and port. A port outside 1..65535, an empty host, or a host with
/// characters no host name or address has (it goes into URLs) throws c10::ValueError that
/// starts with `subject` (such as "rendezvous: init_method 'tcp://h:1'") and names `form`
/// (such as "tcp://HOST:PORT") or the port.
std::pair<std::string, int> parse_host_port(const std::string& text, const std::string& subject,
                                            const std::string& form);

/// "host:port", with an IPv6 host in brackets.
std::string host_port_text(const std::string& host, int port);

}  // namespace detail
}  // namespace comm
}  // namespace distoptim
