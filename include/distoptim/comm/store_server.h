#pragma once

// A key-value store server for LibTorch 1.13's c10d::TCPStore clients (it speaks their wire
// protocol) that no client can stop. LibTorch's own server (a c10d::TCPStore made with isServer)
// is one thread that, once the first byte of a query has come, reads the rest with blocking
// receives: a client whose link goes down in the middle of a query, or that sends part of one on
// purpose, stops the store for every other client until its bytes come or its connection closes.
// This server reads every connection without blocking and answers a query once the whole of it
// has come, so such a client delays no one else, and it treats every byte as hostile: a query
// beyond the bounds below closes that client's connection (its next operation fails), leaving
// the store as it was.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace distoptim {
namespace comm {

struct StoreServerOptions {
  /// The TCP port to listen on, on every address of the host (IPv6 and IPv4); 0 lets the kernel
  /// pick one (StoreServer::port()).
  int port = 0;
  /// Bounds on one query: a key's bytes, a value's bytes, the keys of one check or wait.
  size_t max_key_bytes = 4096;
  size_t max_value_bytes = size_t{1} << 20;
  size_t max_keys_per_query = 4096;
  /// The bytes of every key and value held (a key counts 64 bytes more, for its bookkeeping).
  size_t max_stored_bytes = size_t{256} << 20;
  /// The bytes of partial queries and unsent answers across every client: a client whose bytes
  /// would pass it is disconnected (one that sends without reading its answers, many clients each
  /// holding a partial query).
  size_t max_buffered_bytes = size_t{64} << 20;
  /// Connections open at once; a connection beyond them is closed when accepted. A connection
  /// whose peer went away without closing it (its host died, its link stayed down) is found by
  /// TCP keepalive within about 45 s and closed.
  size_t max_clients = 1024;
  /// How long a query may take to arrive from its first byte: a client that stalls in the middle
  /// of one for longer is disconnected, so its partial query does not hold the budget above.
  std::chrono::milliseconds query_timeout{30000};
};

/// What the server has done since it started (read at any time, from any thread).
struct StoreServerCounts {
  uint64_t connections_accepted = 0;
  /// Connections closed when accepted because max_clients were open.
  uint64_t connections_refused = 0;
  /// Clients disconnected by the server: a query malformed or beyond a bound, a query stalled
  /// past query_timeout, the buffer budget spent.
  uint64_t clients_dropped = 0;
  uint64_t queries_answered = 0;
  /// Why the last client dropped was: "a key of 70000 bytes (at most 4096)", ...
  std::string last_drop;
};

/// Serves the store on its own thread from construction to destruction. The store lives in the
/// server: it is empty at start and gone when the server is destroyed.
class StoreServer {
 public:
  /// Binds and listens, then starts serving. Throws distoptim::DistributedError naming the port
  /// when it cannot listen (a port in use), c10::ValueError naming a bound that is 0 or a port
  /// outside 0..65535.
  explicit StoreServer(const StoreServerOptions& options);
  /// Stops serving and closes every connection; a client's next operation fails.
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  /// The port it listens on (the kernel's pick when options.port was 0).
  int port() const;
  StoreServerCounts counts() const;

 private:
  class Loop;
  std::unique_ptr<Loop> loop_;
};

}  // namespace comm
}  // namespace distoptim
