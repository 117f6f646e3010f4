#pragma once

// Internal: the waits behind collect_all and wait_all (futures.h), defined in src/rpc/futures.cpp.
// Not part of the public API; names may change.

#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>

namespace distoptim {
namespace rpc {

template <class T>
class RpcFuture;

namespace detail {

/// Waits for every one of `futures` (managed on a pool thread, as every wait), then throws the
/// error of the first that failed, as wait_all documents.
void wait_for_all(const std::vector<c10::intrusive_ptr<c10::ivalue::Future>>& futures);
/// A future of None completed once every one of `futures` has.
c10::intrusive_ptr<c10::ivalue::Future> when_all_complete(
    const std::vector<c10::intrusive_ptr<c10::ivalue::Future>>& futures);

template <class T>
std::vector<c10::intrusive_ptr<c10::ivalue::Future>> raw_futures(
    const std::vector<RpcFuture<T>>& futures) {
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> raw;
  raw.reserve(futures.size());
  for (const auto& future : futures) raw.push_back(future.raw());
  return raw;
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
