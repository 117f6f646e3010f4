#pragma once

// Counters that rooms of the rpc layer outside the agent add to rpc::get_debug_info: a
// collisionless table's shards (id_embedding_shard.cpp) say how many rows they hold, admitted,
// expired and evicted. The agent does not know those rooms; each registers a source, and the
// agent adds what the sources return, summed by name over the sources of this process.

#include <cstdint>
#include <functional>
#include <map>
#include <string>

namespace distoptim {
namespace rpc {
namespace detail {

using DebugCounters = std::map<std::string, int64_t>;

/// Registers `counters` under `owner` (one source per owner; a second call replaces the first).
/// `counters` is called under the registry's lock: it must not register or remove sources.
void add_debug_info_source(const void* owner, std::function<DebugCounters()> counters);

/// Removes `owner`'s source; once it returns, its function is not running and will not run.
void remove_debug_info_source(const void* owner);

/// Every source's counters, summed by name.
DebugCounters debug_info_from_sources();

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
