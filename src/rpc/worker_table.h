#pragma once

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <distoptim/rpc/api.h>

namespace distoptim {
namespace rpc {
namespace detail {

/// The notices a worker of a dynamic group sends every member when it joins (args: name, host,
/// port; the reply says whether the member stays: false from one that is leaving) and when it
/// leaves (no args). The caller's proven id is the worker a notice is about.
constexpr const char* kMemberJoined = "__distoptim.rpc.member_joined";
constexpr const char* kMemberLeft = "__distoptim.rpc.member_left";
/// The notice the store host (rank 0, and only it) sends every member when it dropped a member
/// that died without leaving (args: its id).
constexpr const char* kMemberDropped = "__distoptim.rpc.member_dropped";

/// Who the workers of a group are, by id: name, listening address and whether the worker has
/// left. A static group fills it once at init_rpc; a dynamic group adds a worker when it joins
/// and marks it when it leaves. Ids are never reused within a group, so an entry, once there,
/// keeps its name and address; only `left` changes (and a name may move to a newer id once its
/// old holder has left).
///
/// Threading: readers take a snapshot (an atomic load of a shared_ptr to an immutable table) and
/// read it without a lock, so the call path pays one atomic load; writers (init_rpc, membership
/// notices) copy the table under `write_mutex_` and publish the copy. A snapshot stays valid, and
/// unchanged, for as long as it is held.
class WorkerTable {
 public:
  struct Entry {
    WorkerInfo info;  // info.id < 0: no worker has this id (yet)
    std::string host;
    int port = 0;
    bool left = false;
  };

  struct Snapshot {
    std::vector<Entry> entries;  // by id
    std::unordered_map<std::string, int> ids_by_name;

    /// The entry of `id`, or null if no worker has it.
    const Entry* find(int id) const {
      if (id < 0 || id >= static_cast<int>(entries.size())) return nullptr;
      const Entry& entry = entries[id];
      return entry.info.id < 0 ? nullptr : &entry;
    }
    /// The name of `id`, or "worker id N" for an id no worker has.
    std::string name(int id) const;
    /// The workers that have joined and not left, by id.
    std::vector<WorkerInfo> members() const;
    /// Names of the current members, quoted and comma-separated (for errors).
    std::string describe_members() const;
  };

  /// `dynamic`: workers may join and leave (ids up to kMaxDynamicId); else the group is fixed
  /// once set_static() has run.
  explicit WorkerTable(bool dynamic);

  bool dynamic() const { return dynamic_; }
  /// How many ids a worker of this group may have: kMaxDynamicId + 1 in a dynamic group, the
  /// world size in a static one (once set_static() has run). For tables indexed by worker id.
  size_t id_capacity() const {
    return dynamic_ ? static_cast<size_t>(kMaxDynamicId) + 1 : snapshot()->entries.size();
  }
  std::shared_ptr<const Snapshot> snapshot() const { return std::atomic_load(&snapshot_); }

  /// The static group: every worker, by id, and their (host, port).
  void set_static(const std::vector<WorkerInfo>& workers,
                  const std::vector<std::pair<std::string, int>>& addresses);
  /// A worker joined (or is already known: nothing changes). Its name's previous holder, if any,
  /// is marked left: the store hands a name on only once its holder has left (WorkerGroup::claim).
  /// Throws c10::ValueError if `id` is out of range or is known under another name.
  void add(const WorkerInfo& worker, const std::string& host, int port);
  /// `id` left the group; returns whether it was a member that had not left yet.
  bool mark_left(int id);
  /// Dynamic group: `worker` joined and left before this worker joined. Its id stays known (an
  /// RRef it created may still be passed on); its name is not its any more. No-op for a known id.
  void add_left(const WorkerInfo& worker);

  /// Whether a connection may prove worker id `id` (the handshake's check): in a static group an
  /// id in [0, world size); in a dynamic one any id in [0, kMaxDynamicId] of a worker that has not
  /// left (a worker connects to announce itself before the others know it). Why not, else.
  std::optional<std::string> refuse_id(int id) const;

  /// Ids of a dynamic group: distributed autograd packs a worker id into the top 16 bits of a
  /// signed 64-bit id.
  static constexpr int kMaxDynamicId = 32767;

 private:
  const bool dynamic_;
  std::mutex write_mutex_;
  std::shared_ptr<const Snapshot> snapshot_;  // atomic loads and stores only
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
