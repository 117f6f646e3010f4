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

#include "member_key.h"
#include "member_keys.h"
#include "worker_table.h"

namespace distoptim {
namespace rpc {
namespace detail {

/// The workers of one rpc group and how they meet through the rendezvous store: the rendezvous
/// itself, the exchange of names and listening addresses at init_rpc, and the barriers of a
/// graceful shutdown. A static group (world_size given) is immutable once join() has returned,
/// but for the store; barrier() and close() from the thread that stops the agent.
///
/// A dynamic group (world_size kDynamicGroup) has no barriers. Over tcp:// and env:// rank 0
/// serves the store and the others connect to it (the store host: it enters first and leaves
/// last, and the group closes with it); over etcd:// the store is etcd's and no member is
/// special. A worker claims its rank and name there (claim()), then enters the list of joins
/// (enter(), which says which workers joined before it: it tells them itself), and marks itself
/// left when it leaves (leave()). Store keys under "distoptim/rpc/dynamic/": rank/<r> (name,
/// host, port; claimed once per group), name/<name> (the rank holding it), joins (a counter),
/// join/<n> (the rank of the n-th join), left/<r>, host_entered, closing (set when the store
/// host leaves: no more joins). The table() is the agent's, updated by notices too. With a shared
/// secret every one of these values is sealed with it and must verify when read (store_seal.h):
/// a process that reaches the store without the secret cannot publish an address, a name, a join
/// or a left mark the members take. So are a static group's names and addresses (join()) and the
/// failure rank 0 publishes at a shutdown barrier (barrier()).
///
/// Every worker makes its member key (member_key.h) here and publishes its public half with its
/// address; keys() holds the members' keys as this worker read them, each fixed by the first
/// record read for its id (a dynamic group's are looked up in the store as members are met).
class WorkerGroup {
 public:
  /// world_size for a dynamic group.
  static constexpr int kDynamicGroup = 0;

  /// Meets the other workers' rendezvous (options().init_method); throws as comm::rendezvous. A
  /// dynamic group only opens the store (comm::open_store).
  WorkerGroup(int rank, int world_size, const RpcBackendOptions& options);

  bool dynamic() const { return world_size_ == kDynamicGroup; }
  /// Whether a member (rank 0) serves the store: tcp:// and env://, not etcd://.
  bool has_store_host() const { return !rendezvous_.master_addr.empty(); }
  /// Whether a member of this worker's own dynamic group is the one that drops the members that
  /// die without leaving: the store host when there is one, else every member.
  bool drops_lost_members() const { return dynamic() && (!has_store_host() || rank_ == 0); }
  WorkerTable& table() { return table_; }
  const WorkerTable& table() const { return table_; }
  /// This worker's own member key, and the members' public keys as this worker knows them.
  const std::shared_ptr<const MemberKey>& own_key() const { return own_key_; }
  MemberKeys& keys() { return keys_; }

  /// Dynamic group: claims this worker's rank (kAssignRank: the next free one) and name and
  /// publishes where it listens; afterwards rank() is the rank claimed. c10::ValueError when the
  /// rank was ever used in this group or the name is held by a worker that has not left;
  /// DistributedError when the store host is leaving; the store's errors.
  void claim(const std::string& name, const std::string& address, int port);
  /// Dynamic group, once this worker accepts connections: enters the list of joins and adds the
  /// workers that entered it before (and have not left) to the table. Returns their ids: the
  /// workers this one must tell it joined (those entering after it read it here and tell it).
  std::vector<int> enter();
  /// Dynamic group: marks this worker left in the store (a worker joining later skips it), and
  /// for the store host, closes the group to new joins. Best effort: the store may be gone.
  void leave();
  /// Dynamic group, a member that drops_lost_members(): marks worker `rank`, which died without
  /// leaving, left in the store, as its own leave() would have (its name passes on; its rank
  /// stays used). Best effort, bounded by liveness_timeout.
  void drop(int rank);
  /// Dynamic group: whether the store says worker `rank` left or was dropped; the store's errors
  /// (bounded by liveness_timeout).
  bool marked_left(int rank);

  /// The address to listen on: options().listen_address, else the rendezvous's local address.
  std::string listen_address() const;
  /// Publishes this worker's name and listening address and waits (init_timeout) for every
  /// worker's. Throws TimeoutError naming the workers that never arrived, c10::ValueError for a
  /// name taken twice or a malformed address.
  void join(const std::string& name, const std::string& address, int port);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const WorkerInfo& self() const { return self_; }
  /// The workers that have joined and not left, by id.
  std::vector<WorkerInfo> workers() const { return table_.snapshot()->members(); }
  /// The id of `to`; c10::ValueError naming the known workers for an unknown name, or the range
  /// for an id out of it. The id of a worker that left is returned (a call to it fails).
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
  std::string dynamic_key(const std::string& key) const;
  // `payload` sealed for `key` with the job's secret (store_seal.h).
  std::vector<uint8_t> sealed(const std::string& key, const std::string& payload) const;
  // The payload of `value`, read under `key`; DistributedError naming the key when its seal does
  // not verify (a process without the secret wrote it).
  std::string unsealed(const std::string& key, const std::vector<uint8_t>& value) const;
  // Whether `key` holds a left mark sealed with the job's secret; a forged one does not count
  // (a warning names it).
  bool sealed_mark(const std::string& key, std::chrono::steady_clock::time_point deadline);
  // Static group, once every record is read: every worker read the same member keys, else
  // DistributedError (a record was rewritten while the workers met).
  void agree_on_member_keys(std::chrono::steady_clock::time_point deadline);
  // Dynamic group: the member key worker `id` published with its claim (MemberKeys::Lookup),
  // each store operation bounded by liveness_timeout.
  std::string published_key(int id);

  int rank_;
  const int world_size_;
  const RpcBackendOptions options_;
  comm::Rendezvous rendezvous_;
  WorkerInfo self_;
  std::vector<WorkerInfo> workers_;  // a static group's, by id
  WorkerTable table_;
  const std::shared_ptr<const MemberKey> own_key_;
  MemberKeys keys_;  // after rendezvous_: its lookups read the store, so it stops first
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
