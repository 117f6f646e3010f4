#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <distoptim/comm/rendezvous.h>
#include <distoptim/rpc/api.h>

namespace distoptim {
namespace rpc {
namespace detail {

/// The workers of one rpc group and how they meet through the rendezvous store: the rendezvous
/// itself, the exchange of names and listening addresses at init_rpc, and the barriers of a
/// graceful shutdown. Immutable once join() has returned, but for the store; barrier() and
/// close() from the thread that stops the agent.
class WorkerGroup {
 public:
  /// Meets the other workers' rendezvous (options().init_method); throws as comm::rendezvous.
  WorkerGroup(int rank, int world_size, const RpcBackendOptions& options);

  /// The address to listen on: options().listen_address, else the rendezvous's local address.
  std::string listen_address() const;
  /// Publishes this worker's name and listening address and waits (init_timeout) for every
  /// worker's. Throws TimeoutError naming the workers that never arrived, c10::ValueError for a
  /// name taken twice or a malformed address.
  void join(const std::string& name, const std::string& address, int port);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const WorkerInfo& self() const { return workers_[rank_]; }
  const std::vector<WorkerInfo>& workers() const { return workers_; }
  std::vector<std::string> names() const;
  /// Each worker's (IP, port), by id.
  const std::vector<std::pair<std::string, int>>& addresses() const { return addresses_; }
  /// The id of `to`; c10::ValueError naming the known workers for an unknown name, or the range
  /// for an id out of it.
  int resolve(const WorkerRef& to) const;

  /// What a worker waiting at a barrier watches, to fail fast when a worker it waits for is
  /// lost rather than wait for it forever.
  struct BarrierWatch {
    /// The workers known to be dead (their connection was lost), with why.
    std::function<std::map<int, std::string>()> dead_peers;
    /// Asks the given workers whether they are alive (LivenessProbe::check): one that has not
    /// answered in time, and why.
    std::function<std::optional<std::pair<int, std::string>>(const std::vector<int>&)> check_alive;
  };

  /// A shutdown barrier named `round`: this worker arrives and, when `wait`, waits until every
  /// worker has, bounded as a whole by shutdown_timeout when it is set (else not at all). A
  /// worker that has not arrived and is dead, or does not answer `watch.check_alive` (asked
  /// about every second), fails the barrier with PeerLostError naming it; so does a store
  /// operation that takes longer than liveness_timeout (TimeoutError naming the store). Past
  /// shutdown_timeout: TimeoutError naming the workers that never arrived. Rank 0, which serves
  /// the store, publishes why it failed and lets the others read it before it goes on: they fail
  /// with its reason, in the same type.
  void barrier(const std::string& round, bool wait, const BarrierWatch& watch);
  /// Releases the store (rank 0 stops serving it).
  void close();

 private:
  const int rank_;
  const int world_size_;
  const RpcBackendOptions options_;
  comm::Rendezvous rendezvous_;
  std::vector<WorkerInfo> workers_;
  std::unordered_map<std::string, int> ids_by_name_;
  std::vector<std::pair<std::string, int>> addresses_;
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
