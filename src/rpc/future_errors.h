#pragma once

// Errors as the rpc layer's futures carry them.

#include <cstdint>
#include <exception>
#include <string>

#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>
#include <distoptim/rpc/errors.h>

/// An exception of `type` for a future, located where it is made.
#define DISTOPTIM_RPC_ERROR(type, message) \
  std::make_exception_ptr(type({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message))

namespace distoptim {
namespace rpc {
namespace detail {

/// The message a failed future carries to the caller: a RemoteError's own text (not wrapped
/// twice), else the exception's message without LibTorch's backtrace.
std::string error_text(const std::exception_ptr& error);

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
