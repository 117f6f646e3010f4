#pragma once

#include <exception>
#include <string>
#include <utility>

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

/// Throws the failure `e` of a distributed operation again with `context` before its message:
/// a TimeoutError or PeerLostError as the same class (so callers can still tell a timeout from a
/// lost peer), anything else as a DistributedError. A c10::Error's backtrace is left out.
/// Use DISTOPTIM_RETHROW_WITH_CONTEXT.
[[noreturn]] inline void rethrow_with_context(c10::SourceLocation where, const std::exception& e,
                                              const std::string& context) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  std::string message = context + (error != nullptr ? error->what_without_backtrace() : e.what());
  if (dynamic_cast<const TimeoutError*>(&e) != nullptr) throw TimeoutError(where, message);
  if (dynamic_cast<const PeerLostError*>(&e) != nullptr) throw PeerLostError(where, message);
  throw DistributedError(where, std::move(message));
}

}  // namespace distoptim

/// Throws `error_type` (one of the classes above) with the message c10::str(...) when `cond` is
/// false; the counterpart of TORCH_CHECK_WITH for distoptim's own error types.
#define DISTOPTIM_CHECK_WITH(error_type, cond, ...)                           \
  do {                                                                        \
    if (C10_UNLIKELY_OR_CONST(!(cond))) {                                     \
      throw error_type({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, \
                       ::c10::str(__VA_ARGS__));                              \
    }                                                                         \
  } while (false)

/// Throws `error_type` with the message c10::str(...).
#define DISTOPTIM_THROW(error_type, ...) \
  throw error_type({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, ::c10::str(__VA_ARGS__))

/// Throws the caught exception `e` again with the context c10::str(...) before its message (see
/// distoptim::rethrow_with_context).
#define DISTOPTIM_RETHROW_WITH_CONTEXT(e, ...)                                                  \
  ::distoptim::rethrow_with_context({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, (e), \
                                    ::c10::str(__VA_ARGS__))
