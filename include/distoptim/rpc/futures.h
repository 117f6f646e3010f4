#pragma once

// torch.futures' collect_all and wait_all over RpcFutures.
//
//   std::vector<rpc::RpcFuture<at::Tensor>> calls;
//   for (const auto& worker : workers) calls.push_back(rpc::rpc_async<at::Tensor>(worker, "f"));
//   std::vector<at::Tensor> results = rpc::wait_all(calls);  // or throws the first failure

#include <string>
#include <type_traits>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>

#include <distoptim/rpc/api.h>
#include <distoptim/rpc/detail/futures.h>

namespace distoptim {
namespace rpc {

/// torch.futures.collect_all: a future that completes once every one of `futures` has, with a
/// value or an error, as PyTorch documents it; it never holds an error itself: read each future
/// then (their wait() no longer blocks). PyTorch 1.13's own fails as soon as one future fails,
/// while others may still run. Callbacks (add_done_callback, then) run on the thread that
/// completes the last one.
template <class T>
RpcFuture<void> collect_all(const std::vector<RpcFuture<T>>& futures) {
  return RpcFuture<void>(detail::when_all_complete(detail::raw_futures(futures)),
                         "collect_all of " + std::to_string(futures.size()) + " futures");
}

/// torch.futures.wait_all: waits for every one of `futures`, also after one has failed (no call
/// is left running unobserved; PyTorch's returns at the first failure), then returns their results
/// in order (nothing for RpcFuture<void>). If any failed, throws the error of the first that failed
/// in list order, of its class (RemoteError, TimeoutError, PeerLostError; anything else as
/// DistributedError), its message led by "wait_all: future I of N failed (and K more): " (for a
/// RemoteError after "on worker '<name>': ", which RemoteError's message always starts with). A
/// result that does not convert to T throws c10::TypeError as RpcFuture::wait does.
template <class T>
auto wait_all(const std::vector<RpcFuture<T>>& futures) {
  detail::wait_for_all(detail::raw_futures(futures));
  if constexpr (std::is_void_v<T>) {
    return;
  } else {
    std::vector<T> values;
    values.reserve(futures.size());
    for (const auto& future : futures) values.push_back(future.wait());
    return values;
  }
}

}  // namespace rpc
}  // namespace distoptim
