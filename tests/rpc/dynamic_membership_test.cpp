// Dynamic rpc groups (init_rpc without a world size) across real processes on loopback: a
// parameter server starts alone, trainers join one by one and call it and each other, one leaves,
// calls to it fail naming it, a new worker joins under a new name and another under the left one's
// name, and every member's get_worker_infos follows; a member killed without leaving is dropped
// from every member's list and its name taken again. Over etcd:// (a real etcd the test starts)
// rank 0 is a member like any other: it dies, the others drop it, a new process takes its name.
// The processes take turns through keys of their own in the rendezvous store (or etcd), so every
// list asserted is exact. Every wait is bounded.

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <distoptim/comm/etcd_store.h>
#include <distoptim/rpc.h>

#include "harness/etcd_server.h"
#include "harness/multiprocess.h"
#include "harness/rpc_workers.h"

namespace distoptim {
namespace rpc {
namespace dynamic_membership_test {

using namespace std::chrono_literals;
using testing::run_ranks;

DISTOPTIM_RPC_FUNCTION("dynamic_add", [](int64_t a, int64_t b) { return a + b; });
// The names of the members the callee knows, by id.
DISTOPTIM_RPC_FUNCTION("dynamic_members", [] {
  std::vector<std::string> names;
  for (const WorkerInfo& info : get_worker_infos()) names.push_back(info.name);
  return names;
});
DISTOPTIM_RPC_FUNCTION("dynamic_whoami", [] { return get_worker_info().name; });

std::vector<std::string> my_members() {
  std::vector<std::string> names;
  for (const WorkerInfo& info : get_worker_infos()) names.push_back(info.name);
  return names;
}

std::vector<std::string> members_of(const std::string& worker) {
  return rpc_sync<std::vector<std::string>>(worker, "dynamic_members");
}

// Keys of the test's own turns, in the store rank 0 serves (after it has started it).
struct Turns : testing::StoreTurns {
  explicit Turns(int rank) : StoreTurns(rank, "test/dynamic_membership") {}
};

// `call` throws an `Error` whose message contains `text`.
template <class Error, class Call>
void expect_error(Call call, const std::string& text) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one saying: " << text;
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(text), std::string::npos) << error.what();
  }
}

RpcBackendOptions options() { return testing::test_options(30s); }

TEST(DynamicMembership, TrainersJoinOneByOneLeaveAndAreReplaced) {
  run_ranks(4, [](int rank, int) {
    if (rank == 0) {
      init_rpc("ps", 0, options());
      Turns turns(0);
      EXPECT_EQ(get_worker_info(), (WorkerInfo{"ps", 0}));
      EXPECT_EQ(my_members(), (std::vector<std::string>{"ps"}));
      turns.say("ps_up");
      turns.await("trainer1_rejoined");
      // Joins and leaves as the trainers saw them.
      EXPECT_EQ(my_members(), (std::vector<std::string>{"ps", "trainer2", "trainer3", "trainer1"}));
      EXPECT_EQ(get_worker_info("trainer1").id, 4);
      turns.say("ps_checked");  // until then every trainer stays
      shutdown();               // the store host leaves last: it waits for the trainers to leave
      return;
    }
    Turns turns(rank);
    turns.await("ps_up");
    if (rank == 1) {
      init_rpc("trainer1", 1, options());
      EXPECT_EQ(rpc_sync<int64_t>("ps", "dynamic_add", std::tuple{int64_t{2}, int64_t{3}}), 5);
      EXPECT_EQ(my_members(), (std::vector<std::string>{"ps", "trainer1"}));
      EXPECT_EQ(members_of("ps"), (std::vector<std::string>{"ps", "trainer1"}));
      turns.say("trainer1_joined");
      turns.await("trainer2_joined");
      // A worker that joined after this one is known here without a call of its own.
      EXPECT_EQ(my_members(), (std::vector<std::string>{"ps", "trainer1", "trainer2"}));
      EXPECT_EQ(rpc_sync<std::string>("trainer2", "dynamic_whoami"), "trainer2");
      shutdown();  // leaves alone: nobody else is in a barrier
      turns.say("trainer1_left");
      // The name passes to a new worker once its holder has left; the rank does not.
      turns.await("trainer3_joined");
      expect_error<c10::ValueError>([] { init_rpc("trainer1", 1, options()); },
                                    "rank 1 (worker 'trainer1') is taken");
      init_rpc("trainer1", kAssignRank, options());
      EXPECT_EQ(get_worker_info().id, 4);
      EXPECT_EQ(my_members(), (std::vector<std::string>{"ps", "trainer2", "trainer3", "trainer1"}));
      EXPECT_EQ(rpc_sync<std::string>("trainer2", "dynamic_whoami"), "trainer2");
      turns.say("trainer1_rejoined");
      turns.await("trainer2_done");
      shutdown();
      return;
    }
    if (rank == 2) {
      turns.await("trainer1_joined");
      init_rpc("trainer2", 2, options());
      EXPECT_EQ(my_members(), (std::vector<std::string>{"ps", "trainer1", "trainer2"}));
      EXPECT_EQ(members_of("ps"), (std::vector<std::string>{"ps", "trainer1", "trainer2"}));
      EXPECT_EQ(members_of("trainer1"), (std::vector<std::string>{"ps", "trainer1", "trainer2"}));
      turns.say("trainer2_joined");
      turns.await("trainer1_left");
      EXPECT_EQ(my_members(), (std::vector<std::string>{"ps", "trainer2"}));
      EXPECT_EQ(members_of("ps"), (std::vector<std::string>{"ps", "trainer2"}));
      // A call to the worker that left fails at once, naming it and saying it left.
      expect_error<PeerLostError>([] { rpc_sync<std::string>("trainer1", "dynamic_whoami"); },
                                  "worker 'trainer1' (id 1) left the group");
      EXPECT_THROW(get_worker_info("trainer1"), c10::ValueError);
      turns.say("trainer2_checked");
      turns.await("trainer1_rejoined");
      // The name now resolves to the new worker.
      EXPECT_EQ(get_worker_info("trainer1").id, 4);
      EXPECT_EQ(rpc_sync<std::string>("trainer1", "dynamic_whoami"), "trainer1");
      EXPECT_EQ(my_members(), (std::vector<std::string>{"ps", "trainer2", "trainer3", "trainer1"}));
      turns.await("ps_checked");  // the trainers leave once the store host has looked too
      turns.say("trainer2_done");
      shutdown();
      return;
    }
    // rank 3: a new worker under a new name, its rank assigned.
    turns.await("trainer2_checked");
    init_rpc("trainer3", kAssignRank, options());
    EXPECT_EQ(get_worker_info().id, 3);  // 1 and 2 are taken
    EXPECT_EQ(my_members(), (std::vector<std::string>{"ps", "trainer2", "trainer3"}));
    EXPECT_EQ(members_of("trainer2"), (std::vector<std::string>{"ps", "trainer2", "trainer3"}));
    EXPECT_EQ(rpc_sync<int64_t>("ps", "dynamic_add", std::tuple{int64_t{4}, int64_t{5}}), 9);
    turns.say("trainer3_joined");
    turns.await("trainer2_done");
    shutdown();
  });
}

// Workers that start with the store host (the store is up before its host has entered the group)
// list it and can call it once init_rpc returns.
TEST(DynamicMembership, WorkersJoiningWithTheStoreHostListIt) {
  run_ranks(4, [](int rank, int) {
    if (rank == 0) {
      init_rpc("ps", 0, options());
      Turns turns(0);
      for (const char* joined : {"joined1", "joined2", "joined3"}) turns.await(joined);
      shutdown();  // leaves last, once the others have left
      return;
    }
    const std::string name = "joiner" + std::to_string(rank);
    // Ranks given by hand clear of those assigned (from 1), which could take them first.
    init_rpc(name, rank == 3 ? kAssignRank : rank + 10, options());
    const std::vector<std::string> members = my_members();
    EXPECT_EQ(members.front(), "ps");
    EXPECT_NE(std::find(members.begin(), members.end(), name), members.end());
    EXPECT_EQ(rpc_sync<std::string>("ps", "dynamic_whoami"), "ps");
    Turns(rank).say("joined" + std::to_string(rank));
    shutdown();
  });
}

TEST(DynamicMembership, BadJoinsAreRefusedNamingTheRankOrName) {
  run_ranks(2, [](int rank, int) {
    if (rank == 0) {
      init_rpc("ps", 0, options());
      Turns turns(0);
      turns.say("ps_up");
      turns.await("checked");
      EXPECT_EQ(my_members(), (std::vector<std::string>{"ps"}));
      shutdown();
      return;
    }
    Turns turns(1);
    turns.await("ps_up");
    expect_error<c10::ValueError>([] { init_rpc("ps", 5, options()); },
                                  "the worker name 'ps' is taken by rank 0");
    // Waiting for the name ends with the same refusal while its holder lives.
    expect_error<c10::ValueError>([] { init_rpc("ps", 6, options().name_wait(300ms)); },
                                  "taken by rank 0, which has not left the group (rank 6) within "
                                  "name_wait, 300 ms");
    expect_error<c10::ValueError>([] { init_rpc("w", 7, options().name_wait(-1ms)); },
                                  "name_wait of -1 ms");
    EXPECT_THROW(init_rpc("w", 40000, options()), c10::ValueError);
    EXPECT_THROW(init_rpc("w", 1, RpcBackendOptions("file:///tmp/x")), c10::ValueError);
    turns.say("checked");
  });
}

// Polls `names` (every 20 ms, at most 20 s) until it lists `expected`; returns what it listed last.
std::vector<std::string> await_members(const std::function<std::vector<std::string>()>& names,
                                       const std::vector<std::string>& expected) {
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  std::vector<std::string> seen = names();
  while (seen != expected && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
    seen = names();
  }
  return seen;
}

// The store host leaves last: its shutdown waits for the members still in the group, and past
// shutdown_timeout names them (and stops all the same). A member leaving while a call to it is
// pending answers it first: the call returns only once the store host has seen its callee leave.
std::atomic<bool> g_slow_echo_started{false};
DISTOPTIM_RPC_FUNCTION("dynamic_slow_echo", [](int64_t value) {
  g_slow_echo_started = true;
  Turns(1).await("ps_saw_leaver_go");
  return value;
});

TEST(DynamicMembership, TheStoreHostLeavesLastAndNamesWhoStayed) {
  run_ranks(3, [](int rank, int) {
    if (rank == 0) {
      init_rpc("ps", 0, options().shutdown_timeout(1500ms));
      Turns turns(0);
      turns.say("ps_up");
      turns.await("leaver_joined");
      // The leaver's call was running when it left: answered before its connections close.
      auto pending = rpc_async<int64_t>("leaver", "dynamic_slow_echo", std::tuple{int64_t{7}});
      turns.say("call_sent");
      EXPECT_EQ(await_members(my_members, {"ps", "stayer"}),
                (std::vector<std::string>{"ps", "stayer"}));
      turns.say("ps_saw_leaver_go");
      EXPECT_EQ(pending.wait(), 7);
      turns.await("leaver_left");
      EXPECT_EQ(my_members(), (std::vector<std::string>{"ps", "stayer"}));
      expect_error<TimeoutError>(
          [] { shutdown(); },
          "leaves last, but after 1500 ms these workers had not left: 'stayer' (rank 2)");
      turns.say("ps_left");
      turns.await("stayer_saw_ps_left");  // the test's store lives in this process
      return;
    }
    Turns turns(rank);
    turns.await("ps_up");
    if (rank == 1) {
      turns.await("stayer_joined");
      init_rpc("leaver", 1, options());
      turns.say("leaver_joined");
      turns.await("call_sent");
      // The call is running here; leaving does not cut it short.
      for (int i = 0; i < 1000 && !g_slow_echo_started; ++i) std::this_thread::sleep_for(5ms);
      ASSERT_TRUE(g_slow_echo_started);
      shutdown();
      turns.say("leaver_left");
      return;
    }
    init_rpc("stayer", 2, options());
    turns.say("stayer_joined");
    turns.await("ps_left");
    turns.say("stayer_saw_ps_left");
    // Calls to the store host that left fail; leaving without its store still works.
    EXPECT_THROW(rpc_sync<int64_t>("ps", "dynamic_add", std::tuple{int64_t{1}, int64_t{1}}),
                 PeerLostError);
    shutdown();
  });
}

// Without a shutdown_timeout the store host waits for the members as long as they are alive: one
// that is stopped (SIGSTOP) stops answering its liveness checks and is not waited for.
DISTOPTIM_RPC_FUNCTION("dynamic_pid", [] { return static_cast<int64_t>(::getpid()); });

TEST(DynamicMembership, TheStoreHostDoesNotWaitForAStoppedMember) {
  run_ranks(2, [](int rank, int) {
    if (rank == 0) {
      init_rpc("ps", 0, options().shutdown_timeout(0ms).liveness_timeout(1s));
      Turns turns(0);
      turns.say("ps_up");
      turns.await("stuck_joined");
      const auto pid = static_cast<pid_t>(rpc_sync<int64_t>("stuck", "dynamic_pid"));
      ASSERT_TRUE(testing::stop_process(pid));
      EXPECT_NO_THROW(shutdown());
      ASSERT_EQ(::kill(pid, SIGCONT), 0);
      turns.say("ps_left");
      turns.await("stuck_done");  // the test's store lives in this process
      return;
    }
    Turns turns(1);
    turns.await("ps_up");
    init_rpc("stuck", 1, options());
    turns.say("stuck_joined");
    turns.await("ps_left");
    shutdown();
    turns.say("stuck_done");
  });
}

// A member that dies without leaving (SIGKILL) is dropped: the store host sees its connections
// end, finds it fails a liveness check, marks it left in the store and tells every member. Calls
// to it then fail at once, naming it; its name passes to a new worker, its rank does not.
TEST(DynamicMembership, AKilledMemberIsDroppedAndItsNameTaken) {
  testing::RunRanksOptions run;
  run.expected_signals = {{1, SIGKILL}};
  run_ranks(
      3,
      [](int rank, int) {
        if (rank == 0) {
          init_rpc("ps", 0, options().liveness_timeout(2s));
          Turns turns(0);
          turns.say("ps_up");
          turns.await("other_called_victim");
          EXPECT_EQ(rpc_sync<std::string>("victim", "dynamic_whoami"), "victim");
          turns.say("ps_called_victim");
          EXPECT_EQ(await_members(my_members, {"ps", "other"}),
                    (std::vector<std::string>{"ps", "other"}));
          turns.say("ps_saw_the_drop");  // until then "other" stays, under its name
          turns.await("replacement_joined");
          EXPECT_EQ(my_members(), (std::vector<std::string>{"ps", "victim"}));
          EXPECT_EQ(get_worker_info("victim").id, 3);
          EXPECT_EQ(rpc_sync<std::string>("victim", "dynamic_whoami"), "victim");
          turns.say("ps_checked");
          shutdown();  // waits for the member alive, not for the dead one
          return;
        }
        Turns turns(rank);
        turns.await("ps_up");
        if (rank == 1) {
          turns.await("other_joined");
          init_rpc("victim", 1, options());
          turns.say("victim_joined");
          turns.await("ps_called_victim");
          ::kill(::getpid(), SIGKILL);
          return;
        }
        init_rpc("other", 2, options());
        turns.say("other_joined");
        turns.await("victim_joined");
        EXPECT_EQ(rpc_sync<std::string>("victim", "dynamic_whoami"), "victim");
        turns.say("other_called_victim");
        EXPECT_EQ(await_members(my_members, {"ps", "other"}),
                  (std::vector<std::string>{"ps", "other"}));
        expect_error<PeerLostError>([] { rpc_sync<std::string>("victim", "dynamic_whoami"); },
                                    "worker 'victim' (id 1) left the group");
        EXPECT_THROW(get_worker_info("victim"), c10::ValueError);
        turns.await("ps_saw_the_drop");
        shutdown();
        // This process takes the dead worker's name, under a new rank.
        expect_error<c10::ValueError>([] { init_rpc("victim", 1, options()); },
                                      "rank 1 (worker 'victim') is taken");
        init_rpc("victim", kAssignRank, options());
        EXPECT_EQ(get_worker_info().id, 3);
        EXPECT_EQ(my_members(), (std::vector<std::string>{"ps", "victim"}));
        EXPECT_EQ(rpc_sync<int64_t>("ps", "dynamic_add", std::tuple{int64_t{2}, int64_t{3}}), 5);
        turns.say("replacement_joined");
        turns.await("ps_checked");
        shutdown();
      },
      run);
}

// With a shared secret, what the workers write to the group's store is sealed with it: a process
// that reaches the store without the secret forges a left mark for a live member, the store host's
// "closing" flag and a claim of a name. A worker joining afterwards ignores the forged marks (it
// joins, lists the member and calls it) and refuses the forged name, naming the key.
TEST(DynamicMembership, ForgedStoreRecordsAreNotTaken) {
  run_ranks(4, [](int rank, int) {
    const RpcBackendOptions sealed = options().shared_secret("the-secret");
    Turns turns(rank);
    if (rank == 0) {
      init_rpc("ps", 0, sealed);
      turns.say("ps_up");
      turns.await("checked");
      shutdown();
      return;
    }
    turns.await("ps_up");
    if (rank == 1) {
      init_rpc("victim", 1, sealed);
      turns.say("victim_joined");
      turns.await("checked");
      shutdown();
      return;
    }
    if (rank == 2) {
      turns.await("victim_joined");
      // The outsider: the store, without the secret.
      auto store = comm::open_store(comm::RendezvousOptions("env://")
                                        .rank(2)
                                        .prefix("distoptim/rpc/rendezvous")
                                        .timeout(30s))
                       .store;
      const std::vector<uint8_t> one{'1'};
      store->set("distoptim/rpc/dynamic/left/1", one);
      store->set("distoptim/rpc/dynamic/closing", one);
      const std::string rank9 = "9";
      store->set("distoptim/rpc/dynamic/name/late2", {rank9.begin(), rank9.end()});
      turns.say("forged");
      init_rpc("late", kAssignRank, sealed);
      EXPECT_EQ(my_members(), (std::vector<std::string>{"ps", "victim", "late"}));
      EXPECT_EQ(rpc_sync<std::string>("victim", "dynamic_whoami"), "victim");
      turns.say("late_joined");
      turns.await("checked");
      shutdown();
      return;
    }
    turns.await("forged");
    turns.await("late_joined");
    expect_error<DistributedError>(
        [&] { init_rpc("late2", kAssignRank, sealed); },
        "the group's store holds 'distoptim/rpc/dynamic/name/late2' not sealed with the job's "
        "shared secret: a process that does not know the secret wrote it");
    turns.say("checked");
  });
}

// A member whose user code is busy (its main thread sleeps, a request of it runs longer than
// liveness_timeout) is not dropped while a member that dies is.
DISTOPTIM_RPC_FUNCTION("dynamic_busy", [](int64_t value) {
  std::this_thread::sleep_for(2500ms);
  return value;
});

TEST(DynamicMembership, ABusyMemberIsNotDroppedWhileADeadOneIs) {
  testing::RunRanksOptions run;
  run.expected_signals = {{2, SIGKILL}};
  run_ranks(
      3,
      [](int rank, int) {
        if (rank == 0) {
          // 1 s: a loaded machine may keep a live member's answer from coming within less.
          init_rpc("ps", 0, options().liveness_timeout(1000ms));
          Turns turns(0);
          turns.say("ps_up");
          turns.await("victim_joined");
          auto busy = rpc_async<int64_t>("busy", "dynamic_busy", std::tuple{int64_t{7}});
          EXPECT_EQ(rpc_sync<std::string>("victim", "dynamic_whoami"), "victim");
          turns.say("ps_called");
          EXPECT_EQ(await_members(my_members, {"ps", "busy"}),
                    (std::vector<std::string>{"ps", "busy"}));
          EXPECT_EQ(busy.wait(), 7);
          EXPECT_EQ(my_members(), (std::vector<std::string>{"ps", "busy"}));
          turns.say("checked");
          shutdown();
          return;
        }
        Turns turns(rank);
        turns.await("ps_up");
        if (rank == 1) {
          init_rpc("busy", 1, options());
          turns.say("busy_joined");
          // Busy in its own code for longer than the others take to drop the dead member.
          std::this_thread::sleep_for(4s);
          turns.await("checked");
          EXPECT_EQ(members_of("ps"), (std::vector<std::string>{"ps", "busy"}));
          shutdown();
          return;
        }
        turns.await("busy_joined");
        init_rpc("victim", 2, options());
        turns.say("victim_joined");
        turns.await("ps_called");
        ::kill(::getpid(), SIGKILL);
      },
      run);
}

// Over etcd:// no member serves the store, so none is special: the parent process runs a real
// etcd and tells the ranks where through the environment (they may be started afresh, see
// run_ranks). Rank 0 is one member among others: a worker joins before it, it is killed, every
// member drops it, a new process takes its name, and the members leave in any order.
constexpr const char* kEtcdVariable = "DISTOPTIM_TEST_ETCD_ENDPOINT";

// The job in etcd of this run of a test: MASTER_PORT, the same for every rank of a run, makes it
// fresh per run.
std::string etcd_job(const std::string& what) {
  return what + "-" + std::string(std::getenv("MASTER_PORT"));
}

// An RRef a worker keeps, and the value of one sent to a worker.
RRef<int64_t>& kept_rref() {
  static auto* kept = new RRef<int64_t>();
  return *kept;
}
DISTOPTIM_RPC_FUNCTION("dynamic_keep_rref", [](RRef<int64_t> rref) {
  kept_rref() = std::move(rref);
  return kept_rref().to_here();
});
DISTOPTIM_RPC_FUNCTION("dynamic_rref_value", [](RRef<int64_t> rref) { return rref.to_here(); });

// The test's own turns, in etcd under a job of their own.
struct EtcdTurns {
  EtcdTurns()
      : store(c10::make_intrusive<comm::EtcdStore>(
            comm::EtcdStoreOptions(std::getenv(kEtcdVariable), etcd_job("turns")).timeout(30s))) {}
  void say(const std::string& key) { store->set(key, std::vector<uint8_t>{1}); }
  void await(const std::string& key) { store->wait({key}, 30s); }
  c10::intrusive_ptr<comm::EtcdStore> store;
};

RpcBackendOptions etcd_options() {
  return RpcBackendOptions(c10::str("etcd://", std::getenv(kEtcdVariable), "/", etcd_job("rpc")))
      .init_timeout(30s)
      .shutdown_timeout(30s)
      .rpc_timeout(30s)
      .liveness_timeout(2s);
}

TEST(DynamicMembershipOverEtcd, RankZeroIsNotSpecialItDiesAndIsReplacedAndAnyoneLeavesFirst) {
  std::unique_ptr<testing::EtcdServer> etcd;
  if (!testing::in_rank_process()) {
    etcd = std::make_unique<testing::EtcdServer>();
    ::setenv(kEtcdVariable, etcd->endpoint().c_str(), 1);
  }
  testing::RunRanksOptions run;
  run.expected_signals = {{0, SIGKILL}};
  run_ranks(
      4,
      [](int rank, int) {
        EtcdTurns turns;
        if (rank == 0) {
          // Joins after "a": nobody waited for rank 0 to start the group.
          turns.await("a_up");
          init_rpc("ps", 0, etcd_options());
          turns.say("ps_up");
          // A value on "b", whose reference (created here) "a" keeps past this worker's death.
          turns.await("b_up");
          auto on_b = remote<int64_t>("b", "dynamic_add", std::tuple{int64_t{2}, int64_t{3}});
          EXPECT_EQ(rpc_sync<int64_t>("a", "dynamic_keep_rref", std::tuple{on_b}), 5);
          turns.await("forged");
          ::kill(::getpid(), SIGKILL);
          return;
        }
        if (rank == 1) {
          init_rpc("a", kAssignRank, etcd_options());
          EXPECT_EQ(get_worker_info().id, 1);
          turns.say("a_up");
          turns.await("b_up");
          EXPECT_EQ(my_members(), (std::vector<std::string>{"ps", "a", "b"}));
          // Any member drops a dead one, so each hears of drops from any member: but only of
          // one the store says left. A forged notice that live "b" was dropped is refused.
          expect_error<c10::Error>(
              [] {
                rpc_sync<bool>("ps", "__distoptim.rpc.member_dropped", std::tuple{int64_t{2}});
              },
              "sent a notice that worker id 2 was dropped, but the store does not say it left");
          EXPECT_EQ(members_of("ps"), (std::vector<std::string>{"ps", "a", "b"}));
          turns.say("forged");
          EXPECT_EQ(await_members(my_members, {"a", "b"}), (std::vector<std::string>{"a", "b"}));
          expect_error<PeerLostError>([] { rpc_sync<std::string>("ps", "dynamic_whoami"); },
                                      "worker 'ps' (id 0) left the group");
          turns.say("a_saw_the_drop");
          turns.await("ps_back");
          EXPECT_EQ(get_worker_info("ps").id, 3);
          EXPECT_EQ(rpc_sync<std::string>("ps", "dynamic_whoami"), "ps");
          EXPECT_EQ(members_of("ps"), (std::vector<std::string>{"a", "b", "ps"}));
          // The reference the dead "ps" created passes on to a worker that joined after it died.
          EXPECT_EQ(rpc_sync<int64_t>("ps", "dynamic_rref_value", std::tuple{kept_rref()}), 5);
          kept_rref() = RRef<int64_t>();
          // The first to leave, and no member waits for the others.
          shutdown();
          turns.say("a_left");
          return;
        }
        if (rank == 2) {
          turns.await("ps_up");
          init_rpc("b", kAssignRank, etcd_options());
          EXPECT_EQ(get_worker_info().id, 2);
          turns.say("b_up");
          EXPECT_EQ(await_members(my_members, {"a", "b"}), (std::vector<std::string>{"a", "b"}));
          turns.say("b_saw_the_drop");
          turns.await("a_left");
          EXPECT_EQ(await_members(my_members, {"b", "ps"}), (std::vector<std::string>{"b", "ps"}));
          shutdown();
          turns.say("b_left");
          return;
        }
        turns.await("a_saw_the_drop");
        turns.await("b_saw_the_drop");
        // Ranks are still used once per group; the name passes on, as over tcp://.
        expect_error<c10::ValueError>([] { init_rpc("ps", 0, etcd_options()); },
                                      "rank 0 (worker 'ps') is taken");
        init_rpc("ps", kAssignRank, etcd_options());
        EXPECT_EQ(get_worker_info().id, 3);
        EXPECT_EQ(my_members(), (std::vector<std::string>{"a", "b", "ps"}));
        EXPECT_EQ(rpc_sync<int64_t>("b", "dynamic_add", std::tuple{int64_t{2}, int64_t{3}}), 5);
        turns.say("ps_back");
        turns.await("b_left");
        EXPECT_EQ(my_members(), (std::vector<std::string>{"ps"}));
        shutdown();
      },
      run);
  if (!testing::in_rank_process()) ::unsetenv(kEtcdVariable);
}

}  // namespace dynamic_membership_test
}  // namespace rpc
}  // namespace distoptim
