// Store operations end by a deadline: a rendezvous against a store host that is stopped
// (SIGSTOP) or that accepts connections and never answers fails with a TimeoutError naming the
// store, instead of hanging; and DeadlineStore's own contract, against a store that blocks.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <distoptim/comm.h>

#include "harness/multiprocess.h"
#include "support/wait_until.h"

namespace distoptim {
namespace comm {
namespace store_deadline_test {

using distoptim::testing::run_ranks;
using distoptim::testing::wait_until;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::string master_port() { return std::getenv("MASTER_PORT"); }

void expect_contains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "'" << part << "' not in: " << text;
}

TEST(StoreDeadline, RendezvousWithStoppedStoreHostTimesOut) {
  testing::RunRanksOptions options;
  options.deadline = 40s;
  options.rank0_in_test_process = false;  // it stops its whole process
  run_ranks(
      2,
      [](int rank, int world_size) {
        const std::string pid_file = "/tmp/distoptim-stopped-store-" + master_port();
        if (rank == 0) {
          // Serves the store as a rendezvous's rank 0 would, then stops until rank 1 continues
          // it.
          c10d::TCPStoreOptions store_options;
          store_options.port = static_cast<uint16_t>(std::stoi(master_port()));
          store_options.isServer = true;
          store_options.waitWorkers = false;
          store_options.multiTenant = true;
          c10d::TCPStore store("127.0.0.1", store_options);
          std::ofstream(pid_file) << ::getpid() << std::endl;
          ::raise(SIGSTOP);
          // Rank 1 still holds a client of this store (its timed-out operation's thread), and
          // LibTorch's client aborts its process when the server resets the connection: serve
          // until rank 1 has exited.
          pid_t waiter = 0;
          ASSERT_TRUE(
              wait_until([&] { return bool(std::ifstream(pid_file + ".1") >> waiter); }, 20s));
          ::unlink((pid_file + ".1").c_str());
          EXPECT_TRUE(testing::wait_for_process_state(waiter, "Z?", 30s));
          return;
        }
        pid_t pid = 0;
        ASSERT_TRUE(wait_until([&] { return bool(std::ifstream(pid_file) >> pid); }, 20s));
        ::unlink(pid_file.c_str());
        ASSERT_TRUE(testing::wait_for_process_state(pid, "T", 20s));
        const auto start = Clock::now();
        try {
          rendezvous(RendezvousOptions("env://").rank(rank).world_size(world_size).timeout(3s));
          ADD_FAILURE() << "expected a TimeoutError";
        } catch (const TimeoutError& e) {
          expect_contains(e.what(), "the store at 127.0.0.1:" + master_port() + " did not answer");
        }
        // The timeout, and at most DeadlineStore::kMinAnswerTime more; generous for a loaded
        // machine: the point is that it did not hang.
        EXPECT_LT(Clock::now() - start, 15s);
        std::ofstream(pid_file + ".1") << ::getpid() << std::endl;
        ::kill(pid, SIGCONT);
      },
      options);
}

TEST(StoreDeadline, RendezvousWithSilentListenerTimesOut) {
  testing::RunRanksOptions options;
  options.deadline = 30s;
  run_ranks(
      1,
      [](int, int) {
        // A listening socket nobody reads: the kernel completes each connection on its backlog,
        // so the client is connected to a peer that never answers.
        const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
        ASSERT_GE(fd, 0);
        sockaddr_in addr{};
        addr.sin_family = AF_INET;
        addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t len = sizeof(addr);
        ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
        ASSERT_EQ(::listen(fd, 16), 0);
        ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
        const std::string port = std::to_string(ntohs(addr.sin_port));
        const auto start = Clock::now();
        try {
          rendezvous(
              RendezvousOptions("tcp://127.0.0.1:" + port).rank(1).world_size(2).timeout(2s));
          ADD_FAILURE() << "expected a TimeoutError";
        } catch (const TimeoutError& e) {
          expect_contains(e.what(), "the store at 127.0.0.1:" + port + " did not answer");
        }
        EXPECT_LT(Clock::now() - start, 15s);
        // `fd` stays open until the process exits: closing it would reset the connection, and
        // LibTorch 1.13's TCPStore client aborts the process when its watch-key thread's
        // connection is reset (docs/errors.md).
      },
      options);
}

// A store whose operations block until released, or fail as a lost connection does.
class BlockingStore : public c10d::Store {
 public:
  void release() {
    std::lock_guard<std::mutex> lock(mutex_);
    released_ = true;
    cv_.notify_all();
  }
  void set(const std::string& key, const std::vector<uint8_t>&) override {
    if (key == "lost") throw std::system_error(EPIPE, std::system_category());
    block();
  }
  std::vector<uint8_t> get(const std::string&) override { return block(), std::vector<uint8_t>{}; }
  int64_t add(const std::string&, int64_t) override { return block(), 0; }
  bool deleteKey(const std::string&) override { return block(), true; }
  bool check(const std::vector<std::string>&) override { return block(), true; }
  int64_t getNumKeys() override { return block(), 0; }
  void wait(const std::vector<std::string>&) override { block(); }
  void wait(const std::vector<std::string>&, const std::chrono::milliseconds&) override { block(); }

 private:
  void block() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [this] { return released_; });
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  bool released_ = false;
};

TEST(DeadlineStore, TimesOutFailsFastAfterwardsAndRecovers) {
  auto blocking = c10::make_intrusive<BlockingStore>();
  DeadlineStore store(blocking, "host:1234", 1s);
  const auto start = Clock::now();
  try {
    store.add("counter", 1);
    ADD_FAILURE() << "expected a TimeoutError";
  } catch (const TimeoutError& e) {
    expect_contains(e.what(), "the store at host:1234 did not answer add(counter) within 1 s");
  }
  EXPECT_LT(Clock::now() - start, 10s);
  // The add has not returned: the store is not answering, so the next call fails at once.
  try {
    store.check({"a"}, Clock::now() + 30s);
    ADD_FAILURE() << "expected a TimeoutError";
  } catch (const TimeoutError& e) {
    expect_contains(e.what(), "is not answering: add(counter) has waited");
  }
  EXPECT_LT(Clock::now() - start, 10s);
  blocking->release();
  // Once it returns, the store answers again.
  const bool answers = wait_until(
      [&] {
        try {
          return store.check({"a"});
        } catch (const TimeoutError&) {
          return false;
        }
      },
      10s);
  EXPECT_TRUE(answers);
}

TEST(DeadlineStore, LostConnectionIsPeerLost) {
  DeadlineStore store(c10::make_intrusive<BlockingStore>(), "host:1234", 1s);
  try {
    store.set("lost", {1});
    ADD_FAILURE() << "expected a PeerLostError";
  } catch (const PeerLostError& e) {
    expect_contains(e.what(), "lost the store at host:1234 during set(lost): Broken pipe");
  }
}

}  // namespace store_deadline_test
}  // namespace comm
}  // namespace distoptim
