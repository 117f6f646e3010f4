#pragma once

// A c10d::Store kept in etcd, so that no process of the job hosts the store its ranks meet in.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace distoptim {
namespace comm {

/// Where an EtcdStore keeps its keys, and its time bounds.
struct EtcdStoreOptions {
  EtcdStoreOptions(std::string endpoint, std::string job)
      : endpoint_(std::move(endpoint)), job_(std::move(job)) {}
  /// The client address of an etcd 3.4 member, "HOST:PORT" or "[IPV6]:PORT" (plain HTTP).
  TORCH_ARG(std::string, endpoint);
  /// The job's name, of letters, digits, '.', '_' and '-': its keys live under
  /// "/distoptim/<job>/", so several jobs can share one etcd.
  TORCH_ARG(std::string, job);
  /// The store's timeout (c10d's): how long `get` and `wait` wait for keys.
  TORCH_ARG(std::chrono::milliseconds, timeout) = c10d::Store::kDefaultTimeout;
  /// Bounds every request to etcd (connecting included), whatever the operation.
  TORCH_ARG(std::chrono::milliseconds, request_timeout) = std::chrono::seconds(10);
};

/// A c10d::Store whose keys live in etcd 3.4, under "/distoptim/<job>/": the store of an
/// `etcd://` rendezvous (rendezvous.h), which outlives every process of the job and which no
/// rank serves, so that no rank is special.
///
/// It speaks etcd's v3 JSON gateway (HTTP/1.1 POSTs of JSON to /v3/kv/range, /v3/kv/put,
/// /v3/kv/txn, /v3/kv/deleterange and /v3/watch, keys and values in base64) rather than gRPC:
/// etcd's .proto files are not packaged in Debian, and the gateway is etcd 3.4's documented API.
///
/// Semantics are c10d's TCPStore's (LibTorch 1.13):
///   - `set` writes; `get` waits (up to the timeout) until the key exists, then reads it;
///   - `add` adds to the decimal integer a key holds (0 when absent) and returns the sum,
///     atomically among all clients (a compare-on-mod_revision transaction, retried);
///   - `compareSet(key, expected, desired)` writes `desired` when the key holds `expected`, or
///     when it is absent and `expected` is empty, and returns the value the key then holds; when
///     the key is absent and `expected` is not empty it returns `expected` (as TCPStore does);
///   - `check` says whether every key exists; `deleteKey` whether it deleted one;
///     `getNumKeys` counts this job's keys only;
///   - `wait` waits until every key exists, by watching etcd from the revision it last read
///     (no polling); `wait(keys, kNoTimeout)` waits as long as it takes, in watches of at most a
///     minute each.
/// Values are at most kMaxValueBytes (etcd's own request limit is 1.5 MiB).
///
/// Errors (all c10::Error), each naming the endpoint (HOST:PORT) and the operation:
///   - c10::ValueError: bad options (named with their value); a value above kMaxValueBytes; an
///     `add` to a key that holds no integer, or that would overflow int64;
///   - TimeoutError: `get` or `wait` ran out of time, naming the keys still missing; or etcd did
///     not answer a request within its bound;
///   - PeerLostError: etcd refused the connection or closed it before answering (it is down);
///   - DistributedError: an answer that is not what etcd sends (malformed JSON, a missing field,
///     bad base64), larger than kMaxResponseBytes (never read beyond it), or an error status.
/// A failed `set`, `add` or `compareSet` may or may not have taken effect, as with any store
/// across a network. Nothing of the store is left broken by a failure: the next call starts afresh.
///
/// Thread safety: every method may be called from any thread at once. Requests run on libcurl
/// handles of their own (idle ones pooled, under a mutex never held during a request); the
/// timeout is guarded by the same kind of mutex. getTimeout(), which c10d::Store returns by
/// reference, is safe only while no thread calls setTimeout. Destroying the store while another
/// thread uses it is not allowed.
class EtcdStore : public c10d::Store {
 public:
  /// The most any answer of etcd may be (a line of a watch, for streams); more is an error.
  static constexpr size_t kMaxResponseBytes = size_t{4} << 20;
  /// The largest value `set`, `compareSet` and `add` store.
  static constexpr size_t kMaxValueBytes = size_t{1} << 20;

  /// Checks the options (c10::ValueError naming the bad one); does not contact etcd.
  explicit EtcdStore(EtcdStoreOptions options);
  ~EtcdStore() override;

  /// "HOST:PORT", as given.
  const std::string& endpoint() const;
  /// "/distoptim/<job>/": what every key of this store starts with in etcd.
  const std::string& key_prefix() const;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key,
                                  const std::vector<uint8_t>& expected_value,
                                  const std::vector<uint8_t>& desired_value) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;
  void setTimeout(const std::chrono::milliseconds& timeout) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace comm
}  // namespace distoptim
