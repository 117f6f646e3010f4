// StoreRound on a real TCPStore over loopback, every rank a real process: arrivals and the ranks
// missing at the deadline, the host's published failure read with its exact text, the host's
// wait for the ranks that arrived (and only those), and an each-poll hook that stops the wait.

#include <cstdlib>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <distoptim/comm.h>

#include "harness/multiprocess.h"
#include "host_port.h"

namespace distoptim {
namespace comm {
namespace store_round_test {

using distoptim::testing::run_ranks;
using namespace std::chrono_literals;
using Clock = StoreRound::Clock;

// Far beyond every test's deadline: a wait that should end by itself and does not fails the
// test there (run_ranks kills the ranks and names them), instead of a timing assertion.
constexpr auto kLongWait = 300s;

testing::RunRanksOptions bounded() {
  testing::RunRanksOptions options;
  options.deadline = 40s;
  return options;
}

// This rank's connection to the TCPStore on MASTER_PORT that rank 0 serves (rank 0 serves it).
c10::intrusive_ptr<DeadlineStore> connect_store(int rank, int world_size) {
  const std::string port = std::getenv("MASTER_PORT");
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(std::stoi(port));
  options.isServer = rank == 0;
  options.numWorkers = static_cast<size_t>(world_size);
  options.waitWorkers = false;
  options.timeout = 30s;
  // LibTorch's client sleeps a second after each refusal while rank 0 is not listening yet,
  // and may give up: wait for the listener (every 10 ms), then try again until it connects.
  const auto until = Clock::now() + 30s;
  if (rank != 0) detail::wait_until_listening("127.0.0.1", options.port, until);
  while (true) {
    try {
      return c10::make_intrusive<DeadlineStore>(
          c10::make_intrusive<c10d::TCPStore>("127.0.0.1", options), "127.0.0.1:" + port, 30s);
    } catch (const std::exception&) {
      if (Clock::now() >= until) throw;
      std::this_thread::sleep_for(20ms);
    }
  }
}

// The end of a test: rank 0 serves the store, so it returns only once the other processes in
// `ranks` are done with it (a client whose server vanished mid-operation aborts its process).
void finish(DeadlineStore& store, int rank, const std::vector<int>& ranks) {
  if (rank != 0) {
    store.add("finished/" + std::to_string(rank), 1);
    return;
  }
  std::vector<std::string> keys;
  for (int r : ranks) {
    if (r != 0) keys.push_back("finished/" + std::to_string(r));
  }
  if (!keys.empty()) store.wait(keys, 30s);
}

// What a waiting rank's each-poll hook throws on reading the host's failure.
struct Published {
  std::string why;
};

TEST(StoreRound, EveryRankArrivesAndNoneIsMissing) {
  for (int world_size = 1; world_size <= 4; ++world_size) {
    SCOPED_TRACE(world_size);
    run_ranks(
        world_size,
        [](int rank, int world_size) {
          auto store = connect_store(rank, world_size);
          const auto deadline = Clock::now() + 30s;
          StoreRound counted(*store, StoreRound::Keys::under("counted/"), rank, world_size);
          EXPECT_EQ(counted.arrive(deadline), 1);
          EXPECT_EQ(counted.wait_for_all(deadline), std::vector<int>{});

          // Arrivals that carry data: every rank reads every rank's value back.
          StoreRound valued(*store, StoreRound::Keys::under("valued/"), rank, world_size);
          const std::string mine = "rank " + std::to_string(rank);
          valued.arrive(std::vector<uint8_t>(mine.begin(), mine.end()), deadline);
          EXPECT_EQ(valued.wait_for_all(deadline), std::vector<int>{});
          for (int r = 0; r < world_size; ++r) {
            const std::vector<uint8_t> theirs = store->get(valued.arrival_key(r), deadline);
            EXPECT_EQ(std::string(theirs.begin(), theirs.end()), "rank " + std::to_string(r));
          }
          std::vector<int> all(world_size);
          for (int r = 0; r < world_size; ++r) all[r] = r;
          finish(*store, rank, all);
        },
        bounded());
  }
}

TEST(StoreRound, RankThatNeverArrivesIsNamedAtTheDeadline) {
  run_ranks(
      4,
      [](int rank, int world_size) {
        if (rank == 2) return;  // never arrives
        auto store = connect_store(rank, world_size);
        StoreRound round(*store, StoreRound::Keys::under("round/"), rank, world_size);
        round.arrive(Clock::now() + 30s);
        // The others arrive, however slowly their processes start; then a short deadline.
        store->wait({"round/0", "round/1", "round/3"}, 30s);
        EXPECT_EQ(round.wait_for_all(Clock::now() + 1s), std::vector<int>{2});
        EXPECT_EQ(ranks_without_key(*store, "round/", world_size, Clock::now() + 10s),
                  std::vector<int>{2});
        finish(*store, rank, {0, 1, 3});
      },
      bounded());
}

TEST(StoreRound, HostsFailureIsReadWithItsExactTextAndTheHostStopsWaitingOnceItIs) {
  // Rank 3 never arrives: rank 0 gives up on it, publishes why, and waits for ranks 1 and 2 (not
  // for rank 3, which did not come) to read it; they stop waiting for rank 3 on reading it.
  const std::string why = "rank 0 waited for rank 3\nwhich never came";
  run_ranks(
      4,
      [&why](int rank, int world_size) {
        if (rank == 3) return;
        auto store = connect_store(rank, world_size);
        StoreRound round(*store, StoreRound::Keys::under("round/"), rank, world_size);
        round.arrive(Clock::now() + 30s);
        if (rank == 0) {
          store->wait({"round/1", "round/2"}, 30s);
          EXPECT_EQ(round.wait_for_all(Clock::now() + 1s), std::vector<int>{3});
          EXPECT_FALSE(round.read_failure(Clock::now() + 10s).has_value());
          round.publish_failure(why, Clock::now() + kLongWait);
          EXPECT_EQ(round.ranks_not_left(Clock::now() + 10s), std::vector<int>{});
          const std::vector<uint8_t> failed = store->get("round/failed");
          EXPECT_EQ(std::string(failed.begin(), failed.end()), why);
        } else {
          const auto deadline = Clock::now() + kLongWait;
          try {
            round.wait_for_all(deadline, [&] {
              if (auto published = round.read_failure(deadline)) throw Published{*published};
            });
            ADD_FAILURE() << "rank " << rank << " did not read the host's failure";
          } catch (const Published& published) {
            EXPECT_EQ(published.why, why);
          }
          // It left once, by reading; leaving again does not count.
          round.leave(Clock::now() + 10s);
          EXPECT_EQ(store->add("round/left/" + std::to_string(rank), 0), 1);
        }
        finish(*store, rank, {0, 1, 2});
      },
      bounded());
}

TEST(StoreRound, HostWaitsForEveryProcessThatArrivedAsOneRank) {
  // Processes 1 and 2 both arrive as rank 1 of a round of 2: the host waits until both read its
  // failure, not only the first.
  run_ranks(
      3,
      [](int process, int processes) {
        auto store = connect_store(process, processes);
        const int rank = process == 0 ? 0 : 1;
        StoreRound round(*store, StoreRound::Keys::under("round/"), rank, 2);
        const int64_t arrivals = round.arrive(Clock::now() + 30s);
        store->add("arrived/" + std::to_string(process), arrivals);
        if (process == 0) {
          store->wait({"arrived/1", "arrived/2"}, 30s);
          const std::set<int64_t> counts = {store->add("arrived/1", 0), store->add("arrived/2", 0)};
          EXPECT_EQ(counts, (std::set<int64_t>{1, 2}));
          round.publish_failure("stop", Clock::now() + kLongWait);
          EXPECT_EQ(store->add("round/left/1", 0), 2);
        } else {
          // Only one of them reads it at first: the host goes on waiting for the other.
          if (process == 2) store->wait({"round/left/1"}, 30s);
          const auto deadline = Clock::now() + kLongWait;
          std::optional<std::string> published;
          while (!(published = round.read_failure(deadline))) {
            std::this_thread::sleep_for(5ms);
          }
          EXPECT_EQ(*published, "stop");
        }
        finish(*store, process, {0, 1, 2});
      },
      bounded());
}

TEST(StoreRound, EachPollHookThatThrowsStopsTheWait) {
  run_ranks(
      1,
      [](int rank, int) {
        auto store = connect_store(rank, 1);
        // A round of 2 whose rank 1 never comes: only the hook can end the wait before its
        // deadline.
        StoreRound round(*store, StoreRound::Keys::under("round/"), rank, 2);
        round.arrive(Clock::now() + 30s);
        int polls = 0;
        try {
          round.wait_for_all(Clock::now() + kLongWait, [&polls] {
            if (++polls == 3) throw Published{"third poll"};
          });
          ADD_FAILURE() << "the wait went on after its hook threw";
        } catch (const Published& stopped) {
          EXPECT_EQ(stopped.why, "third poll");
        }
        EXPECT_EQ(polls, 3);
      },
      bounded());
}

TEST(StoreRound, ChecksItsRankAndHost) {
  run_ranks(
      1,
      [](int rank, int) {
        auto store = connect_store(rank, 1);
        const auto keys = StoreRound::Keys::under("p/");
        EXPECT_EQ(keys.arrived, "p/");
        EXPECT_EQ(keys.failed, "p/failed");
        EXPECT_EQ(keys.left, "p/left/");
        EXPECT_THROW(StoreRound(*store, keys, 2, 2), c10::ValueError);
        EXPECT_THROW(StoreRound(*store, keys, 0, 0), c10::ValueError);
        StoreRound not_host(*store, keys, 1, 2);
        EXPECT_THROW(not_host.publish_failure("no", Clock::now() + 10s), c10::ValueError);
        EXPECT_FALSE(store->check({"p/failed"}));
        EXPECT_FALSE(not_host.read_failure(Clock::now() + 10s).has_value());
      },
      bounded());
}

TEST(RoundFailure, KeepsItsKindAndTextThroughTheStoreAndRaisesItsType) {
  const std::string text = "rank 0 waited\nfor rank 3";
  const std::vector<std::pair<RoundFailure::Kind, std::string>> kinds = {
      {RoundFailure::Kind::kTimeout, "timeout\n"},
      {RoundFailure::Kind::kPeerLost, "lost\n"},
      {RoundFailure::Kind::kError, "error\n"}};
  for (const auto& [kind, tag] : kinds) {
    const RoundFailure failure{kind, text};
    EXPECT_EQ(failure.encode(), tag + text);
    const RoundFailure read = RoundFailure::decode(failure.encode());
    EXPECT_EQ(read.kind, kind);
    EXPECT_EQ(read.message, text);
    try {
      read.raise("seen by rank 1: ");
    } catch (const c10::Error& error) {
      EXPECT_EQ(std::string(error.what_without_backtrace()).rfind("seen by rank 1: " + text, 0), 0u)
          << error.what_without_backtrace();
      EXPECT_EQ(RoundFailure::of(error).kind, kind) << error.what_without_backtrace();
    }
  }
  // A text in no known encoding is an error of the whole text.
  const RoundFailure unknown = RoundFailure::decode("ended\nbadly");
  EXPECT_EQ(unknown.kind, RoundFailure::Kind::kError);
  EXPECT_EQ(unknown.message, "ended\nbadly");
  EXPECT_EQ(never_arrived_text({1, 3}), "never arrived: rank 1, rank 3");
  EXPECT_EQ(never_arrived_text({2}, [](int node) { return "node " + std::to_string(node); }),
            "never arrived: node 2");
}

TEST(StoreRound, AwaitAllNamesTheMissingAtTheHostAndTheOthersFailWithItsReason) {
  // Rank 3 never comes to the second phase: rank 0 names it at its deadline and publishes that;
  // ranks 1 and 2, waiting far longer, fail with rank 0's reason and type, as the rendezvous does.
  run_ranks(
      4,
      [](int rank, int world_size) {
        auto store = connect_store(rank, world_size);
        StoreRound round(*store, StoreRound::Keys::under("round/"), rank, world_size);
        round.arrive(Clock::now() + 30s);
        round.await_all(Clock::now() + kLongWait, "phases", "rank waited for the arrivals");
        if (rank == 3) {
          // Rank 0 knows rank 3 arrived: it waits until rank 3 has left too.
          store->wait({"round/failed"}, 30s);
          round.leave(Clock::now() + 10s);
          return;
        }
        store->set("second/" + std::to_string(rank), {'1'});
        try {
          if (rank == 0) store->wait({"second/1", "second/2"}, 30s);
          const auto deadline = rank == 0 ? Clock::now() + 1s : Clock::now() + kLongWait;
          round.await_all(deadline, "phases", "rank " + std::to_string(rank) + " waited",
                          "second/");
          ADD_FAILURE() << "rank " << rank << " passed without rank 3";
        } catch (const TimeoutError& error) {
          const std::string what = error.what_without_backtrace();
          if (rank == 0) {
            EXPECT_EQ(what, "rank 0 waited; never arrived: rank 3");
            round.publish_failure(RoundFailure::of(error).encode(), Clock::now() + kLongWait);
            EXPECT_EQ(round.ranks_not_left(Clock::now() + 10s), std::vector<int>{});
          } else {
            EXPECT_EQ(what, "phases failed at rank 0 (seen by rank " + std::to_string(rank) +
                                "): rank 0 waited; never arrived: rank 3");
          }
        }
        finish(*store, rank, {0, 1, 2});
      },
      bounded());
}

TEST(StoreRound, WaitForKnowsAfterEveryPollWhoHadNotArrived) {
  // A round of 4 of which ranks 0 and 1 are processes, rank 3's report is written by rank 0, and
  // rank 2 never reports: the wait ends at its deadline with rank 2 alone (what the group's
  // failure reports name).
  run_ranks(
      2,
      [](int rank, int world_size) {
        auto store = connect_store(rank, world_size);
        StoreRound reports(*store, StoreRound::Keys::under("reports/"), rank, 4);
        reports.arrive({'1'}, Clock::now() + 30s);
        if (rank == 0) {
          store->wait({"reports/1"}, 30s);
          std::vector<int> missing = {1, 2, 3};
          store->set("reports/3", {'1'});
          reports.wait_for(&missing, Clock::now() + 1s);
          EXPECT_EQ(missing, std::vector<int>{2});
          std::vector<int> none = {1, 3};
          reports.wait_for(&none, Clock::now() + kLongWait);
          EXPECT_EQ(none, std::vector<int>{});
        }
        finish(*store, rank, {0, 1});
      },
      bounded());
}

}  // namespace store_round_test
}  // namespace comm
}  // namespace distoptim
