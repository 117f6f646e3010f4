#include <distoptim/rpc/row_guard.h>

#include <algorithm>
#include <iterator>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include <c10/core/Storage.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include "reply_snapshot.h"
#include "row_locks.h"

namespace distoptim {
namespace rpc {
namespace detail {

// Enough stripes that steps naming a few hundred random rows mostly miss each other; 56 bytes
// each (a pthread rwlock), so 56 KiB per table at most.
constexpr int64_t kMaxStripes = 1024;

struct RowStripes {
  explicit RowStripes(size_t count) : count(count), locks(new std::shared_mutex[count]) {}
  const size_t count;
  const std::unique_ptr<std::shared_mutex[]> locks;
};

namespace {

// Stripe sets by storage. The weak reference keeps the StorageImpl object (not its memory)
// allocated, so its address is not reused while the entry exists; an entry whose storage is gone
// is dropped when the next set is created.
struct StripeRegistry {
  struct Entry {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    std::shared_ptr<RowStripes> stripes;
  };
  std::mutex mutex;
  std::unordered_map<const c10::StorageImpl*, Entry> entries;  // guarded by mutex
};

StripeRegistry& stripe_registry() {
  static StripeRegistry instance;
  return instance;
}

std::shared_ptr<RowStripes> find_stripes(const at::Tensor& tensor) {
  if (tensor.layout() != c10::kStrided || !tensor.has_storage()) return nullptr;
  StripeRegistry& r = stripe_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.entries.find(tensor.storage().unsafeGetStorageImpl());
  if (it == r.entries.end() || it->second.storage.expired()) return nullptr;
  return it->second.stripes;
}

// Called holding in_place_update_mutex() exclusively: no reader is between looking the stripes
// up and locking them.
void create_stripes(const at::Tensor& tensor) {
  StripeRegistry& r = stripe_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto it = r.entries.begin(); it != r.entries.end();) {
    it = it->second.storage.expired() ? r.entries.erase(it) : std::next(it);
  }
  const c10::StorageImpl* key = tensor.storage().unsafeGetStorageImpl();
  if (r.entries.count(key)) return;
  const auto count = static_cast<size_t>(std::clamp<int64_t>(tensor.size(0), 1, kMaxStripes));
  r.entries.emplace(key, StripeRegistry::Entry{tensor.storage().getWeakStorageImpl(),
                                               std::make_shared<RowStripes>(count)});
}

// Whether `tensor`'s rows are its storage's rows (so a row's stripe is the same whichever tensor
// names it): contiguous, at offset 0, and the whole of the storage.
bool owns_its_rows(const at::Tensor& tensor) {
  return tensor.layout() == c10::kStrided && tensor.has_storage() && tensor.dim() >= 1 &&
         tensor.storage_offset() == 0 && tensor.is_contiguous() &&
         tensor.storage().nbytes() ==
             static_cast<size_t>(tensor.numel()) * static_cast<size_t>(tensor.element_size());
}

void check_rows(const at::Tensor& rows, const char* guard, size_t i) {
  TORCH_CHECK_VALUE(rows.defined() && rows.layout() == c10::kStrided && rows.dim() == 1 &&
                        rows.scalar_type() == at::kLong && rows.device().is_cpu(),
                    guard, ": rows[", i, "] must be a 1-D int64 CPU tensor, got ",
                    rows.defined() ? c10::str(rows.scalar_type(), " of shape ", rows.sizes())
                                   : std::string("an undefined tensor"));
}

// The stripes of `rows` (any indices: out of range ones land on some stripe), ascending.
std::vector<uint32_t> stripes_of_rows(const at::Tensor& rows, size_t count) {
  std::vector<char> used(count, 0);
  const at::Tensor dense = rows.contiguous();
  const int64_t* row = dense.data_ptr<int64_t>();
  const auto n = static_cast<int64_t>(count);
  for (int64_t i = 0; i < dense.numel(); ++i) used[static_cast<size_t>(((row[i] % n) + n) % n)] = 1;
  std::vector<uint32_t> out;
  for (size_t s = 0; s < count; ++s) {
    if (used[s]) out.push_back(static_cast<uint32_t>(s));
  }
  return out;
}

std::vector<uint32_t> all_stripes(size_t count) {
  std::vector<uint32_t> out(count);
  for (size_t s = 0; s < count; ++s) out[s] = static_cast<uint32_t>(s);
  return out;
}

}  // namespace

std::unique_ptr<RowLocks> RowLocks::for_update(const std::vector<at::Tensor>& tensors,
                                               const std::vector<at::Tensor>& rows) {
  constexpr const char* kGuard = "InPlaceRowUpdateGuard";
  TORCH_CHECK_VALUE(tensors.size() == rows.size(), kGuard, ": ", rows.size(), " row sets for ",
                    tensors.size(), " tensors");
  bool by_rows = true;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (rows[i].defined()) check_rows(rows[i], kGuard, i);
    by_rows = by_rows && owns_its_rows(tensors[i]);
  }
  auto locks = std::make_unique<RowLocks>();
  std::shared_mutex& global = in_place_update_mutex();
  if (!by_rows) {
    global.lock();
    locks->global_ = Global::kExclusive;
    return locks;
  }
  bool missing = false;
  for (const at::Tensor& tensor : tensors) missing = missing || !find_stripes(tensor);
  if (missing) {
    std::unique_lock<std::shared_mutex> no_reader_meanwhile(global);
    for (const at::Tensor& tensor : tensors) create_stripes(tensor);
  }
  global.lock_shared();
  locks->global_ = Global::kShared;
  for (size_t i = 0; i < tensors.size(); ++i) {
    // Created above, and kept while the tensor lives.
    std::shared_ptr<RowStripes> stripes = find_stripes(tensors[i]);
    TORCH_INTERNAL_ASSERT(stripes);
    std::vector<uint32_t> indices =
        rows[i].defined() ? stripes_of_rows(rows[i], stripes->count) : all_stripes(stripes->count);
    locks->held_.push_back(Held{std::move(stripes), std::move(indices)});
  }
  locks->lock_stripes(/*exclusive=*/true);
  return locks;
}

std::unique_ptr<RowLocks> RowLocks::for_read(const at::Tensor& tensor, const at::Tensor& rows) {
  check_rows(rows, "RowReadGuard", 0);
  auto locks = std::make_unique<RowLocks>();
  in_place_update_mutex().lock_shared();
  locks->global_ = Global::kShared;
  // No stripes: no row update has run on this storage, and none starts while we hold the global
  // lock shared (stripes are created under it, exclusively).
  std::shared_ptr<RowStripes> stripes = find_stripes(tensor);
  if (stripes) {
    std::vector<uint32_t> indices =
        owns_its_rows(tensor) ? stripes_of_rows(rows, stripes->count) : all_stripes(stripes->count);
    locks->held_.push_back(Held{std::move(stripes), std::move(indices)});
    locks->lock_stripes(/*exclusive=*/false);
  }
  return locks;
}

std::unique_ptr<RowLocks> RowLocks::for_whole_reads(const std::vector<at::Tensor>& tensors) {
  auto locks = std::make_unique<RowLocks>();
  for (const at::Tensor& tensor : tensors) {
    std::shared_ptr<RowStripes> stripes = find_stripes(tensor);
    if (!stripes) continue;
    const size_t count = stripes->count;
    locks->held_.push_back(Held{std::move(stripes), all_stripes(count)});
  }
  locks->lock_stripes(/*exclusive=*/false);
  return locks;
}

void RowLocks::lock_stripes(bool exclusive) {
  // One entry per stripe set, in address order: every holder takes stripes in the same order.
  std::sort(held_.begin(), held_.end(),
            [](const Held& a, const Held& b) { return a.stripes.get() < b.stripes.get(); });
  std::vector<Held> merged;
  for (Held& h : held_) {
    if (!merged.empty() && merged.back().stripes == h.stripes) {
      std::vector<uint32_t> both;
      std::set_union(merged.back().indices.begin(), merged.back().indices.end(), h.indices.begin(),
                     h.indices.end(), std::back_inserter(both));
      merged.back().indices = std::move(both);
    } else {
      merged.push_back(std::move(h));
    }
  }
  held_ = std::move(merged);
  exclusive_stripes_ = exclusive;
  for (const Held& h : held_) {
    for (uint32_t s : h.indices) {
      if (exclusive) {
        h.stripes->locks[s].lock();
      } else {
        h.stripes->locks[s].lock_shared();
      }
    }
    ++locked_;
  }
}

RowLocks::~RowLocks() {
  for (size_t i = locked_; i-- > 0;) {
    const Held& h = held_[i];
    for (auto s = h.indices.rbegin(); s != h.indices.rend(); ++s) {
      if (exclusive_stripes_) {
        h.stripes->locks[*s].unlock();
      } else {
        h.stripes->locks[*s].unlock_shared();
      }
    }
  }
  if (global_ == Global::kExclusive) in_place_update_mutex().unlock();
  if (global_ == Global::kShared) in_place_update_mutex().unlock_shared();
}

}  // namespace detail

InPlaceRowUpdateGuard::InPlaceRowUpdateGuard(const std::vector<at::Tensor>& tensors,
                                             const std::vector<at::Tensor>& rows)
    : locks_(detail::RowLocks::for_update(tensors, rows)) {}
InPlaceRowUpdateGuard::~InPlaceRowUpdateGuard() = default;

RowReadGuard::RowReadGuard(const at::Tensor& tensor, const at::Tensor& rows)
    : locks_(detail::RowLocks::for_read(tensor, rows)) {}
RowReadGuard::~RowReadGuard() = default;

}  // namespace rpc
}  // namespace distoptim
