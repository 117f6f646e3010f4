#include "recovery_board.h"

#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include <c10/util/Exception.h>

#include <distoptim/rpc/api.h>
#include <distoptim/rpc/detail/internal_registry.h>

namespace distoptim {
namespace dist_optim {
namespace detail {

namespace {

constexpr const char* kClaim = "__distoptim.recovery.claim";
constexpr const char* kPublish = "__distoptim.recovery.publish";
constexpr const char* kRelease = "__distoptim.recovery.release";

struct Board {
  std::string claimant;  // the trainer making the lost owner's shards and modules; empty: none
  bool restored = false;
  int64_t snapshot_step = -1;
};

struct Boards {
  std::mutex mutex;
  std::map<std::string, Board> by_name;        // guarded by mutex
  std::map<std::string, c10::IValue> objects;  // by board_object_key; guarded by mutex
};

Boards& boards() {
  static Boards* instance = new Boards();  // never destroyed: requests may run at exit
  return *instance;
}

// Says which board a board's name is, in errors.
std::string describe(const std::string& board) {
  return board.empty() ? "this worker" : "the lost owner '" + board + "'";
}

// [outcome, claimant, snapshot step].
c10::IValue on_claim(const std::string& board, const std::string& caller,
                     const std::string& stale) {
  Boards& all = boards();
  std::lock_guard<std::mutex> lock(all.mutex);
  Board& b = all.by_name[board];
  int64_t outcome = kRestored;
  if (!b.restored && caller.empty()) {
    outcome = kAnotherRestores;  // a query: nothing is claimed
  } else if (!b.restored) {
    if (b.claimant.empty() || b.claimant == caller || (!stale.empty() && b.claimant == stale)) {
      b.claimant = caller;
      outcome = kYouRestore;
    } else {
      outcome = kAnotherRestores;
    }
  }
  return c10::ivalue::Tuple::create({outcome, b.claimant, b.snapshot_step});
}

void on_release(const std::string& board, const std::string& caller) {
  Boards& all = boards();
  std::lock_guard<std::mutex> lock(all.mutex);
  Board& b = all.by_name[board];
  if (!b.restored && b.claimant == caller) b.claimant.clear();
}

void on_publish(const std::string& board, const std::string& caller,
                const std::vector<std::string>& keys,
                const std::vector<rpc::RRef<c10::IValue>>& made, int64_t snapshot_step) {
  TORCH_CHECK_VALUE(keys.size() == made.size(), "recovery: ", keys.size(), " keys for ",
                    made.size(), " shards and modules");
  std::map<std::string, c10::IValue> objects;
  for (size_t i = 0; i < keys.size(); ++i) {
    objects[board_object_key(board, keys[i])] = made[i].local_value();
  }
  Boards& all = boards();
  std::lock_guard<std::mutex> lock(all.mutex);
  Board& b = all.by_name[board];
  TORCH_CHECK_VALUE(!b.restored && b.claimant == caller, "recovery: '", caller,
                    "' publishes the shards and modules of ", describe(board), ", but ",
                    b.restored ? "they were published already" : "'" + b.claimant + "' makes them");
  all.objects.merge(objects);
  b.snapshot_step = snapshot_step;
  b.restored = true;
}

c10::IValue on_object(const std::string& object_key) {
  Boards& all = boards();
  std::lock_guard<std::mutex> lock(all.mutex);
  auto it = all.objects.find(object_key);
  TORCH_CHECK_VALUE(it != all.objects.end(), "recovery: no shard or module '", object_key,
                    "' was made anew on worker '", rpc::get_worker_info().name,
                    "' (not yet, or the trainer that made them did not know it)");
  return it->second;
}

}  // namespace

std::string board_object_key(const std::string& board, const std::string& key) {
  return board.empty() ? key : board + "/" + key;
}

Claim ask_board(const std::string& worker, const std::string& board, const std::string& caller,
                const std::string& stale) {
  const auto items = rpc::from_value<std::tuple<int64_t, std::string, int64_t>>(
      rpc::rpc_sync<c10::IValue>(worker, kClaim, std::tuple{board, caller, stale}),
      "the board's answer");
  return {std::get<0>(items), std::get<1>(items), std::get<2>(items)};
}

void publish_on_board(const std::string& worker, const std::string& board,
                      const std::vector<std::string>& keys,
                      const std::vector<rpc::RRef<c10::IValue>>& made, int64_t snapshot_step) {
  rpc::rpc_sync<void>(worker, kPublish,
                      std::tuple{board, rpc::get_worker_info().name, keys, made, snapshot_step});
}

void release_board(const std::string& worker, const std::string& board) {
  rpc::rpc_sync<void>(worker, kRelease, std::tuple{board, rpc::get_worker_info().name});
}

bool register_board() {
  rpc::detail::register_internal_function(kClaim, [](std::vector<c10::IValue> args) {
    TORCH_CHECK_TYPE(args.size() == 3, "takes 3 arguments");
    return on_claim(rpc::from_value<std::string>(args[0], "the board"),
                    rpc::from_value<std::string>(args[1], "the caller"),
                    rpc::from_value<std::string>(args[2], "the stale claimant"));
  });
  rpc::detail::register_internal_function(kPublish, [](std::vector<c10::IValue> args) {
    TORCH_CHECK_TYPE(args.size() == 5, "takes 5 arguments");
    on_publish(rpc::from_value<std::string>(args[0], "the board"),
               rpc::from_value<std::string>(args[1], "the caller"),
               rpc::from_value<std::vector<std::string>>(args[2], "the keys"),
               rpc::from_value<std::vector<rpc::RRef<c10::IValue>>>(args[3], "the shards"),
               rpc::from_value<int64_t>(args[4], "the snapshot's step"));
    return c10::IValue();
  });
  rpc::detail::register_internal_function(kBoardObject, [](std::vector<c10::IValue> args) {
    TORCH_CHECK_TYPE(args.size() == 1, "takes 1 argument");
    return on_object(rpc::from_value<std::string>(args[0], "the key"));
  });
  rpc::detail::register_internal_function(kRelease, [](std::vector<c10::IValue> args) {
    TORCH_CHECK_TYPE(args.size() == 2, "takes 2 arguments");
    on_release(rpc::from_value<std::string>(args[0], "the board"),
               rpc::from_value<std::string>(args[1], "the caller"));
    return c10::IValue();
  });
  return true;
}

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
