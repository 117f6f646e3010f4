// The registry of debug_info_sources.h: a map from owner to its counters' function, under one
// lock, which the owners' removal also takes (so no function runs after its owner is gone).

#include "debug_info_sources.h"

#include <mutex>
#include <utility>

namespace distoptim {
namespace rpc {
namespace detail {

namespace {

struct Sources {
  std::mutex mutex;
  std::map<const void*, std::function<DebugCounters()>> by_owner;
};

Sources& sources() {
  // Never destroyed: a source may be removed by a static destructor after this one would run.
  static auto* registry = new Sources();
  return *registry;
}

}  // namespace

void add_debug_info_source(const void* owner, std::function<DebugCounters()> counters) {
  Sources& registry = sources();
  std::lock_guard<std::mutex> lock(registry.mutex);
  registry.by_owner[owner] = std::move(counters);
}

void remove_debug_info_source(const void* owner) {
  Sources& registry = sources();
  std::lock_guard<std::mutex> lock(registry.mutex);
  registry.by_owner.erase(owner);
}

DebugCounters debug_info_from_sources() {
  Sources& registry = sources();
  std::lock_guard<std::mutex> lock(registry.mutex);
  DebugCounters sum;
  for (const auto& source : registry.by_owner) {
    for (const auto& [name, value] : source.second()) sum[name] += value;
  }
  return sum;
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
