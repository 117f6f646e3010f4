#pragma once

// Waiting on a c10d store for every rank's key, for the comm layer's own protocols.

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace distoptim {
namespace comm {

/// Polls until every rank r in [0, world_size) has set the key `prefix + r`, or `deadline`
/// passes; returns the ranks whose key is still missing then (empty once all are there).
/// Polling, unlike Store::wait, lets a timeout name who is missing. `each_poll` runs before every
/// poll (it may throw to stop the wait). Store failures propagate as c10d throws them.
std::vector<int> wait_for_rank_keys(c10d::Store& store, const std::string& prefix, int world_size,
                                    std::chrono::steady_clock::time_point deadline,
                                    const std::function<void()>& each_poll = {});

}  // namespace comm
}  // namespace distoptim
