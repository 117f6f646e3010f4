#include "state_dict_agreement.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <openssl/evp.h>

#include <distoptim/comm/errors.h>

#include "parameter_check.h"

namespace distoptim {
namespace data_parallel {

namespace {

// Incremental SHA-256 over OpenSSL's EVP interface: tensors are hashed in place, never copied
// into one serialized buffer.
class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new(), &EVP_MD_CTX_free) {
    TORCH_CHECK(ctx_ != nullptr && EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) == 1,
                "state dict digest: initializing SHA-256 failed");
  }
  void bytes(const void* data, size_t size) {
    if (size == 0) return;
    TORCH_CHECK(EVP_DigestUpdate(ctx_.get(), data, size) == 1,
                "state dict digest: SHA-256 update failed");
  }
  // Fixed-width little-endian integers and length-prefixed strings keep the encoding
  // unambiguous: no two dicts give the same byte stream.
  void u64(uint64_t value) {
    uint8_t out[8];
    for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(value >> (8 * i));
    bytes(out, sizeof(out));
  }
  void tag(char t) { bytes(&t, 1); }
  void str(const std::string& s) {
    u64(s.size());
    bytes(s.data(), s.size());
  }
  void number(double value) {
    uint64_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    u64(bits);
  }
  StateDictDigest finish() {
    StateDictDigest out{};
    unsigned int size = 0;
    TORCH_CHECK(EVP_DigestFinal_ex(ctx_.get(), out.data(), &size) == 1 && size == out.size(),
                "state dict digest: SHA-256 final failed");
    return out;
  }

 private:
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx_;
};

// An option value: what OptionBag allows (numbers, bools, strings, tuples or lists of numbers),
// numbers as doubles and sequences alike, as OptionBag's equality sees them.
void hash_option(Sha256& h, const c10::IValue& value) {
  if (value.isDouble() || value.isInt()) {
    h.tag('n');
    h.number(value.isDouble() ? value.toDouble() : static_cast<double>(value.toInt()));
  } else if (value.isBool()) {
    h.tag('b');
    h.tag(value.toBool() ? 1 : 0);
  } else if (value.isString()) {
    h.tag('s');
    h.str(value.toStringRef());
  } else if (value.isTuple() || value.isList()) {
    const auto elements =
        value.isTuple() ? value.toTupleRef().elements().vec() : value.toListRef().vec();
    h.tag('q');
    h.u64(elements.size());
    for (const auto& e : elements) hash_option(h, e);
  } else {
    TORCH_CHECK_TYPE(false, "state dict digest: an option value of type ", value.tagKind());
  }
}

void hash_options(Sha256& h, const optim::OptionBag& bag) {
  h.u64(bag.size());
  for (const auto& [key, value] : bag.items()) {
    h.str(key);
    hash_option(h, value);
  }
}

void hash_tensor(Sha256& h, const at::Tensor& tensor) {
  TORCH_CHECK_VALUE(tensor.defined(), "state dict digest: an undefined tensor");
  const at::Tensor dense = (tensor.device().is_cpu() ? tensor : tensor.cpu()).contiguous();
  h.u64(static_cast<uint64_t>(dense.scalar_type()));
  h.u64(dense.dim());
  for (int64_t size : dense.sizes()) h.u64(size);
  h.bytes(dense.data_ptr(), dense.nbytes());
}

// At most `limit` bytes of `text`, cut at a UTF-8 character boundary and marked when cut.
std::string bounded(const std::string& text, size_t limit) {
  if (text.size() <= limit) return text;
  const std::string mark = " [...]";
  size_t end = limit - mark.size();
  while (end > 0 && (static_cast<uint8_t>(text[end]) & 0xC0) == 0x80) --end;
  return text.substr(0, end) + mark;
}

// "rank 2" or "ranks 0, 1, 3"; long lists are cut after 16 ranks.
std::string rank_list(const std::vector<int>& ranks) {
  constexpr size_t kShown = 16;
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size() && i < kShown; ++i) {
    out += (i ? ", " : "") + std::to_string(ranks[i]);
  }
  if (ranks.size() > kShown) out += c10::str(", ... (", ranks.size(), " ranks)");
  return out;
}

std::string short_hex(const StateDictDigest& digest) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < 8; ++i) {
    out += kHex[digest[i] >> 4];
    out += kHex[digest[i] & 0xF];
  }
  return out + "...";
}

// One rank's check as a fixed-size record: ok flag, digest, text length (2 bytes), text.
constexpr size_t kDigestAt = 1;
constexpr size_t kLengthAt = kDigestAt + std::tuple_size<StateDictDigest>::value;
constexpr size_t kTextAt = kLengthAt + 2;
constexpr size_t kRecordBytes = kTextAt + kMaxStateDictErrorBytes;
static_assert(kMaxStateDictErrorBytes < 65536, "the text length travels in two bytes");

at::Tensor encode(const StateDictCheck& check) {
  at::Tensor record = at::zeros({static_cast<int64_t>(kRecordBytes)}, at::kByte);
  uint8_t* data = record.data_ptr<uint8_t>();
  const std::string text = bounded(check.error, kMaxStateDictErrorBytes);
  data[0] = check.error.empty() ? 1 : 0;
  std::copy(check.digest.begin(), check.digest.end(), data + kDigestAt);
  data[kLengthAt] = static_cast<uint8_t>(text.size() & 0xFF);
  data[kLengthAt + 1] = static_cast<uint8_t>(text.size() >> 8);
  std::memcpy(data + kTextAt, text.data(), text.size());
  return record;
}

struct Received {
  bool ok;
  StateDictDigest digest;
  std::string error;
};

Received decode(const at::Tensor& record) {
  const uint8_t* data = record.data_ptr<uint8_t>();
  Received out{data[0] == 1, {}, {}};
  std::copy(data + kDigestAt, data + kLengthAt, out.digest.begin());
  const size_t length =
      std::min<size_t>(data[kLengthAt] | (data[kLengthAt + 1] << 8), kMaxStateDictErrorBytes);
  out.error.assign(reinterpret_cast<const char*>(data + kTextAt), length);
  return out;
}

// At most this many distinct error texts, and digests, are spelled out in one message.
constexpr size_t kShownGroups = 4;

// Ranks grouped by a key, groups in the order of their first rank.
template <class Key>
std::vector<std::pair<Key, std::vector<int>>> group_ranks(
    const std::vector<std::pair<int, Key>>& items) {
  std::vector<std::pair<Key, std::vector<int>>> groups;
  for (const auto& item : items) {
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == item.second; });
    if (it == groups.end()) {
      groups.push_back({item.second, {item.first}});
    } else {
      it->second.push_back(item.first);
    }
  }
  return groups;
}

}  // namespace

StateDictDigest state_dict_digest(const optim::OptimizerStateDict& dict) {
  Sha256 h;
  h.str("distoptim.OptimizerStateDict/1");
  h.str(dict.optimizer);
  hash_options(h, dict.defaults);
  h.u64(dict.param_groups.size());
  for (const auto& group : dict.param_groups) {
    h.u64(group.param_indices.size());
    for (int64_t index : group.param_indices) h.u64(index);
    hash_options(h, group.overrides);
  }
  h.u64(dict.state.size());
  for (const auto& [index, state] : dict.state) {
    h.u64(index);
    h.u64(state.step);
    h.u64(state.buffers.size());
    for (const auto& [name, tensor] : state.buffers) {
      h.str(name);
      hash_tensor(h, tensor);
    }
  }
  return h.finish();
}

StateDictDigest bytes_digest(const void* data, size_t size) {
  Sha256 h;
  h.bytes(data, size);
  return h.finish();
}

std::string error_text(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return error != nullptr ? error->what_without_backtrace() : e.what();
}

void agree_on_state_dict(const comm::Group& group, const StateDictCheck& mine,
                         const std::string& caller, const AgreementWording& wording) {
  std::vector<at::Tensor> records;
  try {
    records = allgather_tensor(group, encode(mine));
  } catch (const std::exception& e) {
    DISTOPTIM_RETHROW_WITH_CONTEXT(e, caller, ": exchanging ", wording.exchanged, " across the ",
                                   group.size(), " ranks of the group failed on rank ",
                                   group.global_rank(group.rank()), " (every rank must call ",
                                   wording.call, "; ", wording.outcome_here, "): ");
  }
  std::vector<std::pair<int, std::string>> failed;
  std::vector<std::pair<int, StateDictDigest>> digests;
  for (int r = 0; r < group.size(); ++r) {
    const Received got = decode(records[r]);
    if (got.ok) {
      digests.emplace_back(group.global_rank(r), got.digest);
    } else {
      failed.emplace_back(group.global_rank(r), got.error);
    }
  }
  std::vector<std::string> parts;
  const auto failures = group_ranks(failed);
  for (size_t i = 0; i < failures.size() && i < kShownGroups; ++i) {
    parts.push_back(
        c10::str(rank_list(failures[i].second), " ", wording.failed, ": ", failures[i].first));
  }
  if (failures.size() > kShownGroups) {
    parts.push_back(c10::str(failures.size() - kShownGroups, " more error(s) on other ranks"));
  }
  // The reference is the digest most ranks hold; groups come in rank order, so on a tie the
  // one of the lowest rank wins.
  const auto by_digest = group_ranks(digests);
  if (by_digest.size() > 1) {
    const auto reference = std::max_element(
        by_digest.begin(), by_digest.end(),
        [](const auto& a, const auto& b) { return a.second.size() < b.second.size(); });
    std::vector<int> differing;
    std::string digests_text;
    size_t shown = 0;
    for (const auto& g : by_digest) {
      if (&g == &*reference) continue;
      differing.insert(differing.end(), g.second.begin(), g.second.end());
      if (shown++ < kShownGroups) {
        digests_text += c10::str(short_hex(g.first), " on ", rank_list(g.second), ", ");
      }
    }
    std::sort(differing.begin(), differing.end());
    parts.push_back(c10::str(wording.disagree, ": ", rank_list(differing),
                             (differing.size() == 1 ? " differs" : " differ"), " from rank ",
                             reference->second.front(), " (SHA-256 ", digests_text,
                             short_hex(reference->first), " on ", rank_list(reference->second),
                             ")"));
  }
  if (parts.empty()) return;
  std::string message = caller + ": ";
  for (const auto& part : parts) message += part + "; ";
  TORCH_CHECK_VALUE(false, message, wording.outcome);
}

}  // namespace data_parallel
}  // namespace distoptim
