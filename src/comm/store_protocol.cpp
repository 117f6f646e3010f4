// The parsing of LibTorch 1.13's store queries (store_protocol.h).

#include "store_protocol.h"

#include <algorithm>
#include <cstring>

namespace distoptim {
namespace comm {
namespace detail {

Parse QueryParser::parse(WholeQuery& query, std::string& why) {
  uint8_t type = 0;
  if (!read_byte(type)) return Parse::kPartial;
  if (type > static_cast<uint8_t>(Query::kDeleteKey) ||
      type == static_cast<uint8_t>(Query::kWatchKey)) {
    why = "a query of unknown or unsupported type " + std::to_string(type);
    return Parse::kInvalid;
  }
  query.type = static_cast<Query>(type);
  switch (query.type) {
    case Query::kCheck:
    case Query::kWait: {
      uint64_t count = 0;
      if (!read_u64(count)) return Parse::kPartial;
      if (count > options_.max_keys_per_query) {
        why = "a query of " + std::to_string(count) + " keys (at most " +
              std::to_string(options_.max_keys_per_query) + ")";
        return Parse::kInvalid;
      }
      for (uint64_t i = 0; i < count; ++i) {
        std::string_view key;
        if (const Parse p = field(key, options_.max_key_bytes, "key", why); p != Parse::kWhole)
          return p;
        query.keys.push_back(key);
      }
      break;
    }
    case Query::kNumKeys:
      break;
    default: {
      std::string_view key;
      if (const Parse p = field(key, options_.max_key_bytes, "key", why); p != Parse::kWhole)
        return p;
      query.keys.push_back(key);
      if (query.type == Query::kSet || query.type == Query::kCompareSet) {
        if (const Parse p = field(query.value, options_.max_value_bytes, "value", why);
            p != Parse::kWhole)
          return p;
      }
      if (query.type == Query::kCompareSet) {
        if (const Parse p = field(query.desired, options_.max_value_bytes, "value", why);
            p != Parse::kWhole)
          return p;
      }
      if (query.type == Query::kAdd) {
        uint64_t delta = 0;
        if (!read_u64(delta)) return Parse::kPartial;
        query.delta = static_cast<int64_t>(delta);
      }
    }
  }
  return Parse::kWhole;
}

bool QueryParser::read_byte(uint8_t& out) {
  if (bytes_.size() - at_ < 1) return false;
  out = static_cast<uint8_t>(bytes_[at_++]);
  return true;
}

bool QueryParser::read_u64(uint64_t& out) {
  if (bytes_.size() - at_ < sizeof out) return false;
  std::memcpy(&out, bytes_.data() + at_, sizeof out);
  at_ += sizeof out;
  return true;
}

Parse QueryParser::field(std::string_view& out, size_t bound, const char* what, std::string& why) {
  uint64_t length = 0;
  if (!read_u64(length)) return Parse::kPartial;
  if (length > bound) {
    why = "a " + std::string(what) + " of " + std::to_string(length) + " bytes (at most " +
          std::to_string(bound) + ")";
    return Parse::kInvalid;
  }
  if (bytes_.size() - at_ < length) return Parse::kPartial;
  out = bytes_.substr(at_, length);
  at_ += length;
  return Parse::kWhole;
}

size_t max_query_bytes(const StoreServerOptions& o) {
  const size_t keyed = 1 + 2 * 8 + o.max_key_bytes + 2 * (8 + o.max_value_bytes);
  const size_t listed = 1 + 8 + o.max_keys_per_query * (8 + o.max_key_bytes);
  return std::max(keyed, listed);
}

}  // namespace detail
}  // namespace comm
}  // namespace distoptim
