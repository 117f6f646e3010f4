// Rendezvous: the env://, tcp:// and file:// forms, the launcher variables, and every way a
// rendezvous can fail (missing rank, rank claimed twice, disagreeing world sizes, no store).

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <distoptim/comm.h>

#include "harness/etcd_server.h"
#include "harness/multiprocess.h"
#include "host_port.h"
#include "support/scoped_env.h"
#include "support/test_util.h"

namespace distoptim {
namespace comm {
namespace rendezvous_test {

using distoptim::testing::expect_error_containing;
using distoptim::testing::run_ranks;
using distoptim::testing::ScopedEnv;
using namespace std::chrono_literals;

constexpr std::initializer_list<std::pair<const char*, const char*>> kNoLauncher = {
    {"RANK", nullptr},
    {"WORLD_SIZE", nullptr},
    {"LOCAL_RANK", nullptr},
    {"LOCAL_WORLD_SIZE", nullptr},
    {"OMPI_COMM_WORLD_RANK", nullptr},
    {"SLURM_PROCID", nullptr},
    {"MASTER_ADDR", nullptr},
    {"MASTER_PORT", nullptr}};

std::string port_text() { return std::getenv("MASTER_PORT"); }

TEST(LaunchEnv, TorchrunVariables) {
  ScopedEnv clean(kNoLauncher);
  ScopedEnv env({{"RANK", "5"},
                 {"WORLD_SIZE", "8"},
                 {"LOCAL_RANK", "1"},
                 {"LOCAL_WORLD_SIZE", "4"},
                 {"MASTER_ADDR", "10.1.2.3"},
                 {"MASTER_PORT", "29400"}});
  const LaunchEnv launch = LaunchEnv::from_environment();
  EXPECT_EQ(launch.rank, 5);
  EXPECT_EQ(launch.world_size, 8);
  EXPECT_EQ(launch.local_rank, 1);
  EXPECT_EQ(launch.local_world_size, 4);
  EXPECT_EQ(launch.master_addr, "10.1.2.3");
  EXPECT_EQ(launch.master_port, 29400);
}

TEST(LaunchEnv, OpenMpiAndSlurmVariables) {
  ScopedEnv clean(kNoLauncher);
  {
    ScopedEnv env({{"OMPI_COMM_WORLD_RANK", "2"},
                   {"OMPI_COMM_WORLD_SIZE", "6"},
                   {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}});
    const LaunchEnv launch = LaunchEnv::from_environment();
    EXPECT_EQ(launch.rank, 2);
    EXPECT_EQ(launch.world_size, 6);
    EXPECT_EQ(launch.local_rank, 0);
    EXPECT_EQ(launch.local_world_size, 3);
  }
  {
    ScopedEnv env({{"SLURM_PROCID", "7"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "3"}});
    const LaunchEnv launch = LaunchEnv::from_environment();
    EXPECT_EQ(launch.rank, 7);
    EXPECT_EQ(launch.world_size, 16);
    EXPECT_EQ(launch.local_rank, 3);
  }
}

TEST(LaunchEnv, BadValueNamesTheVariable) {
  ScopedEnv clean(kNoLauncher);
  ScopedEnv env({{"RANK", "two"}});
  expect_error_containing([] { LaunchEnv::from_environment(); }, {"RANK", "'two'"});
  ScopedEnv port({{"RANK", "0"}, {"MASTER_PORT", "70000"}});
  expect_error_containing([] { LaunchEnv::from_environment(); }, {"MASTER_PORT", "'70000'"});
}

TEST(RendezvousBadInput, NamesTheArgument) {
  ScopedEnv clean(kNoLauncher);
  expect_error_containing(
      [] { rendezvous(RendezvousOptions("udp://host:1").rank(0).world_size(1)); },
      {"init_method 'udp://host:1'"});
  expect_error_containing(
      [] { rendezvous(RendezvousOptions("tcp://127.0.0.1:99999").rank(0).world_size(1)); },
      {"port '99999'"});
  expect_error_containing(
      [] { rendezvous(RendezvousOptions("tcp://127.0.0.1:1234").rank(5).world_size(2)); },
      {"rank = 5", "[0, 2)"});
  expect_error_containing([] { rendezvous(RendezvousOptions("env://")); },
                          {"world_size = -1", "WORLD_SIZE is unset"});
  // A rank from the environment that is out of range is not called unset.
  LaunchEnv launched;
  launched.rank = 2;
  launched.world_size = 2;
  expect_error_containing([&] { rendezvous(RendezvousOptions("env://").launch_env(launched)); },
                          {"rank = 2 (from the launcher's environment); must be in [0, 2)"});
  expect_error_containing([] { rendezvous(RendezvousOptions("env://").rank(0).world_size(1)); },
                          {"MASTER_ADDR is unset"});
  expect_error_containing(
      [] {
        rendezvous(RendezvousOptions("tcp://127.0.0.1:1234").rank(0).world_size(1).timeout(0ms));
      },
      {"timeout = 0 ms"});
  for (const std::string method : {"etcd://127.0.0.1:2379", "etcd://127.0.0.1:2379/"}) {
    expect_error_containing([&] { rendezvous(RendezvousOptions(method).rank(0).world_size(1)); },
                            {"init_method '" + method + "' names no job"});
  }
  expect_error_containing(
      [] { rendezvous(RendezvousOptions("etcd://127.0.0.1:0/job").rank(0).world_size(1)); },
      {"init_method 'etcd://127.0.0.1:0/job'", "port '0'"});
  expect_error_containing(
      [] { rendezvous(RendezvousOptions("etcd://127.0.0.1/job").rank(0).world_size(1)); },
      {"init_method 'etcd://127.0.0.1/job' is not etcd://HOST:PORT/JOB"});
  expect_error_containing(
      [] { open_store(RendezvousOptions("etcd://127.0.0.1:2379/a/b").rank(0)); },
      {"init_method 'etcd://127.0.0.1:2379/a/b'", "job 'a/b'"});
}

TEST(RendezvousFailure, UnreachableStoreTimesOut) {
  const int port = distoptim::testing::free_port();
  const std::string method = "tcp://127.0.0.1:" + std::to_string(port);
  try {
    rendezvous(RendezvousOptions(method).rank(1).world_size(2).timeout(1s));
    ADD_FAILURE() << "expected a TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 could not reach rank 0's store at 127.0.0.1:" +
                                         std::to_string(port)),
              std::string::npos)
        << e.what();
  }
}

// A rank that starts before rank 0's store listens waits for it without LibTorch's whole second
// per refusal: wait_until_listening sees a listener that comes late, and gives up at its deadline
// when none comes.
TEST(RendezvousFailure, WaitsForALateStoreUntilItListensOrTheDeadline) {
  const int port = distoptim::testing::free_port();
  const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  const int on = 1;
  ::setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  // Listening only after the waiter's first refusals (whenever this thread runs, the wait ends
  // once it listens).
  std::thread late([listener] {
    std::this_thread::sleep_for(200ms);
    ::listen(listener, 4);
  });
  EXPECT_TRUE(
      detail::wait_until_listening("127.0.0.1", port, std::chrono::steady_clock::now() + 60s));
  late.join();
  ::close(listener);
  EXPECT_FALSE(
      detail::wait_until_listening("127.0.0.1", port, std::chrono::steady_clock::now() + 100ms));
}

void expect_meets_everyone(const Rendezvous& r, int rank, int world_size) {
  EXPECT_EQ(r.rank, rank);
  EXPECT_EQ(r.world_size, world_size);
  ASSERT_EQ(r.hosts.size(), static_cast<size_t>(world_size));
  for (const auto& host : r.hosts) EXPECT_EQ(host, r.hosts[0]);
  // One host: local positions are global ones.
  EXPECT_EQ(r.local_rank, rank);
  EXPECT_EQ(r.local_world_size, world_size);
  // The store is shared: every rank sees what every other rank wrote.
  r.store->set("hello/" + std::to_string(rank), {static_cast<uint8_t>(rank)});
  for (int other = 0; other < world_size; ++other) {
    r.store->wait({"hello/" + std::to_string(other)}, 20s);
    EXPECT_EQ(r.store->get("hello/" + std::to_string(other)),
              std::vector<uint8_t>{static_cast<uint8_t>(other)});
  }
}

// Rank 0 serves the TCP store, so it leaves last.
void leave(const Rendezvous& r) {
  r.store->add("left", 1);
  if (r.rank != 0) return;
  while (r.store->add("left", 0) < r.world_size) std::this_thread::sleep_for(1ms);
}

TEST(Rendezvous, EnvMethodThreeRanks) {
  run_ranks(3, [](int rank, int world_size) {
    const Rendezvous r = rendezvous(RendezvousOptions("env://").timeout(20s));
    expect_meets_everyone(r, rank, world_size);
    EXPECT_EQ(r.master_addr, "127.0.0.1");
    EXPECT_EQ(r.local_address, "127.0.0.1");
    leave(r);
  });
}

// The ranks meet in a real etcd that none of them hosts; the parent process runs it, and tells
// the ranks where through the environment (they may be started afresh, see run_ranks).
constexpr const char* kEtcdVariable = "DISTOPTIM_TEST_ETCD_ENDPOINT";

TEST(Rendezvous, EtcdMethodThreeRanks) {
  std::unique_ptr<testing::EtcdServer> etcd;
  if (!testing::in_rank_process()) {
    etcd = std::make_unique<testing::EtcdServer>();
    ::setenv(kEtcdVariable, etcd->endpoint().c_str(), 1);
  }
  run_ranks(3, [](int rank, int world_size) {
    // MASTER_PORT, the same for every rank of this run, makes the job fresh per run.
    const std::string method =
        c10::str("etcd://", std::getenv(kEtcdVariable), "/rdzv-", port_text());
    const Rendezvous r =
        rendezvous(RendezvousOptions(method).rank(rank).world_size(world_size).timeout(30s));
    expect_meets_everyone(r, rank, world_size);
    EXPECT_EQ(r.master_addr, "");
    EXPECT_EQ(r.local_address, "127.0.0.1");
    EXPECT_NE(r.store->address().find(std::getenv(kEtcdVariable)), std::string::npos);
    leave(r);
  });
  // A group of unknown size over the same etcd: each rank opens the store; none serves it.
  run_ranks(2, [](int rank, int) {
    const std::string method =
        c10::str("etcd://", std::getenv(kEtcdVariable), "/open-", port_text());
    const Rendezvous r = open_store(RendezvousOptions(method).rank(rank).timeout(30s));
    EXPECT_EQ(r.world_size, 0);
    r.store->set("member/" + std::to_string(rank), {1});
    r.store->wait({"member/0", "member/1"}, 30s);
    EXPECT_EQ(r.store->add("count", 1) >= 1, true);
  });
  if (!testing::in_rank_process()) ::unsetenv(kEtcdVariable);
}

TEST(RendezvousFailure, UnreachableEtcdTimesOutNamingIt) {
  const std::string endpoint = "127.0.0.1:" + std::to_string(distoptim::testing::free_port());
  try {
    rendezvous(RendezvousOptions("etcd://" + endpoint + "/job").rank(1).world_size(2).timeout(1s));
    ADD_FAILURE() << "expected a TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 could not reach etcd at " + endpoint),
              std::string::npos)
        << e.what();
  }
}

TEST(Rendezvous, TcpMethodTwoRanks) {
  run_ranks(2, [](int rank, int world_size) {
    const Rendezvous r = rendezvous(RendezvousOptions("tcp://127.0.0.1:" + port_text())
                                        .rank(rank)
                                        .world_size(world_size)
                                        .timeout(20s));
    expect_meets_everyone(r, rank, world_size);
    leave(r);
  });
}

TEST(Rendezvous, FileMethodThreeRanks) {
  run_ranks(3, [](int rank, int world_size) {
    const std::string path = "/tmp/distoptim-file-rendezvous-" + port_text();
    const Rendezvous r = rendezvous(
        RendezvousOptions("file://" + path).rank(rank).world_size(world_size).timeout(20s));
    expect_meets_everyone(r, rank, world_size);
    EXPECT_EQ(r.master_addr, "");
    EXPECT_EQ(r.local_address, "127.0.0.1");
  });
}

// Met on an address of a network interface, a rank listens on the address its host reaches it
// from: that address itself (on a multi-host job, this host's address on that network).
TEST(Rendezvous, LocalAddressIsWhereThisHostReachesTheStoreFrom) {
  std::string interface_address;
  ifaddrs* interfaces = nullptr;
  ASSERT_EQ(::getifaddrs(&interfaces), 0);
  for (const ifaddrs* i = interfaces; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr, text,
                sizeof text);
    if (!is_loopback_address(text) && (i->ifa_flags & IFF_UP) != 0) {
      interface_address = text;
      break;
    }
  }
  ::freeifaddrs(interfaces);
  if (interface_address.empty()) GTEST_SKIP() << "this machine has no IPv4 address but loopback";
  run_ranks(1, [&](int, int) {
    const Rendezvous r = rendezvous(
        RendezvousOptions("tcp://" + interface_address + ":" + port_text()).rank(0).world_size(1));
    EXPECT_EQ(r.master_addr, interface_address);
    EXPECT_EQ(r.local_address, interface_address);
  });
}

TEST(RendezvousFailure, MissingRankIsNamed) {
  run_ranks(3, [](int rank, int) {
    if (rank == 2) return;  // never arrives
    try {
      // Long enough for rank 0's store to come up before rank 1 gives up on reaching it, even
      // under a sanitizer on a loaded machine: the timeout this test wants is the missing rank's.
      rendezvous(RendezvousOptions("env://").timeout(6s));
      ADD_FAILURE() << "rank " << rank << ": expected a TimeoutError";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("never arrived: rank 2"), std::string::npos) << e.what();
    }
  });
}

TEST(RendezvousFailure, DisagreeingWorldSizeIsNamed) {
  run_ranks(2, [](int rank, int) {
    // Rank 1 believes in a world of 3. Rank 0 sees the disagreement and says so to rank 1, which
    // would otherwise wait in vain for a rank 2.
    try {
      rendezvous(RendezvousOptions("env://").world_size(rank == 1 ? 3 : 2).timeout(5s));
      ADD_FAILURE() << "rank " << rank << ": expected an error";
    } catch (const DistributedError& e) {
      EXPECT_EQ(rank, 1) << e.what();
      EXPECT_NE(std::string(e.what()).find("rendezvous failed at rank 0 (seen by rank 1)"),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("rank 1 has world_size 3, rank 0 has 2"),
                std::string::npos)
          << e.what();
    } catch (const c10::ValueError& e) {
      EXPECT_EQ(rank, 0) << e.what();
      EXPECT_NE(std::string(e.what()).find("rank 1 has world_size 3, rank 0 has 2"),
                std::string::npos)
          << e.what();
    }
  });
}

TEST(RendezvousFailure, RankClaimedTwice) {
  run_ranks(3, [](int rank, int) {
    // The process started as rank 2 claims rank 1 as well: whichever of the two claims second is
    // told so, the other waits in vain for rank 2, as does rank 0.
    try {
      rendezvous(RendezvousOptions("env://").rank(rank == 2 ? 1 : rank).timeout(6s));
      ADD_FAILURE() << "rank " << rank << ": expected an error";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("never arrived: rank 2"), std::string::npos) << e.what();
    } catch (const c10::ValueError& e) {
      EXPECT_NE(rank, 0) << e.what();
      EXPECT_NE(std::string(e.what()).find("rank 1 is claimed by more than one process"),
                std::string::npos)
          << e.what();
    }
  });
}

}  // namespace rendezvous_test
}  // namespace comm
}  // namespace distoptim
