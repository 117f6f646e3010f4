#pragma once

// How connections begin: the listener that accepts them on a worker's address (and on the
// Unix-domain socket named after it, for workers on the same host), and connect(), which opens
// one to a peer. Each hands on a Connection (connection.h), which owns everything after.

#include <functional>
#include <memory>
#include <string>

#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/local/stream_protocol.hpp>
#include <asio/steady_timer.hpp>

#include "connection.h"

namespace distoptim {
namespace rpc {
namespace detail {

/// The abstract Unix-domain socket name (Linux: no file, gone with its socket) of the worker
/// listening on TCP `address`:`port`. A TCP port is held by one socket at a time, so live
/// listeners' names differ; whoever answers on a name still proves itself in the handshake.
std::string unix_socket_name(const std::string& address, int port);

/// Accepts connections on an address, on the I/O thread, and (if asked) on the Unix-domain
/// socket named after it (unix_socket_name) for workers on the same host; a failure of a
/// listening socket is logged and the socket re-created with the same port or name (a failure to
/// accept one connection never stops it). Threading as Connection.
class Listener : public std::enable_shared_from_this<Listener> {
 public:
  using AcceptHandler = std::function<void(std::shared_ptr<Connection>)>;

  /// Binds `address` (an IP address; port 0 picks one), and with `unix_socket` the Unix-domain
  /// socket named after it. Throws DistributedError if it cannot bind the address; a Unix name
  /// taken by another process is logged and left (peers then connect over TCP).
  Listener(asio::io_context& io, const std::string& address, int port = 0,
           bool unix_socket = false);
  /// I/O thread only.
  void start(AcceptHandler on_accept);
  /// Any thread.
  void close();
  int port() const { return port_; }
  const std::string& address() const { return address_; }
  /// Whether the Unix-domain socket listens (asked for, and its name was free).
  bool unix_socket() const { return unix_open_; }

 private:
  void open(asio::ip::tcp::acceptor& acceptor);
  void open(asio::local::stream_protocol::acceptor& acceptor);
  // What a warning calls each listening socket, and the timer that re-creates it.
  std::string describe(const asio::ip::tcp::acceptor&) const;
  std::string describe(const asio::local::stream_protocol::acceptor&) const;
  asio::steady_timer& retry_timer(const asio::ip::tcp::acceptor&) { return retry_; }
  asio::steady_timer& retry_timer(const asio::local::stream_protocol::acceptor&) {
    return unix_retry_;
  }
  template <class Acceptor>
  void accept_next(Acceptor& acceptor);
  template <class Acceptor>
  void reopen_later(Acceptor& acceptor, const std::string& why);

  asio::io_context& io_;
  asio::ip::tcp::acceptor acceptor_;
  asio::local::stream_protocol::acceptor unix_acceptor_;
  asio::steady_timer retry_;
  asio::steady_timer unix_retry_;
  const std::string address_;
  int port_ = 0;
  bool unix_open_ = false;
  AcceptHandler on_accept_;
  bool closed_ = false;
};

/// Connects to `address`:`port` on the I/O thread, or with `unix_socket` to the Unix-domain
/// socket named after it; `done` runs there with the connection, or with null and the reason.
void connect(asio::io_context& io, const std::string& address, int port, bool unix_socket,
             std::function<void(std::shared_ptr<Connection>, const std::string& error)> done);

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
