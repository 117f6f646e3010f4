#pragma once

// "HOST:PORT" and "[IPV6]:PORT" addresses, as init methods and the etcd store take them, and
// whether one listens yet.

#include <chrono>
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

/// Returns once host:port accepts a TCP connection (closed at once), trying again every 10 ms
/// while it refuses, until `deadline`: true if it accepted. False at once when the host does not
/// resolve, or a try neither connects nor is refused within 1 s (a host that does not answer):
/// the caller's own connect then reports it. A client of LibTorch 1.13's TCPStore that starts
/// before rank 0's store listens sleeps a whole second after each refusal.
bool wait_until_listening(const std::string& host, int port,
                          std::chrono::steady_clock::time_point deadline);

}  // namespace detail
}  // namespace comm
}  // namespace distoptim
