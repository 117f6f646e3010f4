// share_host_memory: allreduce, reduce and broadcast through shared memory between real
// processes on this host, checked bit for bit, and the ways a member's absence or death is
// reported.

#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <distoptim/comm.h>

#include "harness/absent_rank.h"
#include "harness/multiprocess.h"
#include "support/test_util.h"

namespace distoptim {
namespace comm {
namespace host_memory_group_test {

using distoptim::testing::run_ranks;
using namespace std::chrono_literals;

// One page per slot: a tensor of a few KB already goes through in several pieces.
constexpr size_t kSmallSlot = 4096;

// The shared-memory segments this process has mapped, as /proc/self/maps names them: a segment
// whose name was removed reads "/dev/shm/distoptim-... (deleted)". Other processes' segments
// (a concurrent test's, or one left by a killed run) are not in this process's maps.
std::set<std::string> mapped_segments() {
  std::set<std::string> names;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const size_t at = line.find("/dev/shm/distoptim-");
    if (at != std::string::npos) names.insert(line.substr(at));
  }
  return names;
}

// Rank r's values in the tests: different on every rank, reproducible on all.
at::Tensor values_of(int rank, int64_t n, at::ScalarType type) {
  torch::manual_seed(1000 + rank);
  at::Tensor values = torch::randn({n}, torch::kDouble) * 100;
  return values.to(type);
}

// The sum the shared memory must give: the members' values added in rank order.
at::Tensor rank_order_sum(int world_size, int64_t n, at::ScalarType type) {
  at::Tensor sum = values_of(0, n, type) + values_of(1, n, type);
  for (int r = 2; r < world_size; ++r) sum.add_(values_of(r, n, type));
  return sum;
}

// `timeout`: this collective's own (c10d's per-call option); unset, the group's.
void allreduce(const Group& group, at::Tensor tensor, c10d::ReduceOp op = c10d::ReduceOp::SUM,
               std::chrono::milliseconds timeout = c10d::kUnsetTimeout) {
  std::vector<at::Tensor> tensors = {std::move(tensor)};
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  options.timeout = timeout;
  group.process_group()->allreduce(tensors, options)->wait();
}

TEST(HostMemoryGroup, CollectivesGiveEveryMemberTheSameBits) {
  run_ranks(3, [](int rank, int world_size) {
    init_process_group(ProcessGroupOptions("env://").timeout(30s));
    const Group shared = share_host_memory(world(), kSmallSlot);
    EXPECT_NE(shared.process_group().get(), world().process_group().get())
        << "every rank runs on this host: the group should share memory";
    EXPECT_EQ(shared.ranks(), world().ranks());
    // Made once per group: later calls, on it or a copy (DDP's and ZeRO's on the same group),
    // return the same at once, with no collective.
    EXPECT_EQ(share_host_memory(world()).process_group().get(), shared.process_group().get());
    EXPECT_EQ(share_host_memory(shared).process_group().get(), shared.process_group().get());
    // The segments' names are gone once the group is open (the other ranks' too: they remove
    // theirs before the group returns).
    world().barrier();
    const std::set<std::string> mapped = mapped_segments();
    EXPECT_EQ(mapped.size(), static_cast<size_t>(world_size));
    for (const std::string& name : mapped) {
      EXPECT_NE(name.find(" (deleted)"), std::string::npos) << name;
    }

    // Sizes around the pieces and shares: empty, smaller than a share, one element over a
    // piece, many pieces; and the dtypes it sums itself.
    for (const at::ScalarType type : {at::kFloat, at::kDouble, at::kBFloat16, at::kLong}) {
      for (const int64_t n : {0, 5, 1025, 20000}) {
        SCOPED_TRACE(std::string(c10::toString(type)) + " x " + std::to_string(n));
        at::Tensor mine = values_of(rank, n, type);
        allreduce(shared, mine);
        EXPECT_TRUE(at::equal(mine, rank_order_sum(world_size, n, type)));
      }
    }
    // A strided tensor is summed in place all the same.
    at::Tensor matrix = values_of(rank, 3000, at::kFloat).view({60, 50});
    at::Tensor columns = matrix.t();
    allreduce(shared, columns);
    EXPECT_TRUE(at::equal(matrix, rank_order_sum(world_size, 3000, at::kFloat).view({60, 50})));

    // What it leaves to Gloo: another reduction, Half.
    at::Tensor highest = torch::full({4}, static_cast<float>(rank));
    allreduce(shared, highest, c10d::ReduceOp::MAX);
    EXPECT_TRUE(at::equal(highest, torch::full({4}, static_cast<float>(world_size - 1))));
    at::Tensor half = torch::full({7}, 1.0, torch::kHalf);
    allreduce(shared, half);
    EXPECT_TRUE(at::equal(half, torch::full({7}, static_cast<double>(world_size), torch::kHalf)));

    // Reduces to every root, over several pieces: the root ends with the allreduce's bits, the
    // others with their own values; Half still goes to Gloo.
    for (int root = 0; root < world_size; ++root) {
      for (const at::ScalarType type : {at::kFloat, at::kDouble, at::kHalf}) {
        SCOPED_TRACE("reduce to " + std::to_string(root) + ", " + c10::toString(type));
        at::Tensor mine = values_of(rank, 2500, type);
        std::vector<at::Tensor> tensors = {mine};
        c10d::ReduceOptions options;
        options.rootRank = root;
        shared.process_group()->reduce(tensors, options)->wait();
        if (type == at::kHalf) {
          if (rank == root) {
            EXPECT_TRUE(at::allclose(mine, rank_order_sum(world_size, 2500, type), 1e-2, 1.0));
          }
        } else {
          EXPECT_TRUE(at::equal(mine, rank == root ? rank_order_sum(world_size, 2500, type)
                                                   : values_of(rank, 2500, type)));
        }
      }
    }
    {
      std::vector<at::Tensor> tensors = {torch::ones({3})};
      c10d::ReduceOptions options;
      options.rootRank = world_size;
      const std::string expected = "reduce: rootRank = " + std::to_string(world_size) +
                                   " is not in [0, " + std::to_string(world_size) + ")";
      // Refused before anything is queued: the broadcasts below still pair up.
      EXPECT_THROW(shared.process_group()->reduce(tensors, options), c10::ValueError);
      distoptim::testing::expect_error_containing(
          [&] { shared.process_group()->reduce(tensors, options); }, {expected, "group rank of"});
    }

    // Broadcasts from every root, of any dtype, over several pieces.
    for (int root = 0; root < world_size; ++root) {
      for (const at::ScalarType type : {at::kFloat, at::kBool, at::kHalf}) {
        at::Tensor mine = values_of(rank, 2500, at::kDouble).gt(0).to(type);
        std::vector<at::Tensor> tensors = {mine};
        c10d::BroadcastOptions options;
        options.rootRank = root;
        shared.process_group()->broadcast(tensors, options)->wait();
        EXPECT_TRUE(at::equal(mine, values_of(root, 2500, at::kDouble).gt(0).to(type)));
      }
    }

    // Futures hold the tensors, as Gloo's do.
    std::vector<at::Tensor> tensors = {torch::ones({3})};
    auto future = shared.process_group()->allreduce(tensors)->getFuture();
    future->wait();
    EXPECT_TRUE(at::equal(future->value().toTensorVector()[0],
                          torch::full({3}, static_cast<float>(world_size))));
    // ... and hold them once wait() has returned (DDP's Reducer reads the Join's divisor so):
    // many small collectives, for the worker thread's completion to race the waiter.
    for (int i = 0; i < 300; ++i) {
      std::vector<at::Tensor> one = {torch::ones({1})};
      auto work = shared.process_group()->allreduce(one);
      work->wait();
      ASSERT_TRUE(work->getFuture()->completed()) << "collective " << i;
    }

    // A group of one has nothing to share.
    const Group alone = new_group({0});
    if (rank == 0) {
      EXPECT_EQ(share_host_memory(alone).process_group().get(), alone.process_group().get());
    }
  });
}

TEST(HostMemoryGroup, DeadMemberIsNamedAsLost) {
  distoptim::testing::RunRanksOptions options;
  options.expected_exit_codes[2] = 3;
  run_ranks(
      3,
      [](int rank, int) {
        init_process_group(ProcessGroupOptions("env://").timeout(30s));
        const Group shared = share_host_memory(world(), kSmallSlot);
        if (rank == 2) std::_Exit(3);
        // The loss itself is named (not the 30 s timeout's "timed out ... never reached it").
        distoptim::testing::expect_error_containing(
            [&] { allreduce(shared, torch::ones({10000})); },
            {"allreduce #1 over shared memory on group [0, 1, 2] failed at rank " +
                 std::to_string(rank) + ": rank 2 is lost (its process ",
             " has exited)"});
        try {
          allreduce(shared, torch::ones({3}));
          ADD_FAILURE() << "a group that lost a member must fail at once";
        } catch (const PeerLostError& e) {
          EXPECT_NE(std::string(e.what()).find("an earlier collective failed: rank 2 is lost"),
                    std::string::npos)
              << e.what();
        }
      },
      options);
}

TEST(HostMemoryGroup, AbsentMemberTimesOutNamingIt) {
  run_ranks(3, [](int rank, int) {
    init_process_group(ProcessGroupOptions("env://").timeout(30s));
    // Setting up the shared memory is collective too, bounded by the group's timeout: only the
    // collective under test is impatient (a loaded machine may keep a rank 1 s from the setup).
    const Group shared = share_host_memory(world(), kSmallSlot);
    const distoptim::testing::AbsentRank absent(rank, 3, 2);
    if (rank == 2) {
      absent.stay_until_the_others_are_done();  // skips the collective, alive
      return;
    }
    try {
      allreduce(shared, torch::ones({10}), c10d::ReduceOp::SUM, 1s);
      ADD_FAILURE() << "expected a timeout";
    } catch (const TimeoutError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("allreduce #1 over shared memory on group [0, 1, 2] failed at rank " +
                             std::to_string(rank) +
                             ": timed out after 1000 ms; these ranks never reached it: "),
                std::string::npos)
          << message;
      // Rank 2 never came; the other survivor may or may not have arrived yet.
      EXPECT_NE(message.find("2", message.find("never reached it")), std::string::npos) << message;
    }
    // Broken for good: a later collective fails at once with the same kind of error.
    EXPECT_THROW(allreduce(shared, torch::ones({10})), TimeoutError);
    absent.done();
  });
}

}  // namespace host_memory_group_test
}  // namespace comm
}  // namespace distoptim
