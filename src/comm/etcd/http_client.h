#pragma once

// HTTP/1.1 POSTs of JSON to one etcd endpoint through libcurl, bounded in size and time: the
// transport of EtcdStore (include/distoptim/comm/etcd_store.h). Everything the endpoint sends is
// untrusted: what is read is capped, and every failure is a distoptim error naming the endpoint
// and the operation.

#include <chrono>
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace distoptim {
namespace comm {
namespace etcd {

/// A client of one etcd endpoint ("HOST:PORT"). Thread safety: every method may be called from
/// any thread at once; each request runs on its own libcurl handle, taken from a pool of idle
/// ones (so that connections are reused) guarded by `mutex_`, which is never held during a
/// request.
///
/// Errors, each naming the endpoint and `what` (the operation):
///   - PeerLostError: the endpoint refused the connection, or closed it before answering;
///   - TimeoutError: no complete answer within the request's bound;
///   - DistributedError: an answer larger than `max_response_bytes` (also when only announced
///     by its Content-Length, which is then never read), an HTTP status other than 200 (with
///     the start of the answer, made printable), any other transfer failure.
class HttpClient {
 public:
  using Clock = std::chrono::steady_clock;

  /// How a stream ended without an error.
  enum class StreamEnd {
    kStopped,   // on_line asked to stop
    kTimedOut,  // the stream's time bound passed
    kClosed,    // the endpoint ended the answer, or the connection broke after it began
  };

  HttpClient(std::string endpoint, size_t max_response_bytes,
             std::chrono::milliseconds request_timeout);
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  const std::string& endpoint() const { return endpoint_; }

  /// POSTs `body` to `path` and returns the answer's body (status 200). Connecting and the
  /// whole transfer end by the sooner of `deadline` and the request timeout from now.
  std::string post(const std::string& path, const std::string& body, const std::string& what,
                   Clock::time_point deadline);

  /// POSTs `body` to `path` and calls `on_line` with each newline-terminated line of the answer
  /// as it arrives, until `on_line` returns false, `until` passes or the answer ends. Each line
  /// is capped at `max_response_bytes`. Connecting is bounded as in `post`; a refused
  /// connection or an answer other than status 200 throws as `post` does.
  StreamEnd post_stream(const std::string& path, const std::string& body, const std::string& what,
                        Clock::time_point until,
                        const std::function<bool(const std::string&)>& on_line);

 private:
  void* acquire();
  void release(void* handle);

  const std::string endpoint_;
  const std::string base_url_;
  const size_t max_response_bytes_;
  const std::chrono::milliseconds request_timeout_;
  std::mutex mutex_;
  std::vector<void*> idle_;  // guarded by mutex_
};

}  // namespace etcd
}  // namespace comm
}  // namespace distoptim
