#include "etcd/http_client.h"

#include <curl/curl.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstdlib>
#include <exception>
#include <mutex>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <distoptim/comm/errors.h>

#include "error_text.h"

namespace distoptim {
namespace comm {
namespace etcd {

namespace {

using Clock = HttpClient::Clock;

// Idle handles kept for reuse (each keeps its connection open); more are made when needed.
constexpr size_t kMaxIdleHandles = 8;
// How much of an error answer goes into a message.
constexpr size_t kQuotedBytes = 200;

// curl_global_init is not thread-safe before libcurl 7.84 and must come before any handle.
void init_curl_once() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

// What one transfer receives; the callbacks below fill it.
struct Transfer {
  CURL* handle = nullptr;
  size_t cap = 0;
  std::string body;
  // Set when the answer was (or was announced as) larger than `cap`; the transfer is aborted.
  bool too_large = false;
  long long announced_length = -1;
  // Streaming: called per line of a status-200 answer; returning false stops the transfer.
  const std::function<bool(const std::string&)>* on_line = nullptr;
  bool stopped = false;
  // What on_line threw: kept, the transfer stopped, and thrown again after libcurl returns (an
  // exception must not cross libcurl's C frames).
  std::exception_ptr line_error;
};

long status_of(CURL* handle) {
  long status = 0;
  curl_easy_getinfo(handle, CURLINFO_RESPONSE_CODE, &status);
  return status;
}

// Reads each header line; an announced Content-Length above the cap ends the transfer before
// any of the body is read. (libcurl itself caps a header line at CURL_MAX_HTTP_HEADER and all
// headers of an answer at a few hundred KiB.)
size_t on_header(char* data, size_t size, size_t count, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t n = size * count;
  static const std::string kName = "content-length:";
  if (n > kName.size()) {
    std::string name(data, kName.size());
    std::transform(name.begin(), name.end(), name.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    if (name == kName) {
      const std::string value(data + kName.size(), n - kName.size());
      char* end = nullptr;
      const unsigned long long length = std::strtoull(value.c_str(), &end, 10);
      if (end != value.c_str()) {
        t->announced_length =
            static_cast<long long>(std::min<unsigned long long>(length, LLONG_MAX));
        if (length > t->cap) {
          t->too_large = true;
          return 0;
        }
      }
    }
  }
  return n;
}

// Appends what arrives, never beyond the cap; a stream of status 200 is cut into lines.
size_t on_body(char* data, size_t size, size_t count, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t n = size * count;
  const bool streaming = t->on_line != nullptr && status_of(t->handle) == 200;
  if (!streaming) {
    if (n > t->cap - t->body.size()) {
      t->too_large = true;
      return 0;
    }
    t->body.append(data, n);
    return n;
  }
  size_t begin = 0;
  for (size_t i = 0; i < n; ++i) {
    if (data[i] != '\n') continue;
    if (i - begin > t->cap - t->body.size()) {
      t->too_large = true;
      return 0;
    }
    t->body.append(data + begin, i - begin);
    std::string line;
    line.swap(t->body);
    begin = i + 1;
    bool more = false;
    try {
      more = (*t->on_line)(line);
    } catch (...) {
      t->line_error = std::current_exception();
    }
    if (!more) {
      t->stopped = true;
      return 0;
    }
  }
  if (n - begin > t->cap - t->body.size()) {
    t->too_large = true;
    return 0;
  }
  t->body.append(data + begin, n - begin);
  return n;
}

}  // namespace

HttpClient::HttpClient(std::string endpoint, size_t max_response_bytes,
                       std::chrono::milliseconds request_timeout)
    : endpoint_(std::move(endpoint)),
      base_url_("http://" + endpoint_),
      max_response_bytes_(max_response_bytes),
      request_timeout_(request_timeout) {
  init_curl_once();
}

HttpClient::~HttpClient() {
  for (void* handle : idle_) curl_easy_cleanup(static_cast<CURL*>(handle));
}

void* HttpClient::acquire() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!idle_.empty()) {
      void* handle = idle_.back();
      idle_.pop_back();
      return handle;
    }
  }
  CURL* handle = curl_easy_init();
  DISTOPTIM_CHECK_WITH(DistributedError, handle != nullptr, "etcd at ", endpoint_,
                       ": libcurl could not make a handle");
  return handle;
}

void HttpClient::release(void* handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (idle_.size() < kMaxIdleHandles) {
    idle_.push_back(handle);
  } else {
    curl_easy_cleanup(static_cast<CURL*>(handle));
  }
}

namespace {

std::chrono::milliseconds until(Clock::time_point deadline) {
  return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                  std::chrono::milliseconds(1));
}

// Runs one POST on `handle`; returns libcurl's result, with `error` holding its detail.
CURLcode perform(CURL* handle, const std::string& url, const std::string& body,
                 std::chrono::milliseconds connect_bound, std::chrono::milliseconds total_bound,
                 Transfer& transfer, char (&error)[CURL_ERROR_SIZE]) {
  curl_easy_reset(handle);
  error[0] = '\0';
  transfer.handle = handle;
  curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
  // No "Expect: 100-continue" round trip for larger bodies.
  headers = curl_slist_append(headers, "Expect:");
  curl_easy_setopt(handle, CURLOPT_URL, url.c_str());
  curl_easy_setopt(handle, CURLOPT_PROTOCOLS_STR, "http");
  // The library reads no environment variable: no proxy from http_proxy and friends.
  curl_easy_setopt(handle, CURLOPT_NOPROXY, "*");
  // Threads: no signals (libcurl's timeouts would otherwise use SIGALRM); on Linux libcurl
  // sends with MSG_NOSIGNAL, so a closed connection is no SIGPIPE either.
  curl_easy_setopt(handle, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(handle, CURLOPT_POST, 1L);
  curl_easy_setopt(handle, CURLOPT_POSTFIELDS, body.data());
  curl_easy_setopt(handle, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body.size()));
  curl_easy_setopt(handle, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(handle, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(connect_bound.count()));
  curl_easy_setopt(handle, CURLOPT_TIMEOUT_MS, static_cast<long>(total_bound.count()));
  curl_easy_setopt(handle, CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(handle, CURLOPT_HEADERDATA, &transfer);
  curl_easy_setopt(handle, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(handle, CURLOPT_WRITEDATA, &transfer);
  curl_easy_setopt(handle, CURLOPT_ERRORBUFFER, error);
  const CURLcode result = curl_easy_perform(handle);
  // The handle may go back to the pool: nothing of this call may stay referenced by it.
  curl_easy_setopt(handle, CURLOPT_HTTPHEADER, nullptr);
  curl_easy_setopt(handle, CURLOPT_ERRORBUFFER, nullptr);
  curl_slist_free_all(headers);
  return result;
}

bool is_connection_lost(CURLcode code) {
  return code == CURLE_GOT_NOTHING || code == CURLE_SEND_ERROR || code == CURLE_RECV_ERROR ||
         code == CURLE_PARTIAL_FILE;
}

}  // namespace

std::string HttpClient::post(const std::string& path, const std::string& body,
                             const std::string& what, Clock::time_point deadline) {
  const std::chrono::milliseconds bound = std::min(until(deadline), request_timeout_);
  Transfer transfer;
  transfer.cap = max_response_bytes_;
  char error[CURL_ERROR_SIZE];
  auto* handle = static_cast<CURL*>(acquire());
  // (libcurl itself sends a request once more, on a new connection, when a kept-alive one was
  // closed or reset before any answer.)
  const CURLcode code = perform(handle, base_url_ + path, body, bound, bound, transfer, error);
  const long status = status_of(handle);
  long connects = 0;
  curl_easy_getinfo(handle, CURLINFO_NUM_CONNECTS, &connects);
  const bool reused = connects == 0;
  // A failed transfer's connection is in an unknown state: its handle is not reused.
  if (code == CURLE_OK) {
    release(handle);
  } else {
    curl_easy_cleanup(handle);
  }
  const std::string detail = error[0] != '\0' ? std::string(error) : curl_easy_strerror(code);
  const std::string at = c10::str("etcd at ", endpoint_, ": ", what);
  if (transfer.too_large) {
    if (transfer.announced_length > static_cast<long long>(max_response_bytes_)) {
      DISTOPTIM_THROW(DistributedError, at, ": the answer announces ", transfer.announced_length,
                      " bytes, above the cap of ", max_response_bytes_, " bytes; not read");
    }
    DISTOPTIM_THROW(DistributedError, at, ": the answer is larger than the cap of ",
                    max_response_bytes_, " bytes; cut off");
  }
  switch (code) {
    case CURLE_OK:
      break;
    case CURLE_COULDNT_CONNECT:
      DISTOPTIM_THROW(PeerLostError, at, ": cannot connect: ", detail);
    case CURLE_OPERATION_TIMEDOUT:
      DISTOPTIM_THROW(TimeoutError, at, ": no answer within ", detail::seconds_text(bound), ": ",
                      detail);
    default:
      if (is_connection_lost(code)) {
        DISTOPTIM_THROW(PeerLostError, at, ": the connection closed before the answer",
                        reused ? " (a kept-alive connection)" : " (a new connection)", ": ",
                        detail);
      }
      DISTOPTIM_THROW(DistributedError, at, ": ", detail);
  }
  DISTOPTIM_CHECK_WITH(DistributedError, status == 200, at, ": HTTP status ", status, ": ",
                       detail::printable(transfer.body, kQuotedBytes));
  return std::move(transfer.body);
}

HttpClient::StreamEnd HttpClient::post_stream(
    const std::string& path, const std::string& body, const std::string& what,
    Clock::time_point stream_until, const std::function<bool(const std::string&)>& on_line) {
  Transfer transfer;
  transfer.cap = max_response_bytes_;
  transfer.on_line = &on_line;
  char error[CURL_ERROR_SIZE];
  auto* handle = static_cast<CURL*>(acquire());
  const std::chrono::milliseconds connect_bound = std::min(until(stream_until), request_timeout_);
  const CURLcode code =
      perform(handle, base_url_ + path, body, connect_bound, until(stream_until), transfer, error);
  const long status = status_of(handle);
  // A stream is always cut off by us or by a timeout: its connection is not reused.
  curl_easy_cleanup(handle);
  const std::string detail = error[0] != '\0' ? std::string(error) : curl_easy_strerror(code);
  const std::string at = c10::str("etcd at ", endpoint_, ": ", what);
  if (transfer.too_large) {
    if (status != 200) {
      DISTOPTIM_THROW(DistributedError, at, ": HTTP status ", status,
                      ", with an answer larger than the cap of ", max_response_bytes_, " bytes");
    }
    DISTOPTIM_THROW(DistributedError, at, ": a line of the answer is larger than the cap of ",
                    max_response_bytes_, " bytes; cut off");
  }
  if (transfer.line_error) std::rethrow_exception(transfer.line_error);
  if (transfer.stopped) return StreamEnd::kStopped;
  if (code == CURLE_COULDNT_CONNECT) {
    DISTOPTIM_THROW(PeerLostError, at, ": cannot connect: ", detail);
  }
  if (code == CURLE_OPERATION_TIMEDOUT && status == 200) return StreamEnd::kTimedOut;
  if (code == CURLE_OPERATION_TIMEDOUT) {
    DISTOPTIM_THROW(TimeoutError, at, ": no answer within ", detail::seconds_text(connect_bound),
                    ": ", detail);
  }
  if (code == CURLE_OK || (status == 200 && is_connection_lost(code))) {
    DISTOPTIM_CHECK_WITH(DistributedError, status == 200, at, ": HTTP status ", status, ": ",
                         detail::printable(transfer.body, kQuotedBytes));
    return StreamEnd::kClosed;
  }
  if (is_connection_lost(code)) {
    DISTOPTIM_THROW(PeerLostError, at, ": the connection closed before the answer: ", detail);
  }
  DISTOPTIM_THROW(DistributedError, at, ": ", detail);
}

}  // namespace etcd
}  // namespace comm
}  // namespace distoptim
