#include <distoptim/comm/etcd_store.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <nlohmann/json.hpp>

#include <distoptim/comm/errors.h>

#include "error_text.h"
#include "etcd/base64.h"
#include "etcd/http_client.h"
#include "host_port.h"

namespace distoptim {
namespace comm {

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

// Range requests in one transaction when checking keys: etcd refuses a transaction of more than
// --max-txn-ops operations (128 by default).
constexpr size_t kKeysPerTransaction = 64;
// How deeply an answer of etcd may nest (its real answers nest 5 deep): checked before parsing,
// so that a hostile answer cannot make the parser's or the destructor's work unbounded.
constexpr int kMaxJsonDepth = 32;
// A watch runs at most this long before the keys are read again (a wait without a timeout).
constexpr std::chrono::seconds kLongestWatch{60};
// Pauses after a watch that ended with nothing of interest (etcd restarting, a compacted
// revision): short at first, growing, so that an endpoint ending every watch at once is not
// asked again in a tight loop.
constexpr std::chrono::milliseconds kFirstPause{10};
constexpr std::chrono::milliseconds kLongestPause{1000};

using detail::keys_text;
using detail::seconds_text;

std::string as_text(const std::vector<uint8_t>& bytes) {
  return std::string(bytes.begin(), bytes.end());
}

std::vector<uint8_t> as_bytes(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

// The end of etcd's range of every key starting with `prefix` (the prefix, its last byte plus
// one); prefixes here end with '/'.
std::string prefix_end(std::string prefix) {
  prefix.back() = static_cast<char>(prefix.back() + 1);
  return prefix;
}

bool nests_deeper_than(const std::string& text, int limit) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > limit) return true;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return false;
}

bool is_job_name(const std::string& job) {
  return !job.empty() && std::all_of(job.begin(), job.end(), [](unsigned char c) {
    return std::isalnum(c) != 0 || c == '.' || c == '_' || c == '-';
  });
}

// One key as etcd reports it.
struct KeyValue {
  std::string key;
  std::string value;
  int64_t mod_revision = 0;
};

}  // namespace

struct EtcdStore::Impl {
  explicit Impl(const EtcdStoreOptions& options)
      : http(options.endpoint(), kMaxResponseBytes, options.request_timeout()),
        prefix("/distoptim/" + options.job() + "/"),
        request_timeout(options.request_timeout()) {}

  etcd::HttpClient http;
  const std::string prefix;
  const std::chrono::milliseconds request_timeout;
  std::mutex mutex;  // guards EtcdStore::timeout_

  std::chrono::milliseconds timeout_of(const EtcdStore& store) {
    std::lock_guard<std::mutex> lock(mutex);
    return store.timeout_;
  }

  // ---- Reading etcd's answers: every field checked, none trusted. ----

  [[noreturn]] void malformed(const std::string& what, const std::string& why) const {
    DISTOPTIM_THROW(DistributedError, "etcd at ", http.endpoint(), ": ", what,
                    ": not an answer of etcd: ", why);
  }

  json parse(const std::string& body, const std::string& what) const {
    if (nests_deeper_than(body, kMaxJsonDepth)) {
      malformed(what, c10::str("JSON nested more than ", kMaxJsonDepth, " deep"));
    }
    json answer = json::parse(body, nullptr, /*allow_exceptions=*/false);
    if (answer.is_discarded() || !answer.is_object()) {
      malformed(what, c10::str("not a JSON object: '", detail::printable(body, 80), "'"));
    }
    return answer;
  }

  // The object (or, with `array`, the array) `name` of `parent`; an empty one when absent (the
  // gateway leaves out fields of default value).
  const json& field(const json& parent, const char* name, bool array,
                    const std::string& what) const {
    static const json kEmptyObject = json::object();
    static const json kEmptyArray = json::array();
    const auto it = parent.find(name);
    if (it == parent.end()) return array ? kEmptyArray : kEmptyObject;
    if (array ? !it->is_array() : !it->is_object()) {
      malformed(what, c10::str("'", name, "' is not ", array ? "an array" : "an object"));
    }
    return *it;
  }

  // An int64 field: the gateway writes them as decimal strings; 0 when absent.
  int64_t integer(const json& parent, const char* name, const std::string& what) const {
    const auto it = parent.find(name);
    if (it == parent.end()) return 0;
    if (it->is_number_integer()) return it->get<int64_t>();
    if (it->is_string()) {
      const std::string& text = it->get_ref<const std::string&>();
      errno = 0;
      char* end = nullptr;
      const long long value = std::strtoll(text.c_str(), &end, 10);
      if (!text.empty() && errno == 0 && *end == '\0') return value;
    }
    malformed(what, c10::str("'", name, "' is not an integer"));
  }

  bool boolean(const json& parent, const char* name, const std::string& what) const {
    const auto it = parent.find(name);
    if (it == parent.end()) return false;
    if (!it->is_boolean()) malformed(what, c10::str("'", name, "' is not a boolean"));
    return it->get<bool>();
  }

  // A bytes field (base64); empty when absent.
  std::string bytes(const json& parent, const char* name, const std::string& what) const {
    const auto it = parent.find(name);
    if (it == parent.end()) return "";
    std::optional<std::string> decoded;
    if (it->is_string()) decoded = etcd::base64_decode(it->get_ref<const std::string&>());
    if (!decoded) malformed(what, c10::str("'", name, "' is not base64"));
    return std::move(*decoded);
  }

  int64_t revision(const json& answer, const std::string& what) const {
    return integer(field(answer, "header", false, what), "revision", what);
  }

  std::vector<KeyValue> key_values(const json& range, const std::string& what) const {
    std::vector<KeyValue> out;
    for (const json& kv : field(range, "kvs", true, what)) {
      if (!kv.is_object()) malformed(what, "an entry of 'kvs' is not an object");
      out.push_back(
          {bytes(kv, "key", what), bytes(kv, "value", what), integer(kv, "mod_revision", what)});
    }
    return out;
  }

  // The key `key` (full) of a range answer, if there.
  std::optional<KeyValue> only_key(const json& range, const std::string& key,
                                   const std::string& what) const {
    std::vector<KeyValue> found = key_values(range, what);
    if (found.empty()) return std::nullopt;
    if (found.size() != 1 || found[0].key != key) {
      malformed(what, "a range of one key answered with other keys");
    }
    return std::move(found[0]);
  }

  // ---- Requests. ----

  json post(const std::string& path, const json& request, const std::string& what,
            Clock::time_point deadline) {
    return parse(http.post(path, request.dump(), what, deadline), what);
  }

  Clock::time_point request_deadline() const { return Clock::now() + request_timeout; }

  std::optional<KeyValue> range(const std::string& key, const std::string& what) {
    const json answer =
        post("/v3/kv/range", {{"key", etcd::base64_encode(key)}}, what, request_deadline());
    return only_key(answer, key, what);
  }

  // The keys of `keys` (the caller's, without the prefix) that do not exist, and the revision
  // etcd read them at (the oldest of the transactions', when there are several).
  std::pair<std::vector<std::string>, int64_t> missing_keys(const std::vector<std::string>& keys,
                                                            const std::string& what) {
    std::vector<std::string> missing;
    int64_t read_at = INT64_MAX;
    for (size_t begin = 0; begin < keys.size(); begin += kKeysPerTransaction) {
      const size_t end = std::min(keys.size(), begin + kKeysPerTransaction);
      json ranges = json::array();
      for (size_t i = begin; i < end; ++i) {
        ranges.push_back(
            {{"request_range",
              {{"key", etcd::base64_encode(prefix + keys[i])}, {"count_only", true}}}});
      }
      const json answer = post("/v3/kv/txn", {{"success", ranges}}, what, request_deadline());
      const json& responses = field(answer, "responses", true, what);
      if (responses.size() != end - begin) malformed(what, "not one response per key");
      for (size_t i = begin; i < end; ++i) {
        const json& response = responses[i - begin];
        if (!response.is_object()) malformed(what, "a response is not an object");
        if (integer(field(response, "response_range", false, what), "count", what) == 0) {
          missing.push_back(keys[i]);
        }
      }
      read_at = std::min(read_at, revision(answer, what));
    }
    return {missing, read_at};
  }

  // Writes `value` to `key` (full) when `compare` holds (a comparison of etcd's Compare, as
  // JSON); otherwise reads the key. Returns whether it wrote, and what it read.
  std::pair<bool, std::optional<KeyValue>> write_if(const std::string& key,
                                                    const std::string& value, json compare,
                                                    const std::string& what) {
    const std::string key64 = etcd::base64_encode(key);
    compare["key"] = key64;
    compare["result"] = "EQUAL";
    const json request = {
        {"compare", json::array({compare})},
        {"success",
         json::array({{{"request_put", {{"key", key64}, {"value", etcd::base64_encode(value)}}}}})},
        {"failure", json::array({{{"request_range", {{"key", key64}}}}})}};
    const json answer = post("/v3/kv/txn", request, what, request_deadline());
    if (boolean(answer, "succeeded", what)) return {true, std::nullopt};
    const json& responses = field(answer, "responses", true, what);
    if (responses.size() != 1 || !responses[0].is_object()) {
      malformed(what, "a failed transaction without its one range");
    }
    return {false, only_key(field(responses[0], "response_range", false, what), key, what)};
  }

  // What a read-modify-write decides from the value it read (nullopt: the key is absent):
  // the value to write, if any, and what the operation returns.
  struct Decision {
    std::optional<std::string> write;
    std::string result;
  };

  // Reads `key`, decides, and writes only if the key did not change since it was read (its
  // mod_revision, or its absence); otherwise decides again on what the failed write read.
  // Each round trip that fails means another client's write succeeded, so every round makes
  // progress for someone; the rounds end by the store's timeout.
  std::string read_modify_write(
      const std::string& user_key, const std::string& what,
      const std::function<Decision(const std::optional<std::string>&)>& decide,
      std::chrono::milliseconds timeout) {
    const std::string key = prefix + user_key;
    const auto deadline = Clock::now() + timeout;
    std::optional<KeyValue> current = range(key, what);
    for (int round = 1;; ++round) {
      const Decision decision =
          decide(current ? std::optional<std::string>(current->value) : std::nullopt);
      if (!decision.write) return decision.result;
      json compare =
          current ? json{{"target", "MOD"}, {"mod_revision", std::to_string(current->mod_revision)}}
                  : json{{"target", "CREATE"}, {"create_revision", "0"}};
      auto [written, read] = write_if(key, *decision.write, std::move(compare), what);
      if (written) return decision.result;
      current = std::move(read);
      DISTOPTIM_CHECK_WITH(TimeoutError, timeout == kNoTimeout || Clock::now() < deadline,
                           "etcd at ", http.endpoint(), ": ", what, " lost ", round,
                           " races to other writers of the key within ", seconds_text(timeout));
    }
  }

  // Watches the keys of `missing` (full keys) from `revision` until one of them changes
  // (true), or `until` passes, or etcd ends the watch (false).
  bool watch(const std::vector<std::string>& missing, int64_t revision, Clock::time_point until,
             const std::string& what) {
    const std::set<std::string> wanted(missing.begin(), missing.end());
    const json request = {
        {"create_request",
         {{"key", etcd::base64_encode(*wanted.begin())},
          {"range_end", etcd::base64_encode(*wanted.rbegin() + std::string(1, '\0'))},
          {"start_revision", std::to_string(revision)}}}};
    bool changed = false;
    std::optional<std::string> error;
    http.post_stream("/v3/watch", request.dump(), what, until, [&](const std::string& line) {
      if (std::all_of(line.begin(), line.end(), [](unsigned char c) { return std::isspace(c); })) {
        return true;
      }
      const json message = parse(line, what);
      if (message.contains("error")) {
        const json& e = message["error"];
        error = e.is_object() && e.contains("message") ? e["message"].dump() : e.dump();
        return false;
      }
      const json& result = field(message, "result", false, what);
      for (const json& event : field(result, "events", true, what)) {
        if (!event.is_object()) malformed(what, "a watch event is not an object");
        if (wanted.count(bytes(field(event, "kv", false, what), "key", what)) > 0) {
          changed = true;
          return false;
        }
      }
      // A watch etcd cancelled (a compacted revision, say) ends here; the keys are read again.
      return !boolean(result, "canceled", what);
    });
    DISTOPTIM_CHECK_WITH(DistributedError, !error, "etcd at ", http.endpoint(), ": ", what,
                         ": the watch failed: ", detail::printable(*error, 200));
    return changed;
  }

  // Waits until every key of `keys` exists, or `timeout` from `start` passes (TimeoutError
  // naming the keys still missing).
  void wait_for(const std::vector<std::string>& keys, Clock::time_point start,
                std::chrono::milliseconds timeout, const std::string& what) {
    const auto deadline = timeout == kNoTimeout ? Clock::time_point::max() : start + timeout;
    auto pause = kFirstPause;
    while (true) {
      auto [missing, revision] = missing_keys(keys, what);
      if (missing.empty()) return;
      const auto now = Clock::now();
      DISTOPTIM_CHECK_WITH(TimeoutError, now < deadline, "etcd at ", http.endpoint(), ": ", what,
                           " timed out after ", seconds_text(timeout),
                           "; keys still missing: ", keys_text(missing));
      std::vector<std::string> full;
      for (const auto& key : missing) full.push_back(prefix + key);
      const auto until = deadline - now > kLongestWatch ? now + kLongestWatch : deadline;
      if (watch(full, revision + 1, until, what)) {
        pause = kFirstPause;
      } else if (Clock::now() < until) {
        // Ended early with nothing of interest.
        std::this_thread::sleep_for(std::min<Clock::duration>(pause, until - Clock::now()));
        pause = std::min(pause * 2, kLongestPause);
      }
    }
  }
};

EtcdStore::EtcdStore(EtcdStoreOptions options) : c10d::Store(options.timeout()) {
  detail::parse_host_port(options.endpoint(),
                          c10::str("EtcdStore: endpoint '", options.endpoint(), "'"), "HOST:PORT");
  TORCH_CHECK_VALUE(is_job_name(options.job()), "EtcdStore: job '", options.job(),
                    "' must be letters, digits, '.', '_' or '-', and not empty");
  TORCH_CHECK_VALUE(options.timeout().count() >= 0,
                    "EtcdStore: timeout = ", options.timeout().count(),
                    " ms; must not be negative");
  TORCH_CHECK_VALUE(options.request_timeout().count() > 0,
                    "EtcdStore: request_timeout = ", options.request_timeout().count(),
                    " ms; must be positive");
  impl_ = std::make_unique<Impl>(options);
}

EtcdStore::~EtcdStore() = default;

const std::string& EtcdStore::endpoint() const { return impl_->http.endpoint(); }

const std::string& EtcdStore::key_prefix() const { return impl_->prefix; }

namespace {

void check_value_size(const std::string& what, size_t size) {
  TORCH_CHECK_VALUE(size <= EtcdStore::kMaxValueBytes, "EtcdStore: ", what, ": value of ", size,
                    " bytes; at most ", EtcdStore::kMaxValueBytes, " bytes");
}

}  // namespace

void EtcdStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  const std::string what = "set(" + key + ")";
  check_value_size(what, value.size());
  impl_->post("/v3/kv/put",
              {{"key", etcd::base64_encode(impl_->prefix + key)},
               {"value", etcd::base64_encode(as_text(value))}},
              what, impl_->request_deadline());
}

std::vector<uint8_t> EtcdStore::compareSet(const std::string& key,
                                           const std::vector<uint8_t>& expected_value,
                                           const std::vector<uint8_t>& desired_value) {
  const std::string what = "compareSet(" + key + ")";
  check_value_size(what, desired_value.size());
  const std::string expected = as_text(expected_value);
  const std::string desired = as_text(desired_value);
  return as_bytes(impl_->read_modify_write(
      key, what,
      [&](const std::optional<std::string>& current) -> Impl::Decision {
        // TCPStore (1.13): an absent key is created only when `expected` is empty; otherwise
        // `expected` itself is returned.
        if (!current)
          return expected.empty() ? Impl::Decision{desired, desired}
                                  : Impl::Decision{std::nullopt, expected};
        if (*current == expected) return {desired, desired};
        return {std::nullopt, *current};
      },
      impl_->timeout_of(*this)));
}

std::vector<uint8_t> EtcdStore::get(const std::string& key) {
  const std::string what = "get(" + key + ")";
  const std::chrono::milliseconds timeout = impl_->timeout_of(*this);
  const auto start = Clock::now();
  while (true) {
    if (auto found = impl_->range(impl_->prefix + key, what)) return as_bytes(found->value);
    // Also when the key was deleted between the wait and the read: wait again, up to the same
    // deadline.
    impl_->wait_for({key}, start, timeout, what);
  }
}

int64_t EtcdStore::add(const std::string& key, int64_t value) {
  const std::string what = c10::str("add(", key, ", ", value, ")");
  const std::chrono::milliseconds timeout = impl_->timeout_of(*this);
  const std::string sum = impl_->read_modify_write(
      key, what,
      [&](const std::optional<std::string>& current) -> Impl::Decision {
        int64_t old = 0;
        if (current) {
          errno = 0;
          char* end = nullptr;
          old = std::strtoll(current->c_str(), &end, 10);
          TORCH_CHECK_VALUE(!current->empty() && errno == 0 && *end == '\0' &&
                                end == current->c_str() + current->size(),
                            "EtcdStore: ", what, " at etcd ", endpoint(),
                            ": the key holds no integer");
        }
        int64_t result = 0;
        TORCH_CHECK_VALUE(!__builtin_add_overflow(old, value, &result), "EtcdStore: ", what,
                          " at etcd ", endpoint(), ": ", old, " + ", value, " overflows int64");
        const std::string text = std::to_string(result);
        return {text, text};
      },
      timeout);
  return std::stoll(sum);
}

bool EtcdStore::deleteKey(const std::string& key) {
  const std::string what = "deleteKey(" + key + ")";
  const json answer =
      impl_->post("/v3/kv/deleterange", {{"key", etcd::base64_encode(impl_->prefix + key)}}, what,
                  impl_->request_deadline());
  return impl_->integer(answer, "deleted", what) > 0;
}

bool EtcdStore::check(const std::vector<std::string>& keys) {
  if (keys.empty()) return true;
  return impl_->missing_keys(keys, "check(" + keys_text(keys) + ")").first.empty();
}

int64_t EtcdStore::getNumKeys() {
  const std::string what = "getNumKeys()";
  const json answer = impl_->post("/v3/kv/range",
                                  {{"key", etcd::base64_encode(impl_->prefix)},
                                   {"range_end", etcd::base64_encode(prefix_end(impl_->prefix))},
                                   {"count_only", true}},
                                  what, impl_->request_deadline());
  return impl_->integer(answer, "count", what);
}

void EtcdStore::wait(const std::vector<std::string>& keys) {
  const std::chrono::milliseconds timeout = impl_->timeout_of(*this);
  wait(keys, timeout);
}

void EtcdStore::wait(const std::vector<std::string>& keys,
                     const std::chrono::milliseconds& timeout) {
  if (keys.empty()) return;
  impl_->wait_for(keys, Clock::now(), timeout, "wait(" + keys_text(keys) + ")");
}

void EtcdStore::setTimeout(const std::chrono::milliseconds& timeout) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  timeout_ = timeout;
}

}  // namespace comm
}  // namespace distoptim
