#pragma once

// A round between the ranks [0, world_size) through a store: every rank arrives under a prefix
// and waits for all; when rank 0, which may serve the store, gives up, it publishes why and keeps
// the store up until the ranks that came have read it, so that they fail with its reason rather
// than with the store's loss. The rendezvous, a group's failure reports, the RPC group's rounds
// and distrun's node rounds all meet this way, with one encoding of the host's failure
// (RoundFailure) and one wording of who is missing (never_arrived_text).

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <distoptim/comm/store_wait.h>

namespace c10 {
class Error;
}  // namespace c10

namespace distoptim {
namespace comm {

/// Who is missing from a round, in the one wording every round's error uses, which tests and
/// distrun's error reader match on: "never arrived: rank 1, rank 3". `describe` names one member
/// ("rank N" by default; the RPC group's "'name' (rank N)", distrun's "node N").
std::string never_arrived_text(const std::vector<int>& members,
                               const std::function<std::string(int)>& describe = {});

/// Why a round failed, as its host publishes it for the others: its kind, so that every rank
/// throws the same type, and its message. Encoded "<kind>\n<message>", kind "timeout", "lost" or
/// "error".
struct RoundFailure {
  enum class Kind { kTimeout, kPeerLost, kError };
  Kind kind = Kind::kError;
  std::string message;

  /// `error`'s kind (TimeoutError, PeerLostError, anything else) and text without its backtrace.
  static RoundFailure of(const c10::Error& error);
  std::string encode() const;
  /// What `text` encodes; a text without a known kind is an error of the whole text.
  static RoundFailure decode(const std::string& text);
  /// Throws the failure as its kind's type (TimeoutError, PeerLostError, DistributedError), its
  /// message after `context`.
  [[noreturn]] void raise(const std::string& context) const;
};

/// One rank's side of a round through a DeadlineStore.
///
/// Keys (see Keys): rank r arrives under `arrived + r`; rank 0, the host, publishes its failure
/// under `failed`; rank r leaves under `left + r` once it needs the store no more (it read the
/// failure, or failed itself). A rank's arrivals and leavings are counted: arrive() and leave()
/// add 1 to their key, and a key set with a value that is not a whole number (arrive(value), or
/// a caller's own `set`) counts once. Counting lets the host wait for both of two processes
/// that arrived as one rank.
///
/// Blocking and errors: every operation ends by the deadline it is given (at the least
/// DeadlineStore::kMinAnswerTime per store operation); a store that stops answering or is lost
/// throws as DeadlineStore's operations do (TimeoutError, PeerLostError, DistributedError), except
/// publish_failure, which never throws. An exception thrown midway leaves the round's keys as far
/// as the operation got; the round may still be used.
///
/// Thread safety: not thread-safe (leave() remembers that it left); use one StoreRound from one
/// thread at a time. Any number of StoreRounds, on any threads, may share a store.
///
/// Ownership: holds a reference to `store`, which must outlive it.
class StoreRound {
 public:
  using Clock = DeadlineStore::Clock;
  /// How often publish_failure asks whether the ranks that came have left.
  static constexpr std::chrono::milliseconds kLeavePollInterval{5};

  /// The keys of a round, each a full key on the store.
  struct Keys {
    /// Rank r's arrival is `arrived + r`.
    std::string arrived;
    /// The host's published failure.
    std::string failed;
    /// Rank r's leaving is `left + r`.
    std::string left;

    /// `prefix + r`, `prefix + "failed"`, `prefix + "left/" + r`.
    static Keys under(const std::string& prefix);
  };

  /// This process's side, as `rank` of `world_size`, of the round with `keys` on `store`.
  /// Throws c10::ValueError unless 0 <= rank < world_size; nothing is sent to the store.
  StoreRound(DeadlineStore& store, Keys keys, int rank, int world_size);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const Keys& keys() const { return keys_; }
  /// `keys().arrived + rank`.
  std::string arrival_key(int rank) const;

  /// Counts this rank in: adds 1 to its arrival key, by `deadline`. A TCPStore answers an add
  /// (not a set), so the key is in the store when this returns. Returns the count: more than 1
  /// when another process arrived as this rank too.
  int64_t arrive(Clock::time_point deadline);
  /// Sets this rank's arrival key to `value`, by `deadline`, for rounds whose arrivals carry
  /// data (read back with `store.get(arrival_key(r))`). A TCPStore does not answer a set: the
  /// key may reach the store after this returns.
  void arrive(const std::vector<uint8_t>& value, Clock::time_point deadline);

  /// Polls until every rank has arrived or `deadline` passes, as wait_for_rank_keys does on the
  /// arrival keys, and returns the ranks still missing then (empty once all arrived). `each_poll`
  /// runs before every poll; an exception from it ends the wait and propagates.
  /// `per_operation` as wait_for_rank_keys's.
  std::vector<int> wait_for_all(Clock::time_point deadline,
                                const std::function<void()>& each_poll = {},
                                std::chrono::milliseconds per_operation = {}) const;

  /// As wait_for_all, for a later phase of the round whose rank r sets `prefix + r` (`prefix`
  /// empty: the arrivals), and throwing where it would return a rank. Each poll also reads the
  /// host's published failure (read_failure) and throws it as its kind's type: "<subject> failed
  /// at rank 0 (seen by rank R): <its message>". At the deadline throws TimeoutError: "<what>;
  /// never arrived: rank 1, rank 3" (`describe` as never_arrived_text's).
  void await_all(Clock::time_point deadline, const std::string& subject, const std::string& what,
                 const std::string& prefix = {},
                 const std::function<std::string(int)>& describe = {});

  /// As wait_for_all, for the ranks in `*missing` alone. After every poll `*missing` holds those
  /// the poll did not see (each looked up on its own while any is missing: one store operation
  /// more per missing rank and poll), so that a caller that catches a store failure midway knows
  /// who had not arrived by then.
  void wait_for(std::vector<int>* missing, Clock::time_point deadline) const;

  /// The ranks whose key `prefix + r` is not set (`prefix` empty: the arrivals), by one look at
  /// the store ending by `deadline`, as ranks_without_key: for a caller whose wait has its own
  /// loop (one that reconnects to a store that restarts, say).
  std::vector<int> not_arrived(Clock::time_point deadline, const std::string& prefix = {}) const;

  /// The ranks other than the host that arrived more often than they left, by one look at the
  /// store (ending by `deadline`): those the host still waits for before the store goes away.
  std::vector<int> ranks_not_left(Clock::time_point deadline) const;

  /// The host (rank 0) after its side of the round failed: publishes `why` (RoundFailure's
  /// encoding, sealed or not by the caller) under the failed key,
  /// then waits until every other rank that arrived has left (ranks_not_left is empty), asking
  /// every kLeavePollInterval, but never past `until`. Never throws: a store that fails ends the
  /// wait, as there is nobody left to tell. Throws c10::ValueError, before sending anything, on
  /// any other rank.
  void publish_failure(const std::string& why, Clock::time_point until);

  /// A rank other than the host: whether the host published a failure. If it did, leaves (see
  /// leave) and returns its text; else returns nullopt. The host always gets nullopt, without
  /// asking the store. Meant for wait_for_all's `each_poll`, so that a waiting rank fails with
  /// the host's reason instead of waiting for its own deadline.
  std::optional<std::string> read_failure(Clock::time_point deadline);

  /// Says this rank needs the store no more: adds 1 to its left key, by `deadline`. Once per
  /// StoreRound: later calls, and calls after read_failure left, do nothing, also when the first
  /// add failed.
  void leave(Clock::time_point deadline);

 private:
  DeadlineStore& store_;
  const Keys keys_;
  const int rank_;
  const int world_size_;
  bool left_ = false;
};

}  // namespace comm
}  // namespace distoptim
