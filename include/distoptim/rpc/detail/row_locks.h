#pragma once

// Internal: the locks a row guard holds (row_guard.h), defined in src/rpc/row_locks.h. Not part
// of the public API; names may change.

namespace distoptim {
namespace rpc {
namespace detail {

class RowLocks;

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
