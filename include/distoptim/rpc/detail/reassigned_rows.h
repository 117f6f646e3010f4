#pragma once

// Rows of a server's tensors handed to new keys, for every optimizer over the tensor: a
// collisionless table (rpc/id_embedding_bag.h) notes each row it hands to a new id, and each
// optimizer over the table's weight (dist_optim's owners, one per trainer) resets those rows of
// its own state before its next step of the tensor, so that a new id's row never steps with its
// predecessor's moments in any of them. The reset waits for that step because an optimizer's
// state is its own lock's, which its steps take before any row's (the table hands rows out under
// its row locks).
//
// Each optimizer reads the rows through a ReassignedRowsReader of its own: the rows noted since it
// last took them, whatever the other readers took. Bound: per tensor, the rows noted since the
// reader that took least recently, at most twice the tensor's rows; a reader that fell further
// behind is told to treat every row as handed out anew. Nothing is kept for a tensor no reader
// reads. Thread safety: every function may be called from any thread.

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace distoptim {
namespace rpc {
namespace detail {

/// Notes that `row` of `tensor` now holds a new key.
void note_reassigned_row(const at::Tensor& tensor, int64_t row);
/// Forgets every row of `tensor` noted (its table is gone; its memory may hold another tensor).
void forget_reassigned_rows(const at::Tensor& tensor);

/// One optimizer's view of the rows of `tensor` handed to new keys: from its construction on.
class ReassignedRowsReader {
 public:
  explicit ReassignedRowsReader(const at::Tensor& tensor);
  ~ReassignedRowsReader();
  ReassignedRowsReader(const ReassignedRowsReader&) = delete;
  ReassignedRowsReader& operator=(const ReassignedRowsReader&) = delete;

  /// The rows noted since the last call (or the construction), ascending, each once; empty
  /// without a lock or an allocation when no tensor has any noted (every step asks). Sets
  /// `everything` when this reader fell behind by more than the bound: every row may have been
  /// handed out anew.
  std::vector<int64_t> take(bool& everything);

 private:
  const void* key_;
  int64_t next_ = 0;  // the sequence number of the first row this reader has not taken
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
