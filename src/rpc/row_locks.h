#pragma once

// The locks behind rpc::InPlaceRowUpdateGuard and rpc::RowReadGuard (row_guard.h states the
// design and the lock order), and the whole-tensor read locks a reply takes around its copies.

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include <distoptim/rpc/detail/row_locks.h>

namespace distoptim {
namespace rpc {
namespace detail {

struct RowStripes;

/// A set of held locks: the process-wide in-place update lock (shared or exclusive, or not at
/// all when the caller holds it) and row stripes. Released in reverse order on destruction, by
/// the thread that took them.
class RowLocks {
 public:
  /// For writing rows `rows[i]` of `tensors[i]`.
  static std::unique_ptr<RowLocks> for_update(const std::vector<at::Tensor>& tensors,
                                              const std::vector<at::Tensor>& rows);
  /// For reading rows `rows` of `tensor`.
  static std::unique_ptr<RowLocks> for_read(const at::Tensor& tensor, const at::Tensor& rows);
  /// For copying `tensors` whole: every stripe of their storages, shared. The caller holds
  /// in_place_update_mutex() shared (and keeps it until this is released).
  static std::unique_ptr<RowLocks> for_whole_reads(const std::vector<at::Tensor>& tensors);

  RowLocks() = default;
  ~RowLocks();
  RowLocks(const RowLocks&) = delete;
  RowLocks& operator=(const RowLocks&) = delete;

 private:
  struct Held {
    std::shared_ptr<RowStripes> stripes;
    std::vector<uint32_t> indices;  // ascending
  };
  enum class Global { kNone, kShared, kExclusive };

  /// Locks `held_` in the global stripe order (sorted by stripe set, then index), merging the
  /// entries of one stripe set.
  void lock_stripes(bool exclusive);

  Global global_ = Global::kNone;
  bool exclusive_stripes_ = false;
  size_t locked_ = 0;  // entries of held_ whose stripes are locked
  std::vector<Held> held_;
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
