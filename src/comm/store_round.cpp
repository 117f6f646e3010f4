#include <distoptim/comm/store_round.h>

#include <algorithm>
#include <cctype>
#include <iterator>
#include <string>
#include <thread>
#include <utility>

#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>

namespace distoptim {
namespace comm {

namespace {

using Clock = StoreRound::Clock;

// How often `key` counts, as the class comment says: 0 when unset, the number add() left there,
// 1 for any other value. Read with `get`, never with add(key, 0): a TCPStore server asked to add
// to a value that is not a number fails on its own thread, and takes its process down.
int64_t times_counted(DeadlineStore& store, const std::string& key, Clock::time_point deadline) {
  if (!store.check({key}, deadline)) return 0;
  const std::vector<uint8_t> value = store.get(key, deadline);
  const bool is_count =
      !value.empty() && value.size() <= 18 &&
      std::all_of(value.begin(), value.end(), [](uint8_t c) { return std::isdigit(c) != 0; });
  return is_count ? std::stoll(std::string(value.begin(), value.end())) : 1;
}

// RoundFailure's kinds as encoded, in the order of RoundFailure::Kind.
constexpr const char* kKindNames[] = {"timeout", "lost", "error"};

}  // namespace

std::string never_arrived_text(const std::vector<int>& members,
                               const std::function<std::string(int)>& describe) {
  std::string text = "never arrived: ";
  for (size_t i = 0; i < members.size(); ++i) {
    if (i > 0) text += ", ";
    text += describe ? describe(members[i]) : "rank " + std::to_string(members[i]);
  }
  return text;
}

RoundFailure RoundFailure::of(const c10::Error& error) {
  Kind kind = Kind::kError;
  if (dynamic_cast<const TimeoutError*>(&error) != nullptr) kind = Kind::kTimeout;
  if (dynamic_cast<const PeerLostError*>(&error) != nullptr) kind = Kind::kPeerLost;
  return RoundFailure{kind, error.what_without_backtrace()};
}

std::string RoundFailure::encode() const {
  return std::string(kKindNames[static_cast<int>(kind)]) + "\n" + message;
}

RoundFailure RoundFailure::decode(const std::string& text) {
  const size_t newline = text.find('\n');
  if (newline != std::string::npos) {
    for (int kind = 0; kind < static_cast<int>(std::size(kKindNames)); ++kind) {
      if (text.compare(0, newline, kKindNames[kind]) == 0) {
        return RoundFailure{static_cast<Kind>(kind), text.substr(newline + 1)};
      }
    }
  }
  return RoundFailure{Kind::kError, text};
}

void RoundFailure::raise(const std::string& context) const {
  switch (kind) {
    case Kind::kTimeout:
      DISTOPTIM_THROW(TimeoutError, context, message);
    case Kind::kPeerLost:
      DISTOPTIM_THROW(PeerLostError, context, message);
    case Kind::kError:
      break;
  }
  DISTOPTIM_THROW(DistributedError, context, message);
}

StoreRound::Keys StoreRound::Keys::under(const std::string& prefix) {
  return Keys{prefix, prefix + "failed", prefix + "left/"};
}

StoreRound::StoreRound(DeadlineStore& store, Keys keys, int rank, int world_size)
    : store_(store), keys_(std::move(keys)), rank_(rank), world_size_(world_size) {
  TORCH_CHECK_VALUE(world_size >= 1, "StoreRound: world_size = ", world_size,
                    "; must be at least 1");
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size, "StoreRound: rank = ", rank, " is not in [0, ",
                    world_size, ")");
}

std::string StoreRound::arrival_key(int rank) const { return keys_.arrived + std::to_string(rank); }

int64_t StoreRound::arrive(Clock::time_point deadline) {
  return store_.add(arrival_key(rank_), 1, deadline);
}

void StoreRound::arrive(const std::vector<uint8_t>& value, Clock::time_point deadline) {
  store_.set(arrival_key(rank_), value, deadline);
}

std::vector<int> StoreRound::wait_for_all(Clock::time_point deadline,
                                          const std::function<void()>& each_poll,
                                          std::chrono::milliseconds per_operation) const {
  return wait_for_rank_keys(store_, keys_.arrived, world_size_, deadline, each_poll, per_operation);
}

void StoreRound::await_all(Clock::time_point deadline, const std::string& subject,
                           const std::string& what, const std::string& prefix,
                           const std::function<std::string(int)>& describe) {
  const std::vector<int> missing = wait_for_rank_keys(
      store_, prefix.empty() ? keys_.arrived : prefix, world_size_, deadline, [&] {
        if (std::optional<std::string> published = read_failure(deadline)) {
          RoundFailure::decode(*published)
              .raise(subject + " failed at rank 0 (seen by rank " + std::to_string(rank_) + "): ");
        }
      });
  DISTOPTIM_CHECK_WITH(TimeoutError, missing.empty(), what, "; ",
                       never_arrived_text(missing, describe));
}

void StoreRound::wait_for(std::vector<int>* missing, Clock::time_point deadline) const {
  // Short pauses first: members usually report within milliseconds of each other.
  auto pause = std::chrono::milliseconds(1);
  while (!missing->empty()) {
    std::vector<std::string> keys;
    for (int r : *missing) keys.push_back(arrival_key(r));
    if (store_.check(keys, deadline)) {
      missing->clear();
      return;
    }
    std::vector<int> still;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!store_.check({keys[i]}, deadline)) still.push_back((*missing)[i]);
    }
    *missing = std::move(still);
    if (Clock::now() >= deadline) return;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
}

std::vector<int> StoreRound::not_arrived(Clock::time_point deadline,
                                         const std::string& prefix) const {
  return ranks_without_key(store_, prefix.empty() ? keys_.arrived : prefix, world_size_, deadline);
}

std::vector<int> StoreRound::ranks_not_left(Clock::time_point deadline) const {
  std::vector<int> waiting;
  for (int r = 1; r < world_size_; ++r) {
    const int64_t arrivals = times_counted(store_, arrival_key(r), deadline);
    if (arrivals == 0) continue;
    if (times_counted(store_, keys_.left + std::to_string(r), deadline) < arrivals) {
      waiting.push_back(r);
    }
  }
  return waiting;
}

void StoreRound::publish_failure(const std::string& why, Clock::time_point until) {
  TORCH_CHECK_VALUE(rank_ == 0, "StoreRound::publish_failure: rank ", rank_,
                    " is not the host (rank 0)");
  try {
    store_.set(keys_.failed, std::vector<uint8_t>(why.begin(), why.end()), until);
    // Bounded: a waiting rank reads the failure within its next poll (at most 50 ms apart).
    while (!ranks_not_left(until).empty() && Clock::now() < until) {
      std::this_thread::sleep_for(kLeavePollInterval);
    }
  } catch (const std::exception&) {
    // The store failing too leaves nothing more to tell anyone.
  }
}

std::optional<std::string> StoreRound::read_failure(Clock::time_point deadline) {
  if (rank_ == 0 || !store_.check({keys_.failed}, deadline)) return std::nullopt;
  const std::vector<uint8_t> why = store_.get(keys_.failed, deadline);
  leave(deadline);
  return std::string(why.begin(), why.end());
}

void StoreRound::leave(Clock::time_point deadline) {
  if (left_) return;
  // Marked first: an add that timed out may still take effect, and must not count twice.
  left_ = true;
  store_.add(keys_.left + std::to_string(rank_), 1, deadline);
}

}  // namespace comm
}  // namespace distoptim
