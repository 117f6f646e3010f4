#pragma once

// Rows of a server's tensors handed to new keys, for every optimizer over the tensor and every
// gradient of it: a collisionless table (rpc/id_embedding_bag.h) notes each row it hands to a new
// id, and
//  - each optimizer over the table's weight (dist_optim's owners, one per trainer) resets those
//    rows of its own state before its next step of the tensor, so that a new id's row never steps
//    with its predecessor's moments in any of them. The reset waits for that step because an
//    optimizer's state is its own lock's, which its steps take before any row's (the table hands
//    rows out under its row locks).
//  - a gradient of the tensor that a backward pass accumulated (dist_autograd's contexts) drops,
//    when a step applies it, the rows handed out since that pass began: they hold another id now.
//
// Every row noted gets a sequence number, one count for all tensors, so that a position taken
// before anything is known of a tensor (a backward pass's start) holds for all of them. Each
// optimizer reads the rows through a ReassignedRowsReader of its own: the rows noted since it
// last took them, whatever the other readers took. A ReassignedRowsPin keeps, for as long as it
// lives, every row noted from its position on, for rows_reassigned_since. Bound: per tensor, the
// rows noted since the oldest reader's position or pin, at most twice the tensor's rows; a reader
// or pin that fell further behind is told to treat every row as handed out anew. Nothing is kept
// for a tensor no reader reads, nor while no pin lives and no reader has started (a new
// optimizer's state is every row's initial one: nothing to reset, so a table filled before the
// first step logs nothing). Thread safety: every function may be called from any thread.

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace distoptim {
namespace rpc {
namespace detail {

/// Notes that `row` of `tensor` now holds a new key.
void note_reassigned_row(const at::Tensor& tensor, int64_t row);
/// Notes that `rows[0..n)` of `tensor` now hold new keys, in that order: as many calls of
/// note_reassigned_row, under one lock.
void note_reassigned_rows(const at::Tensor& tensor, const int64_t* rows, int64_t n);
/// Forgets every row of `tensor` noted (its table is gone; its memory may hold another tensor).
void forget_reassigned_rows(const at::Tensor& tensor);

/// One optimizer's view of the rows of `tensor` handed to new keys: from its start on, which is
/// its first take() or start(), whichever comes first. Before it, its optimizer holds no state of
/// the tensor to reset; one that writes state other than by a step (a load) calls start() first.
class ReassignedRowsReader {
 public:
  /// A reader's position before its start.
  static constexpr int64_t kNotStarted = INT64_MAX;

  explicit ReassignedRowsReader(const at::Tensor& tensor);
  ~ReassignedRowsReader();
  ReassignedRowsReader(const ReassignedRowsReader&) = delete;
  ReassignedRowsReader& operator=(const ReassignedRowsReader&) = delete;

  /// The rows noted since the last call (or the start), ascending, each once; empty without a
  /// lock or an allocation when no tensor has any noted (every step asks). Sets `everything` when
  /// this reader fell behind by more than the bound: every row may have been handed out anew.
  /// The first call starts the reader and returns nothing.
  std::vector<int64_t> take(bool& everything);
  /// Starts the reader (nothing if it has started): rows noted from now on are kept for it.
  void start();

 private:
  const void* key_;
  // The sequence number of the first row this reader has not taken (kNotStarted: none kept).
  int64_t next_ = kNotStarted;
};

/// The position of the next row to be noted, of any tensor, kept while this lives: every row
/// noted from it on stays readable by rows_reassigned_since (within the bound above).
class ReassignedRowsPin {
 public:
  ReassignedRowsPin();
  ~ReassignedRowsPin();
  ReassignedRowsPin(const ReassignedRowsPin&) = delete;
  ReassignedRowsPin& operator=(const ReassignedRowsPin&) = delete;

  int64_t position() const { return position_; }

 private:
  int64_t position_;
};

/// The rows of `tensor` noted from `position` on (a live pin's, or a later one), ascending, each
/// once; empty without a lock when no tensor has any noted. Sets `everything` when some of them
/// are no longer kept (more than the bound were noted since): every row may have been handed out.
std::vector<int64_t> rows_reassigned_since(const at::Tensor& tensor, int64_t position,
                                           bool& everything);

/// `gradient` (a sparse COO gradient of `tensor`) without its entries for rows handed to new keys
/// from `position` on (rows_reassigned_since; with none of its entries when every row may have
/// been): the same tensor when there are none.
at::Tensor without_rows_reassigned_since(const at::Tensor& tensor, const at::Tensor& gradient,
                                         int64_t position);

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
