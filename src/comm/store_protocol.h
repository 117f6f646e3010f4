#pragma once

// LibTorch 1.13's TCPStore wire protocol, as StoreServer (store_server.h) reads and answers it: a
// query is a type byte, then its fields; a key or value is a 64-bit length in the host's byte
// order then its bytes; a number is a 64-bit integer in the host's byte order. The client sends
// a key with a "/" before it, which is part of the key here.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <distoptim/comm/store_server.h>

namespace distoptim {
namespace comm {
namespace detail {

// The first byte of a query (LibTorch 1.13's order).
enum class Query : uint8_t {
  kSet,
  kCompareSet,
  kGet,
  kAdd,
  kCheck,
  kWait,
  kNumKeys,
  kWatchKey,
  kDeleteKey,
};
constexpr uint8_t kReady = 0;
constexpr uint8_t kNotReady = 1;
constexpr uint8_t kStopWaiting = 0;
// A query whose bytes have all come. The views point into the client's input buffer.
struct WholeQuery {
  Query type = Query::kSet;
  std::vector<std::string_view> keys;
  std::string_view value;    // set: the value; compare-set: the value expected
  std::string_view desired;  // compare-set: the value to set
  int64_t delta = 0;         // add
};

// Whether the bytes so far hold a whole query, the start of one, or bytes no client sends.
enum class Parse { kWhole, kPartial, kInvalid };

// Reads one query from the front of a client's bytes. Each length is checked against its bound
// as soon as it has come, before the bytes it announces.
class QueryParser {
 public:
  QueryParser(std::string_view bytes, const StoreServerOptions& options)
      : bytes_(bytes), options_(options) {}

  /// kWhole fills `query`; kInvalid says why in `why`.
  Parse parse(WholeQuery& query, std::string& why);
  /// The bytes of the whole query parsed.
  size_t consumed() const { return at_; }

 private:
  bool read_byte(uint8_t& out);
  bool read_u64(uint64_t& out);
  Parse field(std::string_view& out, size_t bound, const char* what, std::string& why);

  std::string_view bytes_;
  const StoreServerOptions& options_;
  size_t at_ = 0;
};

inline void append_u64(std::string& out, uint64_t value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof value);
}

inline void append_bytes(std::string& out, std::string_view bytes) {
  append_u64(out, bytes.size());
  out.append(bytes);
}

/// The most bytes a query can take within `options`' bounds: a partial query longer than this
/// is not one a client sends.
size_t max_query_bytes(const StoreServerOptions& options);

}  // namespace detail
}  // namespace comm
}  // namespace distoptim
