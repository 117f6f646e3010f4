#pragma once

// What a reply carries when the value it sends is still someone else's: the owner of a value
// (a parameter server) may update it in place while a reply holding it is being written. Copies
// of such tensors are taken under one process-wide reader-writer lock, which
// rpc::InPlaceUpdateGuard (api.h) holds exclusively around an update, and under every row stripe
// of their storages, which rpc::InPlaceRowUpdateGuard (row_guard.h) holds around a row update.

#include <shared_mutex>

#include <ATen/core/ivalue.h>

namespace distoptim {
namespace rpc {
namespace detail {

/// `value` with copies of the tensors whose memory someone else may write while a reply is
/// being written (a parameter a method returns, a view of a buffer, a value an owner keeps), so
/// that a reply never carries a mixture of old and new values. `holders`: how many references
/// the caller holds to the tree `value` (1: a handler's result held only by the caller; 0: copy
/// every tensor). A tensor referenced only from within those, whose memory nothing else shares
/// (or only the base of a view that the view alone keeps), is sent where it lies; when nothing
/// needs a copy, `value` itself is returned.
/// The copies are taken holding in_place_update_mutex() shared (api.h's InPlaceUpdateGuard) and
/// the row stripes of their storages shared (row_guard.h).
c10::IValue snapshot_shared_tensors(const c10::IValue& value, int holders);
std::shared_mutex& in_place_update_mutex();

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
