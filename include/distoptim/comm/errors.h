#pragma once

#include <string>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace distoptim {

/// Errors of distributed operations whose cause is a peer or the network rather than the
/// caller's arguments (bad arguments throw c10::ValueError / c10::TypeError). All derive from
/// c10::Error, so code that catches LibTorch's errors catches these too. Each documents, where
/// it is thrown, the state it leaves the object in.
class DistributedError : public c10::Error {
 public:
  DistributedError(c10::SourceLocation where, std::string message)
      : c10::Error(where, std::move(message)) {}
};

/// A wait ran past its deadline. The message says what was awaited and which ranks or workers
/// never answered.
class TimeoutError : public DistributedError {
 public:
  using DistributedError::DistributedError;
};

/// A peer is gone: its process died or its connection closed.
class PeerLostError : public DistributedError {
 public:
  using DistributedError::DistributedError;
};

}  // namespace distoptim

/// Throws `error_type` (one of the classes above) with the message c10::str(...) when `cond` is
/// false; the counterpart of TORCH_CHECK_WITH for distoptim's own error types.
#define DISTOPTIM_CHECK_WITH(error_type, cond, ...)                                     \
  do {                                                                                  \
    if (C10_UNLIKELY_OR_CONST(!(cond))) {                                               \
      throw error_type({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},           \
                       ::c10::str(__VA_ARGS__));                                        \
    }                                                                                   \
  } while (false)

/// Throws `error_type` with the message c10::str(...).
#define DISTOPTIM_THROW(error_type, ...) \
  throw error_type({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, ::c10::str(__VA_ARGS__))
