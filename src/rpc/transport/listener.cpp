// How connections begin (listener.h): accepting them on a worker's listening sockets, which
// survive their own failures, and connecting to a peer's.

#include "listener.h"

#include <asio/dispatch.hpp>

#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

// Waits before re-creating a failed listening socket, or after running out of descriptors.
constexpr std::chrono::milliseconds kListenerRetry{100};

asio::local::stream_protocol::endpoint unix_endpoint(const std::string& name) {
  return asio::local::stream_protocol::endpoint(std::string_view(name));
}

}  // namespace

std::string unix_socket_name(const std::string& address, int port) {
  // The leading NUL makes the name abstract (Linux): nothing is created in the file system.
  return std::string(1, '\0') + "distoptim-rpc/" + address + ":" + std::to_string(port);
}

Listener::Listener(asio::io_context& io, const std::string& address, int port, bool unix_socket)
    : io_(io),
      acceptor_(io),
      unix_acceptor_(io),
      retry_(io),
      unix_retry_(io),
      address_(address),
      port_(port) {
  try {
    open(acceptor_);
  } catch (const std::exception& error) {
    DISTOPTIM_THROW(DistributedError, "rpc: cannot listen on ", address, ":", port, ": ",
                    error.what());
  }
  if (unix_socket) {
    try {
      open(unix_acceptor_);
      unix_open_ = true;
    } catch (const std::exception& error) {
      // Another process holds the name: same-host peers connect over TCP (they try the name,
      // and whoever holds it fails the handshake).
      asio::error_code ignored;
      unix_acceptor_.close(ignored);
      TORCH_WARN("rpc: cannot listen on ", describe(unix_acceptor_), " (", error.what(),
                 "); workers on this host connect to ", address_, ":", port_, " over TCP");
    }
  }
}

void Listener::open(asio::ip::tcp::acceptor& acceptor) {
  asio::ip::tcp::endpoint endpoint(asio::ip::make_address(address_), static_cast<uint16_t>(port_));
  acceptor.open(endpoint.protocol());
  acceptor.set_option(asio::ip::tcp::acceptor::reuse_address(true));
  acceptor.bind(endpoint);
  acceptor.listen(asio::socket_base::max_listen_connections);
  port_ = acceptor.local_endpoint().port();
}

void Listener::open(asio::local::stream_protocol::acceptor& acceptor) {
  const auto endpoint = unix_endpoint(unix_socket_name(address_, port_));
  acceptor.open(endpoint.protocol());
  acceptor.bind(endpoint);
  acceptor.listen(asio::socket_base::max_listen_connections);
}

std::string Listener::describe(const asio::ip::tcp::acceptor&) const {
  return address_ + ":" + std::to_string(port_);
}

std::string Listener::describe(const asio::local::stream_protocol::acceptor&) const {
  return "the Unix socket '@" + unix_socket_name(address_, port_).substr(1) + "'";
}

void Listener::start(AcceptHandler on_accept) {
  on_accept_ = std::move(on_accept);
  accept_next(acceptor_);
  if (unix_open_) accept_next(unix_acceptor_);
}

namespace {

std::shared_ptr<Connection> make_connection(asio::io_context& io, asio::ip::tcp::socket socket) {
  return std::make_shared<Connection>(io, std::move(socket));
}

std::shared_ptr<Connection> make_connection(asio::io_context& io,
                                            asio::local::stream_protocol::socket socket) {
  return std::make_shared<Connection>(io, std::move(socket), std::string());
}

}  // namespace

template <class Acceptor>
void Listener::accept_next(Acceptor& acceptor) {
  acceptor.async_accept(
      [self = shared_from_this(), &acceptor](const asio::error_code& error,
                                             typename Acceptor::protocol_type::socket socket) {
        if (self->closed_) {
          return;
        }
        if (!error) {
          self->on_accept_(make_connection(self->io_, std::move(socket)));
          self->accept_next(acceptor);
          return;
        }
        // A connection that failed before we took it costs only itself.
        if (error == asio::error::connection_aborted || error == asio::error::connection_reset ||
            error == asio::error::try_again || error == asio::error::interrupted) {
          self->accept_next(acceptor);
          return;
        }
        // Out of descriptors or memory: the pending connections wait in the backlog meanwhile.
        if (error == asio::error::no_descriptors || error == asio::error::no_buffer_space ||
            error == asio::error::no_memory) {
          TORCH_WARN("rpc: accepting on ", self->describe(acceptor), " failed (", error.message(),
                     "); retrying in ", kListenerRetry.count(), " ms");
          asio::steady_timer& retry = self->retry_timer(acceptor);
          retry.expires_after(kListenerRetry);
          retry.async_wait([self, &acceptor](const asio::error_code& wait_error) {
            if (!wait_error && !self->closed_) self->accept_next(acceptor);
          });
          return;
        }
        self->reopen_later(acceptor, error.message());
      });
}

template <class Acceptor>
void Listener::reopen_later(Acceptor& acceptor, const std::string& why) {
  TORCH_WARN("rpc: the listening socket on ", describe(acceptor), " failed (", why,
             "); re-creating it");
  asio::error_code ignored;
  acceptor.close(ignored);
  asio::steady_timer& retry = retry_timer(acceptor);
  retry.expires_after(kListenerRetry);
  retry.async_wait([self = shared_from_this(), &acceptor](const asio::error_code& error) {
    if (error || self->closed_) {
      return;
    }
    try {
      self->open(acceptor);
      self->accept_next(acceptor);
    } catch (const std::exception& failure) {
      self->reopen_later(acceptor, failure.what());
    }
  });
}

void Listener::close() {
  asio::dispatch(io_, [self = shared_from_this()] {
    self->closed_ = true;
    asio::error_code ignored;
    self->retry_.cancel();
    self->unix_retry_.cancel();
    self->acceptor_.close(ignored);
    self->unix_acceptor_.close(ignored);
  });
}

void connect(asio::io_context& io, const std::string& address, int port, bool unix_socket,
             std::function<void(std::shared_ptr<Connection>, const std::string& error)> done) {
  asio::dispatch(io, [&io, address, port, unix_socket, done = std::move(done)] {
    if (unix_socket) {
      const std::string name = unix_socket_name(address, port);
      auto socket = std::make_shared<asio::local::stream_protocol::socket>(io);
      socket->async_connect(
          unix_endpoint(name), [&io, socket, name, done](const asio::error_code& error) {
            if (error) {
              done(nullptr, error.message());
            } else {
              done(std::make_shared<Connection>(io, std::move(*socket), name), "");
            }
          });
      return;
    }
    asio::error_code error;
    const asio::ip::address ip = asio::ip::make_address(address, error);
    if (error) {
      done(nullptr, "'" + address + "' is not an IP address");
      return;
    }
    auto socket = std::make_shared<asio::ip::tcp::socket>(io);
    socket->async_connect(asio::ip::tcp::endpoint(ip, static_cast<uint16_t>(port)),
                          [&io, socket, done](const asio::error_code& error) {
                            if (error) {
                              done(nullptr, error.message());
                            } else {
                              done(std::make_shared<Connection>(io, std::move(*socket)), "");
                            }
                          });
  });
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
