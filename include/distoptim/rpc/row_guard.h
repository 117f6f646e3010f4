#pragma once

// Row locks for tensors that several callers update in place a few rows at a time (a parameter
// server's embedding table stepped by several trainers with sparse gradients), so that updates of
// disjoint rows run at once while no reply carries a half-updated row. A tensor written whole
// (a dense layer's step on the same server) takes all of its own rows, and nothing of any other
// tensor: steps of other parameters, and lookups of them, go on meanwhile.
//
//   {
//     rpc::InPlaceRowUpdateGuard writing({weight}, {rows});  // rows: int64 indices along dim 0
//     weight.index_add_(0, rows, delta);
//   }
//   {
//     rpc::RowReadGuard reading(weight, ids);
//     out = weight.index_select(0, ids);
//   }
//
// Locking, from the outside in (a fixed order, so guards never deadlock one another):
//  1. The process-wide reader-writer lock of rpc::InPlaceUpdateGuard (api.h): row guards hold it
//     shared, so an InPlaceUpdateGuard (a dense step) excludes them all and they exclude it.
//  2. The row stripes of each tensor's storage: min(rows, 1024) reader-writer locks, row r under
//     stripe r % stripes. An update holds the stripes of its rows exclusively (of a tensor
//     written whole, every stripe), a read shared;
//     a reply that copies the whole tensor (to_here, a parameter a method returns) holds every
//     stripe shared. Stripes are taken in order of (storage's stripe set, stripe index).
// A storage gets its stripes at its first row or whole update (under the process-wide lock,
// exclusively, so no reader is copying it then: that first update waits for every update in
// progress, once per tensor); until then readers lock nothing but (1).
// Rows of two tensors may share a stripe: they then wait for each other without need, never the
// other way round. A step that names many random rows of one tensor takes most of its stripes
// (a batch of b rows leaves (1 - 1/1024)^b of them free): disjoint updates overlap fully when
// each names few rows, and partly otherwise.
//
// Row updates need a tensor that is the whole of its storage (contiguous, offset 0, nothing
// beyond it), so its rows are the storage's rows: for any other, InPlaceRowUpdateGuard takes the
// process-wide lock exclusively (as InPlaceUpdateGuard). A RowReadGuard on such a tensor holds
// every stripe of its storage shared.
//
// Thread safety: guards may be made on any thread; each is released by the thread that made it
// (std::shared_mutex's rule). Not reentrant: a thread holding a guard must not make another.
// Blocking: waits without a timeout, for guards held only around in-memory updates and copies.
// Errors: c10::ValueError for `rows` that are not 1-D int64 or a count of row sets other than
// of tensors, before anything is locked. Indices outside a tensor's rows are not checked here:
// they lock some stripe (the update that uses them is expected to refuse them).

#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include <distoptim/rpc/detail/row_locks.h>

namespace distoptim {
namespace rpc {

/// Held while writing the rows `rows[i]` of `tensors[i]` in place (and nothing else of them);
/// an undefined `rows[i]` stands for every row: `tensors[i]` is written whole.
class InPlaceRowUpdateGuard {
 public:
  InPlaceRowUpdateGuard(const std::vector<at::Tensor>& tensors,
                        const std::vector<at::Tensor>& rows);
  ~InPlaceRowUpdateGuard();
  InPlaceRowUpdateGuard(const InPlaceRowUpdateGuard&) = delete;
  InPlaceRowUpdateGuard& operator=(const InPlaceRowUpdateGuard&) = delete;

 private:
  std::unique_ptr<detail::RowLocks> locks_;
};

/// Held while reading the rows `rows` of `tensor` (a lookup that copies them out).
class RowReadGuard {
 public:
  RowReadGuard(const at::Tensor& tensor, const at::Tensor& rows);
  ~RowReadGuard();
  RowReadGuard(const RowReadGuard&) = delete;
  RowReadGuard& operator=(const RowReadGuard&) = delete;

 private:
  std::unique_ptr<detail::RowLocks> locks_;
};

}  // namespace rpc
}  // namespace distoptim
