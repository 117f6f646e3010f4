#pragma once

// The board through which the trainers of a lost owner agree on who makes its table shards and
// RemoteModules anew (recovery.h): the first trainer that claims it makes them and publishes
// them; the others wait, then take what it published. One board per lost owner, kept by the
// worker that holds its parts next: the owner's new incarnation (board "", its own), or the
// backup that took them over (hot standby: a board per lost owner and incarnation). A new
// incarnation starts with no boards.

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include <distoptim/rpc/rref.h>

namespace distoptim {
namespace dist_optim {
namespace detail {

/// A claim's outcome.
constexpr int64_t kYouRestore = 0, kAnotherRestores = 1, kRestored = 2;
/// The function whose remote() fetches a published shard or module by board_object_key.
constexpr const char* kBoardObject = "__distoptim.recovery.object";

struct Claim {
  int64_t outcome;
  std::string claimant;   // the trainer that makes the parts (empty: none yet)
  int64_t snapshot_step;  // of the snapshot the parts were loaded from; -1: none
};

/// Asks board `board` on `worker` as `caller`: kYouRestore gives the caller the claim (also when
/// the claimant is `stale`, a trainer the caller found gone). An empty `caller` only asks (every
/// worker answers at once; what recovery.cpp's liveness check needs).
Claim ask_board(const std::string& worker, const std::string& board, const std::string& caller,
                const std::string& stale);
/// The claimant publishes what it made, by key; then the board answers kRestored.
void publish_on_board(const std::string& worker, const std::string& board,
                      const std::vector<std::string>& keys,
                      const std::vector<rpc::RRef<c10::IValue>>& made, int64_t snapshot_step);
/// A claimant that failed gives its claim back, so that the next trainer that asks makes them.
void release_board(const std::string& worker, const std::string& board);
/// The argument of kBoardObject that names `key` on board `board`.
std::string board_object_key(const std::string& board, const std::string& key);

/// Registers the board's functions (once, at start-up).
bool register_board();

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
