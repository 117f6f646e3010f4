#include "step_mirror.h"

#include <map>
#include <optional>
#include <tuple>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <distoptim/rpc/api.h>
#include <distoptim/rpc/detail/internal_registry.h>
#include <distoptim/rpc/values.h>

#include "huge_pages.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

namespace {

constexpr const char* kApply = "__distoptim.replicas.apply";
constexpr const char* kKeys = "__distoptim.replicas.keys";
constexpr const char* kCopy = "__distoptim.replicas.copy";
constexpr const char* kDropState = "__distoptim.replicas.drop_state";

// The copies this process keeps as a backup, by primary and key. A new incarnation of the backup
// starts with none: its primaries send theirs whole again.
struct Copies {
  std::mutex mutex;
  std::map<std::string, std::map<std::string, at::Tensor>> by_primary;  // guarded by mutex
};

Copies& copies() {
  static Copies* instance = new Copies();  // never destroyed: requests may run at exit
  return *instance;
}

std::string where(const std::string& primary, const std::string& key) {
  return "the copy of '" + key + "' from worker '" + primary + "' on worker '" +
         rpc::get_worker_info().name + "'";
}

// Checks every update against the copies before any is applied: all or nothing.
void check_updates(const std::map<std::string, at::Tensor>& held, const std::string& primary,
                   const std::vector<std::string>& keys, const std::vector<int64_t>& whole,
                   const std::vector<at::Tensor>& rows, const std::vector<at::Tensor>& values) {
  TORCH_CHECK_VALUE(
      whole.size() == keys.size() && rows.size() == keys.size() && values.size() == keys.size(),
      "replicas: an update from worker '", primary, "' with ", keys.size(), " keys, ", whole.size(),
      " flags, ", rows.size(), " row sets and ", values.size(), " values");
  for (size_t i = 0; i < keys.size(); ++i) {
    const at::Tensor& value = values[i];
    TORCH_CHECK_VALUE(value.defined() && value.layout() == c10::kStrided && value.is_cpu(),
                      "replicas: ", where(primary, keys[i]),
                      ": the values must be a dense CPU tensor");
    if (whole[i] != 0) continue;
    auto it = held.find(keys[i]);
    TORCH_CHECK_VALUE(it != held.end(), "replicas: ", where(primary, keys[i]),
                      " was never sent whole, so it cannot take rows");
    const at::Tensor& copy = it->second;
    const at::Tensor& r = rows[i];
    TORCH_CHECK_VALUE(r.dim() == 1 && r.scalar_type() == at::kLong && copy.dim() >= 1 &&
                          value.dim() == copy.dim() && value.size(0) == r.numel() &&
                          value.sizes().slice(1) == copy.sizes().slice(1) &&
                          value.scalar_type() == copy.scalar_type(),
                      "replicas: ", where(primary, keys[i]), " has shape ", copy.sizes(),
                      "; rows of shape ", value.sizes(), " at ", r.sizes(),
                      " indices cannot go in");
    if (r.numel() > 0) {
      const int64_t low = r.min().item<int64_t>(), high = r.max().item<int64_t>();
      TORCH_CHECK_VALUE(low >= 0 && high < copy.size(0), "replicas: ", where(primary, keys[i]),
                        " has ", copy.size(0), " rows; row ", low < 0 ? low : high,
                        " cannot go in");
    }
  }
}

c10::IValue on_apply(const std::string& primary, const std::vector<std::string>& keys,
                     const std::vector<int64_t>& whole, const std::vector<at::Tensor>& rows,
                     const std::vector<at::Tensor>& values) {
  Copies& c = copies();
  std::lock_guard<std::mutex> lock(c.mutex);
  std::map<std::string, at::Tensor>& held = c.by_primary[primary];
  check_updates(held, primary, keys, whole, rows, values);
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (whole[i] != 0) {
      // Copied into memory of the copy's own, every page written now: the message's memory may
      // be mapped lazily, and the steps' rows, spread over the whole copy, would then each fault
      // a page in (at 3e6 rows that took a step 20 ms for dozens of steps). In huge pages: the
      // rows a step changes stay within the TLB's reach, as on the primary.
      held[keys[i]] = optim::detail::clone_with_huge_pages(values[i]);
    } else {
      held[keys[i]].index_copy_(0, rows[i], values[i]);
    }
  }
  return c10::IValue();
}

c10::IValue on_keys(const std::string& primary) {
  Copies& c = copies();
  std::lock_guard<std::mutex> lock(c.mutex);
  std::vector<std::string> keys;
  auto it = c.by_primary.find(primary);
  if (it != c.by_primary.end()) {
    for (const auto& entry : it->second) keys.push_back(entry.first);
  }
  return rpc::to_value(keys);
}

c10::IValue on_copy(const std::string& primary, const std::string& key) {
  Copies& c = copies();
  std::lock_guard<std::mutex> lock(c.mutex);
  auto it = c.by_primary.find(primary);
  if (it == c.by_primary.end()) return c10::IValue();
  auto copy = it->second.find(key);
  if (copy == it->second.end()) return c10::IValue();
  // The reply's own: later updates do not reach it.
  return optim::detail::clone_with_huge_pages(copy->second);
}

// Drops every copy of trainer `trainer`'s state that `primary` sent; returns how many.
c10::IValue on_drop_state(const std::string& primary, const std::string& trainer) {
  const std::string marker = "/state/" + trainer + "/";
  Copies& c = copies();
  std::lock_guard<std::mutex> lock(c.mutex);
  int64_t dropped = 0;
  auto it = c.by_primary.find(primary);
  if (it == c.by_primary.end()) return dropped;
  for (auto copy = it->second.begin(); copy != it->second.end();) {
    if (copy->first.find(marker) != std::string::npos) {
      copy = it->second.erase(copy);
      ++dropped;
    } else {
      ++copy;
    }
  }
  return dropped;
}

}  // namespace

MirrorLink::MirrorLink(std::string backup, std::vector<std::string> param_keys,
                       std::string state_owner, bool continue_without_backup)
    : backup_(std::move(backup)),
      param_keys_(std::move(param_keys)),
      state_owner_(std::move(state_owner)),
      continue_without_backup_(continue_without_backup) {}

std::string MirrorLink::state_key(size_t index, const std::string& name) const {
  return param_keys_[index] + "/state/" + state_owner_ + "/" + name;
}

std::string MirrorLink::step_key(size_t index) const { return state_key(index, "step"); }

void MirrorLink::send(std::vector<MirrorUpdate> updates) {
  if (updates.empty()) return;
  std::vector<std::string> keys;
  std::vector<int64_t> whole;
  std::vector<at::Tensor> rows, values;
  for (MirrorUpdate& update : updates) {
    keys.push_back(update.key);
    whole.push_back(update.rows.defined() ? 0 : 1);
    rows.push_back(update.rows.defined() ? update.rows : at::empty({0}, at::kLong));
    values.push_back(std::move(update.values));
  }
  rpc::rpc_sync<void>(backup_, kApply,
                      std::tuple{rpc::get_worker_info().name, keys, whole, rows, values});
  for (size_t i = 0; i < keys.size(); ++i) {
    if (whole[i] != 0) sent_whole_.insert(keys[i]);
  }
}

bool MirrorLink::in_sync() const {
  return synced_to_ >= 0 && rpc::get_worker_info(backup_).id == synced_to_;
}

std::optional<int> member_id(const std::string& name) {
  try {
    return rpc::get_worker_info(name).id;
  } catch (const c10::ValueError&) {
    return std::nullopt;
  }
}

bool MirrorLink::backup_lost() const {
  const std::optional<int> id = member_id(backup_);
  return !id || id == lost_id_;
}

void MirrorLink::note_lost() {
  lost_id_ = member_id(backup_);
  forget_sent();
}

void MirrorLink::forget_sent() {
  sent_whole_.clear();
  synced_to_ = -1;
}

bool register_step_mirror() {
  rpc::detail::register_internal_function(kApply, [](std::vector<c10::IValue> args) {
    TORCH_CHECK_TYPE(args.size() == 5, "takes 5 arguments");
    return on_apply(rpc::from_value<std::string>(args[0], "the primary"),
                    rpc::from_value<std::vector<std::string>>(args[1], "the keys"),
                    rpc::from_value<std::vector<int64_t>>(args[2], "the whole flags"),
                    rpc::from_value<std::vector<at::Tensor>>(args[3], "the rows"),
                    rpc::from_value<std::vector<at::Tensor>>(args[4], "the values"));
  });
  rpc::detail::register_internal_function(kKeys, [](std::vector<c10::IValue> args) {
    TORCH_CHECK_TYPE(args.size() == 1, "takes 1 argument");
    return on_keys(rpc::from_value<std::string>(args[0], "the primary"));
  });
  rpc::detail::register_internal_function(kDropState, [](std::vector<c10::IValue> args) {
    TORCH_CHECK_TYPE(args.size() == 2, "takes 2 arguments");
    return on_drop_state(rpc::from_value<std::string>(args[0], "the primary"),
                         rpc::from_value<std::string>(args[1], "the trainer"));
  });
  rpc::detail::register_internal_function(kCopy, [](std::vector<c10::IValue> args) {
    TORCH_CHECK_TYPE(args.size() == 2, "takes 2 arguments");
    return on_copy(rpc::from_value<std::string>(args[0], "the primary"),
                   rpc::from_value<std::string>(args[1], "the key"));
  });
  return true;
}

// A backup that reads its own copies (it takes over a lost primary's parameters) reads them here.
std::vector<std::string> mirrored_keys(const std::string& backup, const std::string& primary) {
  if (backup == rpc::get_worker_info().name) {
    return rpc::from_value<std::vector<std::string>>(on_keys(primary), "the keys");
  }
  return rpc::rpc_sync<std::vector<std::string>>(backup, kKeys, std::tuple{primary});
}

at::Tensor mirrored_copy(const std::string& backup, const std::string& primary,
                         const std::string& key) {
  const c10::IValue copy =
      backup == rpc::get_worker_info().name
          ? on_copy(primary, key)
          : rpc::rpc_sync<c10::IValue>(backup, kCopy, std::tuple{primary, key});
  return copy.isNone() ? at::Tensor() : copy.toTensor();
}

int64_t drop_mirrored_state(const std::string& backup, const std::string& primary,
                            const std::string& trainer) {
  return rpc::rpc_sync<int64_t>(backup, kDropState, std::tuple{primary, trainer});
}

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
