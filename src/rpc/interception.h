#pragma once

// How the rpc layer runs the interceptor a layer above installed (interceptor.h).

#include <memory>
#include <vector>

#include <ATen/core/ivalue.h>

#include <distoptim/rpc/interceptor.h>

namespace distoptim {
namespace rpc {
namespace detail {

/// The installed interceptor, or null. Thread-safe.
std::shared_ptr<Interceptor> interceptor();
/// Runs the installed interceptor's on_send / on_receive, if there is one.
CallMetadata intercept_send(const MessageInfo& info, std::vector<c10::IValue>& values);
std::shared_ptr<void> intercept_receive(const MessageInfo& info, std::vector<c10::IValue>& values,
                                        const CallMetadata& metadata);
}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
