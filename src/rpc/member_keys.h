#pragma once

// The public keys of a group's members (member_key.h), by worker id, as this worker knows them.
// A key, once known, is fixed for good: worker ids are never reused within a group, so a record
// read later that names another key for an id is refused, not taken. A static group's keys come
// from the records every worker publishes at init_rpc, all read before the first connection is
// taken; a dynamic group's from the record each member claims in the store, read when that
// member is first met (the list of joins at init_rpc, or a connection proving an id not known
// yet). Such a lookup runs on a thread of its own, so that the I/O thread never waits on the
// store, and at most kMaxPendingLookups ids wait for one at a time.
//
// Threading: every method may be called from any thread; one mutex guards the keys and the
// queue; `done` callbacks run without it held.

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace distoptim {
namespace rpc {
namespace detail {

class MemberKeys {
 public:
  /// Reads the key worker `id` published (blocking, bounded by the store's deadlines); throws
  /// with why there is none (no record, a record not sealed with the job's secret, ...).
  using Lookup = std::function<std::string(int id)>;
  /// The key of a worker, or nullopt and why not.
  using Resolved = std::function<void(std::optional<std::string> key, const std::string& why)>;

  /// Ids waiting for a lookup at once; more are refused at once.
  static constexpr size_t kMaxPendingLookups = 256;

  /// Without `lookup` (a static group) only keys fixed by fix() are known.
  explicit MemberKeys(Lookup lookup = nullptr);
  ~MemberKeys();
  MemberKeys(const MemberKeys&) = delete;
  MemberKeys& operator=(const MemberKeys&) = delete;

  /// Worker `id`'s key is `key`; c10::ValueError naming the id if another key is fixed for it.
  void fix(int id, const std::string& key);
  std::optional<std::string> find(int id) const;
  /// Worker `id` has no key this worker takes, for `why` (its record is not sealed with the job's
  /// secret): resolve() answers that, and no lookup is made.
  void refuse(int id, const std::string& why);
  /// Calls `done` with worker `id`'s key: at once, on this thread, when it is known (or cannot
  /// be looked up); else once the lookup thread has read it (and fixed it), on that thread.
  void resolve(int id, Resolved done);
  /// Ends the lookup thread; lookups still waiting get nullopt. Idempotent.
  void stop();

 private:
  void run_lookups();

  const Lookup lookup_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::map<int, std::string> keys_;
  std::map<int, std::string> refused_;            // why, by id
  std::map<int, std::vector<Resolved>> waiting_;  // ids whose lookup is queued or running
  std::deque<int> queue_;                         // ids not yet being looked up, in order
  bool stopping_ = false;
  std::thread thread_;  // started by the first lookup
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
