// Process groups on Gloo: the default group, new_group and subgroups, with real collectives
// across real processes, and the ways they fail.

#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <string>
#include <thread>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <distoptim/comm.h>

#include "harness/absent_rank.h"
#include "harness/multiprocess.h"
#include "support/test_util.h"

namespace distoptim {
namespace comm {
namespace process_group_test {

using distoptim::testing::expect_error_containing;
using distoptim::testing::run_ranks;
using namespace std::chrono_literals;

// The sum over `group` of (global rank + 1), by an allreduce, as a double.
double allreduce_rank_sum(const Group& group) {
  std::vector<at::Tensor> tensors = {torch::full({5}, static_cast<double>(get_rank() + 1))};
  group.process_group()->allreduce(tensors)->wait();
  EXPECT_TRUE(at::equal(tensors[0], torch::full({5}, tensors[0][0].item<double>())));
  return tensors[0][0].item<double>();
}

// This process's threads.
std::set<std::string> thread_ids() {
  std::set<std::string> ids;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    ids.insert(entry.path().filename().string());
  }
  return ids;
}

// Whether thread `id` of this process blocks SIGPIPE (its status's SigBlk mask, in hex).
bool blocks_sigpipe(const std::string& id) {
  std::ifstream status("/proc/self/task/" + id + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("SigBlk:", 0) == 0) {
      const uint64_t mask = std::stoull(line.substr(7), nullptr, 16);
      return ((mask >> (SIGPIPE - 1)) & 1) != 0;
    }
  }
  ADD_FAILURE() << "no SigBlk for thread " << id;
  return false;
}

bool caller_blocks_sigpipe() {
  sigset_t mask;
  pthread_sigmask(SIG_SETMASK, nullptr, &mask);
  return sigismember(&mask, SIGPIPE) == 1;
}

double expected_sum(const std::vector<int>& ranks) {
  double sum = 0;
  for (int r : ranks) sum += r + 1;
  return sum;
}

TEST(ProcessGroup, NotInitializedAndBadBackend) {
  expect_error_containing([] { get_rank(); }, {"get_rank", "not initialized"});
  expect_error_containing([] { new_group({0}); }, {"new_group", "not initialized"});
  expect_error_containing([] { init_process_group(ProcessGroupOptions().backend("nccl")); },
                          {"backend 'nccl'"});
  EXPECT_FALSE(is_initialized());
}

TEST(ProcessGroup, WorldAllreduceAndBarrier) {
  for (int world_size : {2, 3}) {
    SCOPED_TRACE(world_size);
    run_ranks(world_size, [](int rank, int world_size) {
      init_process_group(ProcessGroupOptions("env://").timeout(30s));
      EXPECT_TRUE(is_initialized());
      EXPECT_EQ(get_rank(), rank);
      EXPECT_EQ(get_world_size(), world_size);
      EXPECT_EQ(get_local_rank(), rank);
      EXPECT_EQ(get_local_world_size(), world_size);
      EXPECT_EQ(world().rank(), rank);
      EXPECT_EQ(world().size(), world_size);
      std::vector<int> all;
      for (int r = 0; r < world_size; ++r) all.push_back(r);
      EXPECT_EQ(allreduce_rank_sum(world()), expected_sum(all));
      world().barrier();
      expect_error_containing([] { init_process_group(); }, {"already initialized"});
      destroy_process_group();
      EXPECT_FALSE(is_initialized());
    });
  }
}

// Gloo writes with writev, which raises SIGPIPE when the peer has gone: a rank must get the
// error naming the lost peer, not be killed. Every thread the group starts blocks SIGPIPE, and
// the caller's own mask is left as it was.
TEST(ProcessGroup, ItsThreadsCannotBeKilledBySigpipe) {
  run_ranks(2, [](int rank, int) {
    const std::set<std::string> before = thread_ids();
    init_process_group(ProcessGroupOptions("env://").timeout(30s));
    int started = 0;
    for (const std::string& id : thread_ids()) {
      if (before.count(id) != 0) continue;
      ++started;
      EXPECT_TRUE(blocks_sigpipe(id)) << "thread " << id << " started by init_process_group";
    }
    EXPECT_GT(started, 0);
    EXPECT_FALSE(caller_blocks_sigpipe());
    std::vector<at::Tensor> tensors = {torch::full({4}, static_cast<double>(rank))};
    if (rank == 0) {
      world().process_group()->send(tensors, 1, 7)->wait();
    } else {
      world().process_group()->recv(tensors, 0, 7)->wait();
      EXPECT_TRUE(at::equal(tensors[0], torch::zeros({4}, at::kDouble)));
    }
    EXPECT_FALSE(caller_blocks_sigpipe());
    destroy_process_group();
  });
}

TEST(ProcessGroup, NewGroupOfSomeRanks) {
  run_ranks(3, [](int rank, int) {
    init_process_group(ProcessGroupOptions("env://").timeout(30s));
    // Unsorted on purpose: group ranks follow global order.
    const Group pair = new_group({2, 0});
    EXPECT_EQ(pair.ranks(), (std::vector<int>{0, 2}));
    EXPECT_EQ(pair.is_member(), rank != 1);
    EXPECT_EQ(pair.global_rank(1), 2);
    EXPECT_EQ(pair.group_rank(2), 1);
    expect_error_containing([&] { pair.group_rank(1); }, {"global rank 1", "[0, 2]"});
    if (rank == 1) {
      EXPECT_EQ(pair.rank(), -1);
      EXPECT_FALSE(pair.process_group());
    } else {
      EXPECT_EQ(pair.rank(), rank / 2);
      EXPECT_EQ(allreduce_rank_sum(pair), expected_sum({0, 2}));
    }
    // The world still works after a subgroup has been made.
    EXPECT_EQ(allreduce_rank_sum(world()), expected_sum({0, 1, 2}));
    destroy_process_group();
  });
}

TEST(ProcessGroup, Subgroups) {
  run_ranks(3, [](int rank, int) {
    init_process_group(ProcessGroupOptions("env://").timeout(30s));
    // By host: one machine, so one subgroup of everyone (PyTorch's needs CUDA for this).
    auto [by_host, all_by_host] = new_subgroups();
    ASSERT_EQ(all_by_host.size(), 1u);
    EXPECT_EQ(by_host.ranks(), (std::vector<int>{0, 1, 2}));
    EXPECT_EQ(allreduce_rank_sum(by_host), expected_sum({0, 1, 2}));
    // Singletons.
    auto [alone, singletons] = new_subgroups(1);
    ASSERT_EQ(singletons.size(), 3u);
    EXPECT_EQ(alone.ranks(), (std::vector<int>{rank}));
    EXPECT_EQ(allreduce_rank_sum(alone), rank + 1);
    // Uneven, by enumeration.
    auto [mine, listed] = new_subgroups_by_enumeration({{0, 1}, {2}});
    ASSERT_EQ(listed.size(), 2u);
    EXPECT_EQ(mine.ranks(), rank < 2 ? (std::vector<int>{0, 1}) : (std::vector<int>{2}));
    EXPECT_EQ(allreduce_rank_sum(mine), expected_sum(mine.ranks()));
    EXPECT_FALSE(listed[rank < 2 ? 1 : 0].is_member());
    // Bad input, checked before anything is made (so every rank throws alike).
    expect_error_containing([] { new_subgroups(2); }, {"world size 3", "group_size = 2"});
    expect_error_containing([] { new_subgroups(0); }, {"group_size = 0"});
    expect_error_containing(
        [] {
          new_subgroups_by_enumeration({{0, 1}, {1, 2}});
        },
        {"rank 1 is in more than one subgroup"});
    expect_error_containing([] { new_group({0, 3}); }, {"rank 3", "[0, 3)"});
    expect_error_containing([] { new_group({0, 0}); }, {"rank 0 appears twice"});
    // Rank 0 hosts the store: it must not exit while rank 2, the only member of the enumeration's
    // {2} (which ranks 0 and 1 leave at once), still reads the others' keys there.
    world().barrier();
    destroy_process_group();
  });
}

TEST(ProcessGroupFailure, DisagreeingNewGroupIsNamed) {
  run_ranks(3, [](int rank, int) {
    init_process_group(ProcessGroupOptions("env://").timeout(30s));
    const std::vector<int> ranks = rank == 1 ? std::vector<int>{0, 1, 2} : std::vector<int>{0, 1};
    try {
      const Group group = new_group(ranks, 10s);
      EXPECT_EQ(rank, 2) << "only rank 2, outside its own list, returns";
      EXPECT_FALSE(group.is_member());
    } catch (const c10::ValueError& e) {
      const std::string expected = rank == 0 ? "rank 1 passed ranks=[0, 1, 2] but rank 0 passed"
                                             : "rank 0 passed ranks=[0, 1] but rank 1 passed";
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
    world().barrier();
    destroy_process_group();
  });
}

TEST(ProcessGroupFailure, RankThatNeverCallsNewGroupIsNamed) {
  run_ranks(3, [](int rank, int) {
    init_process_group(ProcessGroupOptions("env://").timeout(30s));
    // Together first: on a loaded machine ranks 0 and 1 could otherwise start 1 s apart. 5 s,
    // not less: the store's own answers count against it (see the next test).
    world().barrier();
    if (rank != 2) {
      try {
        new_group({0, 1}, 5s);
        ADD_FAILURE() << "expected a TimeoutError";
      } catch (const TimeoutError& e) {
        EXPECT_NE(std::string(e.what()).find("these ranks never called it: 2"), std::string::npos)
            << e.what();
      }
    }
    world().barrier();
    destroy_process_group();
  });
}

// Whether `message` lists global rank `rank` after `lead` ("these ranks never reached it: 1, 2",
// "ranks 1, 2 are lost"). A list may hold more ranks than the one at fault: a live member slow
// to notice the failure is named too.
bool names_rank(const std::string& message, const std::string& lead, int rank,
                const std::string& tail) {
  const std::regex pattern(lead + "([0-9]+, )*" + std::to_string(rank) + "(, [0-9]+)*" + tail);
  return std::regex_search(message, pattern);
}

// The message of the `Error` that the first allreduce on `group` (of ranks 0, 1, 2) must fail
// with, checked for what every such message says first.
template <class Error>
std::string failed_allreduce_message(const Group& group) {
  std::vector<at::Tensor> tensors = {torch::ones({3})};
  try {
    group.process_group()->allreduce(tensors)->wait();
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("allreduce #1 on group [0, 1, 2] failed at rank " +
                           std::to_string(get_rank()) + ": "),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("; Gloo: "), std::string::npos) << message;
    return message;
  }
  ADD_FAILURE() << "expected the allreduce to fail";
  return "";
}

// Ranks 0 and 1 leave together: rank 0 serves the store, which rank 1 may still be polling for
// the others' failure reports when rank 0 is done.
void leave_together(int rank) {
  const c10::intrusive_ptr<DeadlineStore> store = default_store();
  if (rank == 1) store->set("test/done/1", {1});
  if (rank == 0) store->wait({"test/done/1"}, 20s);
}

void expect_timeout_naming(const Group& group, int absent) {
  const std::string message = failed_allreduce_message<TimeoutError>(group);
  EXPECT_NE(message.find(": timed out; "), std::string::npos) << message;
  EXPECT_TRUE(names_rank(message, "these ranks never reached it: ", absent, " \\(")) << message;
}

TEST(ProcessGroupFailure, CollectiveOnSomeRanksTimesOutNamingTheAbsentRank) {
  run_ranks(3, [](int rank, int) {
    init_process_group(ProcessGroupOptions("env://").timeout(30s));
    // Together first: making the group is bounded by its timeout too. 5 s, not less: under
    // ThreadSanitizer on a machine kept busy, rank 0's store once took over 1 s to answer the
    // group's first check.
    world().barrier();
    const Group impatient = new_group({}, 5s);
    const distoptim::testing::AbsentRank absent(rank, 3, 2);
    if (rank == 2) {
      absent.stay_until_the_others_are_done();  // skips the collective, connected
      return;
    }
    expect_timeout_naming(impatient, 2);
    absent.done();
  });
}

TEST(ProcessGroupFailure, DeadRankIsNamedAsLost) {
  distoptim::testing::RunRanksOptions options;
  options.expected_exit_codes[2] = 3;
  run_ranks(
      3,
      [](int rank, int) {
        // A long timeout: the survivors fail as soon as the others have reported, not after it.
        init_process_group(ProcessGroupOptions("env://").timeout(30s));
        // Rank 2 dies once the others have their group: its init returning does not mean theirs
        // has (a survivor may still be reading the last of the connection's handshake).
        const c10::intrusive_ptr<DeadlineStore> store = default_store();
        if (rank == 2) {
          store->wait({"test/group/0", "test/group/1"}, 20s);
          std::_Exit(3);
        }
        store->set("test/group/" + std::to_string(rank), {1});
        const std::string message = failed_allreduce_message<PeerLostError>(world());
        EXPECT_TRUE(names_rank(message, "ranks? ", 2, " (is|are) lost")) << message;
        // Gloo's own text: "Connection closed by peer" or "Connection reset by peer", as the
        // socket saw it.
        EXPECT_NE(message.find("by peer"), std::string::npos) << message;
        leave_together(rank);
      },
      options);
}

TEST(ProcessGroupFailure, StoppedRankIsNamedInTheTimeout) {
  distoptim::testing::RunRanksOptions options;
  options.expected_exit_codes[2] = 3;
  run_ranks(
      3,
      [](int rank, int) {
        init_process_group(ProcessGroupOptions("env://").timeout(30s));
        world().barrier();  // together first: making the group is bounded by its 5 s too
        const Group impatient = new_group({}, 5s);
        const c10::intrusive_ptr<DeadlineStore> store = default_store();
        const auto deadline = std::chrono::steady_clock::now() + 20s;
        if (rank == 2) {
          const std::string pid = std::to_string(::getpid());
          store->set("test/pid/2", std::vector<uint8_t>(pid.begin(), pid.end()), deadline);
          ::raise(SIGSTOP);
          // Continued by rank 0 once the others have checked their errors.
          std::_Exit(3);
        }
        expect_timeout_naming(impatient, 2);
        leave_together(rank);
        if (rank == 1) return;
        // Then rank 0 lets rank 2 go.
        const std::vector<uint8_t> pid = store->get("test/pid/2", deadline);
        const pid_t stopped = std::stoi(std::string(pid.begin(), pid.end()));
        EXPECT_TRUE(distoptim::testing::wait_for_process_state(stopped, "T", 10s));
        ::kill(stopped, SIGCONT);
        EXPECT_TRUE(distoptim::testing::wait_for_process_state(stopped, "Z?", 20s));
      },
      options);
}

// Gloo's address of a listening socket as its tcp transport publishes it in the store
// (gloo::transport::tcp::Address: a sockaddr_storage, then a sequence number, -1 for a pair's own
// listener), for 127.0.0.1:`port`.
std::vector<uint8_t> gloo_loopback_address(uint16_t port) {
  sockaddr_storage storage{};
  auto* address = reinterpret_cast<sockaddr_in*>(&storage);
  address->sin_family = AF_INET;
  address->sin_port = htons(port);
  address->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const int64_t sequence = -1;
  std::vector<uint8_t> bytes(sizeof(storage) + sizeof(sequence));
  std::memcpy(bytes.data(), &storage, sizeof(storage));
  std::memcpy(bytes.data() + sizeof(storage), &sequence, sizeof(sequence));
  return bytes;
}

// Ranks 0 and 1 of 3 make a group with timeout `timeout`; rank 2 joins new_group call #1 by hand
// and advertises, as its Gloo address for both peers, 127.0.0.1:`port`, where nothing listens.
// Both must fail, at least one with `Error` naming rank 2 and keeping Gloo's `gloo_words` (the
// other so too, or saying that the first closed their connection), and go on: a barrier of the
// world group follows.
template <class Error>
void expect_group_naming_unreachable_rank(uint16_t port, std::chrono::milliseconds timeout,
                                          const std::string& gloo_words) {
  run_ranks(3, [&](int rank, int) {
    init_process_group(ProcessGroupOptions("env://").timeout(30s));
    const c10::intrusive_ptr<DeadlineStore> store = default_store();
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    if (rank == 2) {
      const std::string ranks = "[0, 1, 2]";
      store->set("group/1/ranks/2", std::vector<uint8_t>(ranks.begin(), ranks.end()), deadline);
      const std::vector<uint8_t> one = gloo_loopback_address(port);
      std::vector<uint8_t> addresses = one;
      addresses.insert(addresses.end(), one.begin(), one.end());
      // c10d's and Gloo's prefixes: "<group prefix>/<device>/<rank>", and Gloo's host name key.
      store->set("group/1/pg//0/2", addresses, deadline);
      char host[256] = {};
      ::gethostname(host, sizeof(host) - 1);
      store->set("group/1/pg//0/rank_2", std::vector<uint8_t>(host, host + std::strlen(host)),
                 deadline);
      world().barrier();  // until the others are done
      return;
    }
    // Ranks 0 and 1 both fail. The first to give up names rank 2; the other names it too, or,
    // when the first closed its side of their pair before its own wait ended (a slow machine),
    // says the peer closed the connection: which of the two comes first is timing's.
    std::string route = "none";
    try {
      new_group({}, timeout);
      ADD_FAILURE() << "new_group succeeded with an unreachable member";
    } catch (const c10::Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("new_group(ranks=[0, 1, 2]) (call #1): connecting the Gloo group "
                             "[0, 1, 2] failed at rank " +
                             std::to_string(rank) + ": "),
                std::string::npos)
          << message;
      if (dynamic_cast<const Error*>(&e) != nullptr &&
          names_rank(message, "could not reach ranks? ", 2, "; Gloo: ") &&
          message.find(gloo_words) != std::string::npos) {
        route = "named";
      } else if (message.find("Connection closed by peer") != std::string::npos) {
        route = "closed";
      } else {
        ADD_FAILURE() << "neither names rank 2 (" << gloo_words
                      << ") nor says a peer closed the connection: " << message;
      }
    }
    store->set("test/route/" + std::to_string(rank),
               std::vector<uint8_t>(route.begin(), route.end()), deadline);
    // The world group still works.
    world().barrier();
    if (rank == 0) {
      std::set<std::string> routes;
      for (int r : {0, 1}) {
        const std::vector<uint8_t> bytes = store->get("test/route/" + std::to_string(r), deadline);
        routes.insert(std::string(bytes.begin(), bytes.end()));
      }
      EXPECT_EQ(routes.count("named"), 1u) << "no rank named rank 2";
      EXPECT_EQ(routes.count("none"), 0u);
    }
  });
}

// Gloo compares the raw (network order) ports as integers: the side whose address sorts above
// the other's connects. Port 256 (raw 1) sorts below any other, so ranks 0 and 1 connect and are
// refused at once.
TEST(ProcessGroupFailure, UnreachablePeerWhileMakingAGroupIsNamed) {
  expect_group_naming_unreachable_rank<PeerLostError>(256, 5s, "Connection refused");
}

// Port 65535 sorts above any other: ranks 0 and 1 wait for rank 2 to connect, until Gloo's connect
// timeout (5 times the group's).
TEST(ProcessGroupFailure, SilentPeerWhileMakingAGroupTimesOutNamingIt) {
  expect_group_naming_unreachable_rank<TimeoutError>(65535, 1s,
                                                     "group's timeout of 1000 ms to connect); ");
}

}  // namespace process_group_test
}  // namespace comm
}  // namespace distoptim
