#pragma once

// Store operations that end by a deadline, and waiting on a store for every rank's key: what the
// comm layer's protocols and the layers above use to talk through the rendezvous store.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace distoptim {
namespace comm {

/// A c10d::Store whose every operation ends by a deadline: the store a rendezvous returns.
///
/// LibTorch 1.13's TCPStore honours its timeout only while waiting for a key (`get`, `wait`);
/// `set`, `add`, `check` and the rest block on the socket for as long as the server does not
/// answer, which is forever when the process serving it is stopped or accepts without reading.
/// A DeadlineStore runs each operation of the store it wraps on a thread of its own and waits
/// for it until the deadline.
///
/// Deadlines: the c10d::Store methods end by getTimeout() from their call (`wait(keys, t)` by
/// `t`; a timeout of c10d::Store::kNoTimeout waits as long as it takes, as in c10d); the
/// overloads taking a `deadline` end by it, but are always granted at least kMinAnswerTime, so
/// that a request made just before a caller's deadline is not mistaken for a store that stopped
/// answering. `get` waits for a missing key as the wrapped store does (up to its timeout).
///
/// Errors (all distoptim::DistributedError, so c10::Error), each naming the store by
/// `address()` and the operation with its key:
///   - TimeoutError: no answer by the deadline. When the operation was one the store answers
///     at once (all but `get` and `wait`, which may legitimately wait for a key), the store is
///     taken to have stopped answering: until that operation returns, every further operation
///     fails at once with TimeoutError rather than queueing behind it for a deadline of its own;
///   - PeerLostError: the connection to the store failed (reset, broken pipe, closed): the
///     process serving it is gone;
///   - DistributedError: any other failure of the wrapped store.
/// The operation itself is not cancelled: a `set` or `add` that timed out may still take effect.
///
/// Ownership: an operation that ran past its deadline keeps running on its thread, which
/// co-owns the wrapped store; the thread ends, and releases it, when the operation returns.
/// For a TCPStore that is bounded: the connection is made to time out its receives after the
/// store's timeout (see connect_tcp_store in rendezvous.cpp), so the thread ends at the latest
/// then, even if the server never answers; at process exit a thread still blocked on the socket
/// ends with the process without touching anything it does not own.
///
/// Thread safety: every method may be called from any thread; operations of the wrapped store
/// run as concurrently as that store allows (a TCPStore runs one at a time).
class DeadlineStore : public c10d::Store {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds kMinAnswerTime{1000};

  /// Wraps `store`; `address` names it in errors ("127.0.0.1:29500", "file /tmp/rdzv").
  /// Operations without a deadline of their own are bounded by `timeout`.
  DeadlineStore(c10::intrusive_ptr<c10d::Store> store, std::string address,
                std::chrono::milliseconds timeout);
  ~DeadlineStore() override;

  const std::string& address() const { return address_; }

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& current_value,
                                  const std::vector<uint8_t>& new_value) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;
  /// Also sets the wrapped store's timeout (its wait for a key in `get` and `wait`).
  void setTimeout(const std::chrono::milliseconds& timeout) override;

  void set(const std::string& key, const std::vector<uint8_t>& value, Clock::time_point deadline);
  std::vector<uint8_t> get(const std::string& key, Clock::time_point deadline);
  int64_t add(const std::string& key, int64_t value, Clock::time_point deadline);
  bool check(const std::vector<std::string>& keys, Clock::time_point deadline);

 private:
  struct Shared;

  Clock::time_point default_deadline() const;
  // Runs `op` on the wrapped store on a thread of its own and waits for it until `deadline`
  // (never less than kMinAnswerTime from now). `what` names the operation in errors.
  template <class R>
  R run(const std::string& what, Clock::time_point deadline, bool waits_for_keys,
        std::function<R(c10d::Store&)> op);

  const c10::intrusive_ptr<c10d::Store> store_;
  const std::string address_;
  const std::shared_ptr<Shared> shared_;
};

/// The ranks r in [0, world_size) whose key `prefix + r` is not set, by one look at the store
/// (one `check` of all the keys, then one per key only when some are missing), every operation
/// ending by `deadline`. A store that stops answering or is lost throws as DeadlineStore's
/// operations do.
std::vector<int> ranks_without_key(DeadlineStore& store, const std::string& prefix, int world_size,
                                   DeadlineStore::Clock::time_point deadline);

/// Polls until every rank r in [0, world_size) has set the key `prefix + r`, or `deadline`
/// passes; returns the ranks whose key is still missing then (empty once all are there).
/// Polling, unlike Store::wait, lets a timeout name who is missing. `each_poll` runs before every
/// poll (it may throw to stop the wait). A store that stops answering or is lost throws as
/// DeadlineStore's operations do. `per_operation`, when positive, also bounds each store
/// operation on its own, so that a wait with no deadline (Clock::time_point::max()) still finds
/// a store host that stopped answering.
std::vector<int> wait_for_rank_keys(DeadlineStore& store, const std::string& prefix, int world_size,
                                    DeadlineStore::Clock::time_point deadline,
                                    const std::function<void()>& each_poll = {},
                                    std::chrono::milliseconds per_operation = {});

/// The sooner of `deadline` and `per_operation` from now (`deadline` when per_operation is 0).
DeadlineStore::Clock::time_point operation_deadline(DeadlineStore::Clock::time_point deadline,
                                                    std::chrono::milliseconds per_operation);

}  // namespace comm
}  // namespace distoptim
