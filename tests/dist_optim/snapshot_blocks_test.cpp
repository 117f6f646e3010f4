// A table shard's snapshot blocks written while the owner still copies the shard
// (src/dist_optim/snapshot_files.h): a block is begun only once its rows are copied, and a copy
// that stops short leaves the blocks before it written and none after, with an error naming the
// first block it kept from being written. And an owner's writes that go on after it answered
// (snapshot_writes.h): each claimed once by its ticket, its result or error in the claim's future,
// a dropped one waited for and unclaimable.

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <filesystem>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "snapshot_files.h"
#include "snapshot_writes.h"

namespace distoptim {
namespace dist_optim {
namespace snapshot_blocks_test {

namespace fs = std::filesystem;
using detail::ParamCopy;
using detail::RowsCopied;

constexpr int64_t kRows = 40;
constexpr int64_t kDim = 6;
constexpr int64_t kFirstRow = 100;    // the shard's first row in its table
constexpr int64_t kRowsPerFile = 16;  // blocks of rows [100, 116), [116, 132), [132, 140)

class SnapshotBlocks : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("snapshot_blocks_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    at::manual_seed(3);
    table_ = at::randn({kRows, kDim});
    sums_ = at::rand({kRows, kDim});
    // The copy's memory, zero until copied (as copy_targets leaves it).
    part_.value = at::zeros({kRows, kDim});
    part_.has_state = true;
    part_.state.step = 9;
    part_.state.buffers["sum"] = at::zeros({kRows, kDim});
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string prefix() const { return (dir_ / "table-0").string(); }
  std::string block(int64_t b) const { return detail::block_path(prefix(), 0, 1, b); }

  // Copies rows [from, to) of the shard into the copy, then says so.
  void copy_rows(int64_t from, int64_t to, RowsCopied& copied) {
    part_.value.slice(0, from, to).copy_(table_.slice(0, from, to));
    part_.state.buffers["sum"].slice(0, from, to).copy_(sums_.slice(0, from, to));
    copied.advance(to);
  }

  // Waits (at most a minute) for `path` to exist: the writer renames a block into place whole.
  static bool appears(const std::string& path) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(1);
    while (!fs::exists(path)) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return true;
  }

  fs::path dir_;
  at::Tensor table_, sums_;
  ParamCopy part_;
};

TEST_F(SnapshotBlocks, ABlockIsWrittenOnlyOnceItsRowsAreCopied) {
  RowsCopied copied;
  std::vector<int64_t> firsts;
  std::exception_ptr failure;
  std::thread writer([&] {
    try {
      firsts = detail::write_shard_blocks(prefix(), 0, 1, kFirstRow, part_, kRowsPerFile, &copied);
    } catch (...) {
      failure = std::current_exception();
    }
  });
  copy_rows(0, kRowsPerFile, copied);
  ASSERT_TRUE(appears(block(0))) << "the first block, its rows copied, was not written";
  // The second block's rows are not copied yet: no writer may have begun it.
  EXPECT_FALSE(fs::exists(block(1)));
  copy_rows(kRowsPerFile, kRows, copied);
  writer.join();
  ASSERT_FALSE(failure);
  EXPECT_EQ(firsts, (std::vector<int64_t>{100, 116, 132, 140}));

  // Every block holds the copied rows and state, none of the zeros the copy began as.
  std::vector<detail::BlockFile> blocks;
  for (int64_t b = 0; b < 3; ++b) blocks.push_back({block(b), 0, firsts[b], firsts[b + 1]});
  detail::StateSummary state{true, 9, {"sum"}};
  const ParamCopy read =
      detail::read_block_rows(blocks, kFirstRow, kFirstRow + kRows, kDim, at::kFloat, state);
  EXPECT_TRUE(at::equal(read.value, table_));
  EXPECT_TRUE(at::equal(read.state.buffers.at("sum"), sums_));
  EXPECT_EQ(read.state.step, 9);
}

TEST_F(SnapshotBlocks, ACopyThatStopsShortLeavesNoLaterBlockAndNamesTheFirst) {
  RowsCopied copied;
  copy_rows(0, kRowsPerFile + 3, copied);  // the first block's rows and some of the second's
  copied.abandon();
  try {
    detail::write_shard_blocks(prefix(), 0, 1, kFirstRow, part_, kRowsPerFile, &copied);
    ADD_FAILURE() << "blocks were written past where the copy stopped";
  } catch (const c10::Error& error) {
    EXPECT_NE(std::string(error.what())
                  .find("save_snapshot: the copy of shard 0 stopped before its block 1"),
              std::string::npos)
        << error.what();
  }
  EXPECT_TRUE(fs::exists(block(0)));
  EXPECT_FALSE(fs::exists(block(1)));
  EXPECT_FALSE(fs::exists(block(2)));
}

// Whether `call` throws a c10::ValueError whose message holds `part`.
template <class Call>
void expect_value_error(const Call& call, const std::string& part) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one with: " << part;
  } catch (const c10::ValueError& error) {
    EXPECT_NE(std::string(error.what()).find(part), std::string::npos) << error.what();
  }
}

TEST(SnapshotWrites, AWriteIsClaimedOnceAndItsFutureCompletesWithItsResult) {
  detail::SnapshotWrites writes;
  std::mutex mutex;
  std::condition_variable cv;
  bool go = false;
  const int64_t ticket = writes.start(1, [&] {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return go; });
    return c10::IValue(int64_t{7});
  });
  const int64_t other = writes.start(0.5, [] { return c10::IValue(std::string("other")); });
  EXPECT_NE(ticket, other);
  // Claimed while it is still being written: the future completes later.
  const auto written = writes.claim(ticket, "owner");
  EXPECT_FALSE(written->completed());
  {
    std::lock_guard<std::mutex> lock(mutex);
    go = true;
  }
  cv.notify_all();
  written->wait();
  EXPECT_EQ(written->value().toInt(), 7);
  const auto other_written = writes.claim(other, "owner");
  other_written->waitAndThrow();
  EXPECT_EQ(other_written->value().toStringRef(), "other");
  expect_value_error([&] { writes.claim(ticket, "owner"); },
                     "save_snapshot: worker 'owner' has no snapshot write numbered " +
                         std::to_string(ticket) + " to claim");
  expect_value_error([&] { writes.claim(other + 100, "ps1"); },
                     "worker 'ps1' has no snapshot write numbered " + std::to_string(other + 100));
}

TEST(SnapshotWrites, AFailedWriteFailsItsClaimWithItsError) {
  detail::SnapshotWrites writes;
  const int64_t ticket =
      writes.start(1, []() -> c10::IValue { TORCH_CHECK(false, "cannot write 'block-3.pt'"); });
  const auto written = writes.claim(ticket, "owner");
  written->wait();
  ASSERT_TRUE(written->hasError());
  EXPECT_NE(written->tryRetrieveErrorMessage().find("cannot write 'block-3.pt'"),
            std::string::npos);
}

TEST(SnapshotWrites, ADroppedWriteIsWaitedForAndCannotBeClaimed) {
  detail::SnapshotWrites writes;
  std::atomic<bool> ended{false};
  const int64_t ticket = writes.start(1, [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ended = true;
    return c10::IValue();
  });
  writes.drop(ticket);
  EXPECT_TRUE(ended);
  expect_value_error([&] { writes.claim(ticket, "owner"); },
                     "has no snapshot write numbered " + std::to_string(ticket));
}

// The share of the disk's time an owner's writer may take comes from the wire
// (SnapshotOptions::disk_share): anything but 0 < share <= 1 is refused naming it and the owner.
TEST(SnapshotWrites, ADiskShareOutsideZeroToOneIsRefusedNamingTheOwner) {
  for (const double share :
       {0.0, -0.5, 1.5, std::nan(""), std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE(share);
    expect_value_error([&] { detail::SnapshotWrites::check_disk_share(share, "ps1"); },
                       c10::str("save_snapshot: disk_share is ", share,
                                " on worker 'ps1'; it must be more than 0 and at most 1"));
  }
  detail::SnapshotWrites::check_disk_share(1, "ps1");
  detail::SnapshotWrites::check_disk_share(1e-3, "ps1");
}

}  // namespace snapshot_blocks_test
}  // namespace dist_optim
}  // namespace distoptim
