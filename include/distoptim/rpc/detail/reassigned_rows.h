#pragma once

// Rows of a server's tensors handed to new keys since the tensor's optimizer last looked: a
// collisionless table (rpc/id_embedding_bag.h) notes each row it hands to a new id, and the
// owner's optimizer (dist_optim) resets those rows of its state before its next step of the
// tensor, so that a new id's row never steps with its predecessor's moments. The reset waits for
// that step because the optimizer's state is its own lock's, which its steps take before any
// row's (the table hands rows out under its row locks).
//
// Bound: at most one entry per row of each tensor noted. Thread safety: every function may be
// called from any thread.

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace distoptim {
namespace rpc {
namespace detail {

/// Notes that `row` of `tensor` now holds a new key.
void note_reassigned_row(const at::Tensor& tensor, int64_t row);
/// The rows of `tensor` noted since the last call, ascending, and forgets them; empty for a tensor
/// with none (without a lock or an allocation when no tensor has any: every step asks).
std::vector<int64_t> take_reassigned_rows(const at::Tensor& tensor);
/// Forgets every row of `tensor` noted (its table is gone; its memory may hold another tensor).
void forget_reassigned_rows(const at::Tensor& tensor);

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
