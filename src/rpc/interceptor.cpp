#include "interception.h"

#include <atomic>

namespace distoptim {
namespace rpc {
namespace {

std::shared_ptr<Interceptor> g_interceptor;  // read and written with std::atomic_load/store

}  // namespace

void set_interceptor(std::shared_ptr<Interceptor> interceptor) {
  std::atomic_store(&g_interceptor, std::move(interceptor));
}

namespace detail {
std::shared_ptr<Interceptor> interceptor() { return std::atomic_load(&g_interceptor); }

CallMetadata intercept_send(const MessageInfo& info, std::vector<c10::IValue>& values) {
  CallMetadata metadata;
  if (auto installed = interceptor()) {
    installed->on_send(info, values, metadata);
  }
  return metadata;
}

std::shared_ptr<void> intercept_receive(const MessageInfo& info, std::vector<c10::IValue>& values,
                                        const CallMetadata& metadata) {
  auto installed = interceptor();
  return installed ? installed->on_receive(info, values, metadata) : nullptr;
}
}  // namespace detail

}  // namespace rpc
}  // namespace distoptim
