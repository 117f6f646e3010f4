#include <distoptim/rpc/futures.h>

#include <atomic>
#include <exception>
#include <memory>

#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>
#include <distoptim/rpc/detail/futures.h>
#include <distoptim/rpc/errors.h>

namespace distoptim {
namespace rpc {
namespace detail {

void wait_for_all(const std::vector<c10::intrusive_ptr<c10::ivalue::Future>>& futures) {
  size_t failed = 0;
  size_t first = futures.size();
  for (size_t i = 0; i < futures.size(); ++i) {
    TORCH_CHECK_VALUE(futures[i], "wait_all: future ", i, " is empty");
  }
  for (size_t i = 0; i < futures.size(); ++i) {
    wait_future(*futures[i]);
    if (!futures[i]->hasError()) continue;
    if (failed++ == 0) first = i;
  }
  if (failed == 0) return;
  std::string context = c10::str("wait_all: future ", first, " of ", futures.size(), " failed");
  if (failed > 1) context += c10::str(" (and ", failed - 1, " more)");
  context += ": ";
  try {
    std::rethrow_exception(futures[first]->exception_ptr());
  } catch (const RemoteError& error) {
    throw RemoteError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, error.worker_name(),
                      context + error.remote_message());
  } catch (const std::exception& error) {
    DISTOPTIM_RETHROW_WITH_CONTEXT(error, context);
  }
}

c10::intrusive_ptr<c10::ivalue::Future> when_all_complete(
    const std::vector<c10::intrusive_ptr<c10::ivalue::Future>>& futures) {
  auto all = c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
  if (futures.empty()) {
    all->markCompleted(c10::IValue());
    return all;
  }
  auto remaining = std::make_shared<std::atomic<size_t>>(futures.size());
  for (const auto& future : futures) {
    TORCH_CHECK_VALUE(future, "collect_all: a future is empty");
  }
  for (const auto& future : futures) {
    future->addCallback([all, remaining](c10::ivalue::Future&) {
      if (remaining->fetch_sub(1) == 1) all->markCompleted(c10::IValue());
    });
  }
  return all;
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
