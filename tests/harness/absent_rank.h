#pragma once

// For a test in which one rank stays out of a collective that the others time out on: the absent
// rank must stay alive, its connections open, until every other rank has seen its error (had it
// left, the others would see a lost peer, not the timeout). A sleep only makes that likely; on a
// slower machine the others' timeouts outlast it. Keys in the default process group's store.

#include <chrono>
#include <string>
#include <vector>

#include <distoptim/comm/process_group.h>

namespace distoptim {
namespace testing {

class AbsentRank {
 public:
  /// `rank` of `world_size` (after init_process_group); `absent` the rank that stays out.
  AbsentRank(int rank, int world_size, int absent)
      : rank_(rank), world_size_(world_size), absent_(absent) {}

  /// On the absent rank: returns once every other rank has called done() (bounded by kBound),
  /// then says that it leaves.
  void stay_until_the_others_are_done() const {
    std::vector<std::string> keys;
    for (int other = 0; other < world_size_; ++other) {
      if (other != absent_) keys.push_back(key("done", other));
    }
    comm::default_store()->wait(keys, kBound);
    comm::default_store()->set(key("left", absent_), {1});
  }

  /// On the others, once they have seen what they waited for. Rank 0, whose process serves the
  /// store, then waits for the absent rank to have heard every other rank.
  void done() const {
    comm::default_store()->set(key("done", rank_), {1});
    if (rank_ == 0 && absent_ != 0) comm::default_store()->wait({key("left", absent_)}, kBound);
  }

 private:
  static constexpr std::chrono::seconds kBound{60};

  static std::string key(const std::string& what, int rank) {
    return "test/absent_rank/" + what + "/" + std::to_string(rank);
  }

  int rank_;
  int world_size_;
  int absent_;
};

}  // namespace testing
}  // namespace distoptim
