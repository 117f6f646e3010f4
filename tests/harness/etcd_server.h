#pragma once

// A real etcd for a test: /usr/bin/etcd (Debian's etcd-server, 3.4) on loopback, on free ports,
// with a data directory of its own, stopped and removed when the object goes (also when the test
// fails). The etcd process is the test process's child and is killed with it if the test process
// dies (PR_SET_PDEATHSIG), so no etcd outlives a crashed test.
//
//   distoptim::testing::EtcdServer etcd;
//   EtcdStore store(EtcdStoreOptions(etcd.endpoint(), "job"));

#include <sys/types.h>

#include <chrono>
#include <string>

namespace distoptim {
namespace testing {

class EtcdServer {
 public:
  static constexpr const char* kBinary = "/usr/bin/etcd";

  /// Starts etcd and waits, at most `limit`, until it reports itself healthy (GET /health);
  /// tries fresh ports when it exits at once (a port taken meanwhile). Throws
  /// std::runtime_error with the end of etcd's log when it never answers.
  explicit EtcdServer(std::chrono::milliseconds limit = std::chrono::seconds(60));
  /// stop(), then removes the data directory.
  ~EtcdServer();
  EtcdServer(const EtcdServer&) = delete;
  EtcdServer& operator=(const EtcdServer&) = delete;

  /// "127.0.0.1:PORT" of its client URL.
  std::string endpoint() const;
  int client_port() const { return client_port_; }
  pid_t pid() const { return pid_; }

  /// SIGKILL at once, and reaped: etcd dies as in a crash.
  void kill();
  /// SIGTERM, then SIGKILL if it has not exited within 10 s; reaped. Idempotent.
  void stop();

  /// The body of GET `path` on the client URL ("" when etcd does not answer within 2 s).
  std::string http_get(const std::string& path) const;

 private:
  bool start_once(std::chrono::steady_clock::time_point until, std::string& why);
  std::string log_tail() const;

  std::string dir_;
  int client_port_ = 0;
  int peer_port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace testing
}  // namespace distoptim
