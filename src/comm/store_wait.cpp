#include "store_wait.h"

#include <algorithm>
#include <thread>

namespace distoptim {
namespace comm {

std::vector<int> wait_for_rank_keys(c10d::Store& store, const std::string& prefix, int world_size,
                                    std::chrono::steady_clock::time_point deadline,
                                    const std::function<void()>& each_poll) {
  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r) keys.push_back(prefix + std::to_string(r));
  // Short pauses first: ranks usually arrive within milliseconds of each other.
  auto pause = std::chrono::milliseconds(1);
  while (true) {
    if (each_poll) each_poll();
    if (store.check(keys)) return {};
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
  std::vector<int> missing;
  for (int r = 0; r < world_size; ++r) {
    if (!store.check({keys[r]})) missing.push_back(r);
  }
  return missing;
}

}  // namespace comm
}  // namespace distoptim
