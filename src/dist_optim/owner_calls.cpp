#include "owner_calls.h"

#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>
#include <distoptim/rpc/detail/rref_calls.h>
#include <distoptim/rpc/errors.h>

namespace distoptim {
namespace dist_optim {
namespace detail {

namespace {

bool is_lost(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const PeerLostError&) {
    return true;
  } catch (...) {
    return false;
  }
}

}  // namespace

void note_failure(const std::string& worker, std::exception_ptr* first, std::string* failures,
                  const std::string& which) {
  const std::exception_ptr current = std::current_exception();
  if (!*first || (!is_lost(*first) && is_lost(current))) *first = current;
  try {
    throw;
  } catch (const c10::Error& error) {
    *failures += "\n  worker '" + worker + "'" + which + ": " + error.what_without_backtrace();
  } catch (const std::exception& error) {
    *failures += "\n  worker '" + worker + "'" + which + ": " + error.what();
  }
}

void throw_failures(std::exception_ptr first, const std::string& what,
                    const std::string& failures) {
  const std::string message = "DistributedOptimizer: " + what + " failed on" + failures;
  try {
    std::rethrow_exception(first);
  } catch (const PeerLostError&) {
    throw PeerLostError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message);
  } catch (const TimeoutError&) {
    throw TimeoutError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message);
  } catch (const rpc::RemoteError& error) {
    throw rpc::RemoteError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                           error.worker_name(), message);
  } catch (...) {
    throw DistributedError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message);
  }
}

rpc::RpcFuture<c10::IValue> waited_method(const rpc::RRef<RemoteOptimizer>& optimizer,
                                          const std::string& method, std::vector<c10::IValue> args,
                                          bool waited_only) {
  return rpc::RpcFuture<c10::IValue>(
      rpc::detail::method_call_values(optimizer.handle(), method, std::move(args),
                                      rpc::kDefaultTimeout, waited_only),
      // Named only in then()'s errors, never used here: not worth describing the RRef per step.
      "method '" + method + "' of a remote optimizer");
}

void throw_if_failed(const Replies& replies, const std::string& what) {
  if (replies.first) throw_failures(replies.first, what, replies.failures);
}

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
