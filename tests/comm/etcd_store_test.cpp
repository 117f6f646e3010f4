// EtcdStore against a real etcd 3.4 started by the test (tests/harness/etcd_server.h): every
// Store operation's exact result, waits that time out or lose etcd, and endpoints that answer
// what etcd never would.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <distoptim/comm.h>

#include "harness/etcd_server.h"
#include "harness/multiprocess.h"
#include "support/process_memory.h"
#include "support/test_util.h"

namespace distoptim {
namespace comm {
namespace etcd_store_test {

using distoptim::testing::EtcdServer;
using distoptim::testing::expect_error_containing;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::vector<uint8_t> bytes(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

// A bound that only a hang exceeds; the tests assert no speed.
constexpr auto kHangBound = 60s;

// One etcd for the whole suite; each test uses jobs of its own.
class EtcdStoreOps : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { shared_etcd = new EtcdServer(); }
  static void TearDownTestSuite() {
    delete shared_etcd;
    shared_etcd = nullptr;
  }

  static std::unique_ptr<EtcdStore> store(const std::string& job,
                                          std::chrono::milliseconds timeout = 30s) {
    return std::make_unique<EtcdStore>(
        EtcdStoreOptions(shared_etcd->endpoint(), job).timeout(timeout));
  }

  static EtcdServer* shared_etcd;
};

EtcdServer* EtcdStoreOps::shared_etcd = nullptr;

TEST_F(EtcdStoreOps, SetGetRoundTripsBinaryValues) {
  auto s = store("roundtrip");
  std::vector<uint8_t> all_bytes;
  for (int i = 0; i < 256; ++i) all_bytes.push_back(static_cast<uint8_t>(i));
  const std::vector<uint8_t> with_nuls = {0, 0, 'a', 0, 'b', 0};
  s->set("all", all_bytes);
  s->set("nuls", with_nuls);
  s->set("empty", {});
  s->set(std::string("key\0with nul", 12), {7});
  EXPECT_EQ(s->get("all"), all_bytes);
  EXPECT_EQ(s->get("nuls"), with_nuls);
  EXPECT_EQ(s->get("empty"), std::vector<uint8_t>{});
  EXPECT_EQ(s->get(std::string("key\0with nul", 12)), std::vector<uint8_t>{7});
  s->set("nuls", bytes("over"));
  EXPECT_EQ(s->get("nuls"), bytes("over"));
  EXPECT_EQ(s->key_prefix(), "/distoptim/roundtrip/");
  EXPECT_EQ(s->endpoint(), shared_etcd->endpoint());
}

TEST_F(EtcdStoreOps, CompareSetFollowsTcpStore) {
  auto s = store("compareset");
  // Absent, expected not empty: nothing written, `expected` returned.
  EXPECT_EQ(s->compareSet("k", bytes("x"), bytes("new")), bytes("x"));
  EXPECT_FALSE(s->check({"k"}));
  // Absent, expected empty: created.
  EXPECT_EQ(s->compareSet("k", {}, bytes("first")), bytes("first"));
  EXPECT_EQ(s->get("k"), bytes("first"));
  // Present, expected matches: replaced.
  EXPECT_EQ(s->compareSet("k", bytes("first"), bytes("second")), bytes("second"));
  EXPECT_EQ(s->get("k"), bytes("second"));
  // Present, expected differs: left, current value returned.
  EXPECT_EQ(s->compareSet("k", bytes("first"), bytes("third")), bytes("second"));
  EXPECT_EQ(s->get("k"), bytes("second"));
  // Present and empty, expected empty: replaced.
  s->set("e", {});
  EXPECT_EQ(s->compareSet("e", {}, bytes("filled")), bytes("filled"));
  EXPECT_EQ(s->get("e"), bytes("filled"));
}

TEST_F(EtcdStoreOps, AddFromManyThreadsSumsExactly) {
  auto s = store("add");
  EXPECT_EQ(s->add("fresh", 5), 5);
  EXPECT_EQ(s->add("fresh", -7), -2);
  EXPECT_EQ(s->get("fresh"), bytes("-2"));

  constexpr int kThreads = 4;
  constexpr int kAdds = 25;
  std::vector<std::vector<int64_t>> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kAdds; ++i) seen[t].push_back(s->add("counter", t + 1));
    });
  }
  for (auto& thread : threads) thread.join();
  const int64_t total = kAdds * (1 + 2 + 3 + 4);
  EXPECT_EQ(s->add("counter", 0), total);
  EXPECT_EQ(s->get("counter"), bytes(std::to_string(total)));
  // Atomic: every add saw a sum of its own.
  std::set<int64_t> sums;
  for (const auto& list : seen) sums.insert(list.begin(), list.end());
  EXPECT_EQ(sums.size(), static_cast<size_t>(kThreads * kAdds));
  EXPECT_EQ(*sums.rbegin(), total);
}

TEST_F(EtcdStoreOps, AddToANonIntegerOrPastInt64IsValueError) {
  auto s = store("add-bad");
  s->set("text", bytes("12abc"));
  try {
    s->add("text", 1);
    ADD_FAILURE() << "expected c10::ValueError";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("add(text, 1)"), std::string::npos) << e.what();
  }
  EXPECT_EQ(s->get("text"), bytes("12abc"));
  s->add("big", INT64_MAX);
  EXPECT_THROW(s->add("big", 1), c10::ValueError);
  EXPECT_EQ(s->add("big", 0), INT64_MAX);
}

TEST_F(EtcdStoreOps, DeleteKeyAndCheck) {
  auto s = store("delete");
  EXPECT_TRUE(s->check({}));
  EXPECT_FALSE(s->check({"a"}));
  s->set("a", bytes("1"));
  EXPECT_TRUE(s->check({"a"}));
  EXPECT_FALSE(s->check({"a", "b"}));
  s->set("b", bytes("2"));
  EXPECT_TRUE(s->check({"a", "b"}));
  EXPECT_TRUE(s->deleteKey("a"));
  EXPECT_FALSE(s->deleteKey("a"));
  EXPECT_FALSE(s->check({"a"}));
  EXPECT_TRUE(s->check({"b"}));
  // More keys than one etcd transaction holds.
  std::vector<std::string> many;
  for (int i = 0; i < 150; ++i) many.push_back("m" + std::to_string(i));
  for (const auto& key : many) s->set(key, bytes("x"));
  EXPECT_TRUE(s->check(many));
  s->deleteKey("m149");
  EXPECT_FALSE(s->check(many));
}

TEST_F(EtcdStoreOps, NumKeysCountsOnlyThisJob) {
  // "numkeys2/..." sorts after "numkeys/" and before its range end: the jobs must not mix.
  auto a = store("numkeys");
  auto b = store("numkeys2");
  auto c = store("numkey");
  EXPECT_EQ(a->getNumKeys(), 0);
  for (const char* key : {"x", "y", "z"}) a->set(key, bytes("1"));
  for (const char* key : {"x", "y"}) b->set(key, bytes("2"));
  c->set("x", bytes("3"));
  EXPECT_EQ(a->getNumKeys(), 3);
  EXPECT_EQ(b->getNumKeys(), 2);
  EXPECT_EQ(c->getNumKeys(), 1);
  a->deleteKey("y");
  EXPECT_EQ(a->getNumKeys(), 2);
  EXPECT_EQ(b->get("x"), bytes("2"));
}

TEST_F(EtcdStoreOps, WaitAndGetReturnOnceTheKeysAreSet) {
  auto s = store("wait");
  auto writer_store = store("wait");
  // Present keys: at once.
  s->set("here", bytes("1"));
  s->wait({"here"});
  s->wait({"here"}, 5s);
  // Keys set by another client while this one waits (or before: the result is the same).
  std::thread writer([&] {
    // Likely lets the wait begin first: that it blocks is inside the store, not visible here.
    std::this_thread::sleep_for(100ms);
    writer_store->set("late1", bytes("a"));
    writer_store->set("late2", bytes("b"));
    writer_store->set("late3", bytes("c"));
  });
  s->wait({"late1", "late2"}, 30s);
  EXPECT_EQ(s->get("late3"), bytes("c"));
  writer.join();
  // Without a timeout.
  std::thread writer2([&] { writer_store->set("forever", bytes("d")); });
  s->wait({"forever"}, c10d::Store::kNoTimeout);
  writer2.join();
  EXPECT_EQ(s->get("forever"), bytes("d"));
}

TEST_F(EtcdStoreOps, MissingKeyTimesOutNamingKeyAndEndpoint) {
  auto s = store("missing", 1s);
  s->set("present", bytes("1"));
  const auto start = Clock::now();
  try {
    s->get("never");
    ADD_FAILURE() << "expected a TimeoutError";
  } catch (const TimeoutError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("etcd at " + shared_etcd->endpoint()), std::string::npos) << message;
    EXPECT_NE(message.find("get(never) timed out after 1 s; keys still missing: never"),
              std::string::npos)
        << message;
  }
  try {
    s->wait({"present", "never2"}, 1s);
    ADD_FAILURE() << "expected a TimeoutError";
  } catch (const TimeoutError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("keys still missing: never2"), std::string::npos) << message;
    EXPECT_EQ(message.find("missing: present"), std::string::npos) << message;
    EXPECT_NE(message.find(shared_etcd->endpoint()), std::string::npos) << message;
  }
  EXPECT_LT(Clock::now() - start, kHangBound);
}

// A listening socket on a free loopback port, which goes to `port`.
int listen_on_loopback(int& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof addr;
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  EXPECT_EQ(::listen(fd, 16), 0);
  EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length), 0);
  port = ntohs(addr.sin_port);
  return fd;
}

// A relay in front of the real etcd that passes each connection's first request and its answer,
// and resets the connection (SO_LINGER 0) when a second request arrives on it, unread: what a
// client sees when the server closed a kept-alive connection meanwhile, as its next request is
// sent.
class ResetsSecondRequests {
 public:
  explicit ResetsSecondRequests(const std::string& etcd_endpoint) {
    const auto colon = etcd_endpoint.rfind(':');
    etcd_port_ = std::stoi(etcd_endpoint.substr(colon + 1));
    fd_ = listen_on_loopback(port_);
    acceptor_ = std::thread([this] { accept_all(); });
  }
  ~ResetsSecondRequests() {
    stopping_ = true;
    ::shutdown(fd_, SHUT_RDWR);
    acceptor_.join();
    std::lock_guard<std::mutex> lock(mutex_);
    for (std::thread& relay : relays_) relay.join();
    ::close(fd_);
  }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }
  int connections() const { return connections_; }
  int resets() const { return resets_; }

 private:
  void accept_all() {
    while (!stopping_) {
      const int client = ::accept(fd_, nullptr, nullptr);
      if (client < 0) return;
      ++connections_;
      std::lock_guard<std::mutex> lock(mutex_);
      relays_.emplace_back([this, client] { relay(client); });
    }
  }
  void relay(int client) {
    const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(etcd_port_));
    if (::connect(server, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      ::close(client);
      ::close(server);
      return;
    }
    bool answered = false;  // etcd has sent bytes back: the next request is a second one
    char buffer[65536];
    while (!stopping_) {
      pollfd fds[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
      if (::poll(fds, 2, 100) < 0) break;
      if (fds[0].revents != 0) {
        if (answered) {
          const linger reset{1, 0};
          ::setsockopt(client, SOL_SOCKET, SO_LINGER, &reset, sizeof reset);
          ++resets_;
          break;
        }
        const ssize_t n = ::recv(client, buffer, sizeof buffer, 0);
        if (n <= 0 || ::send(server, buffer, static_cast<size_t>(n), MSG_NOSIGNAL) != n) break;
      }
      if (fds[1].revents != 0) {
        const ssize_t n = ::recv(server, buffer, sizeof buffer, 0);
        if (n <= 0 || ::send(client, buffer, static_cast<size_t>(n), MSG_NOSIGNAL) != n) break;
        answered = true;
      }
    }
    ::close(client);
    ::close(server);
  }

  int etcd_port_ = 0;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int> connections_{0};
  std::atomic<int> resets_{0};
  std::mutex mutex_;
  std::vector<std::thread> relays_;  // guarded by mutex_
  std::thread acceptor_;
};

// A request on a kept-alive connection that the server reset before answering is sent once more
// on a new connection (libcurl does it), and applied once: an add counts once.
TEST_F(EtcdStoreOps, ARequestOnAKeptAliveConnectionResetUnansweredIsSentAgainOnce) {
  ResetsSecondRequests relay(shared_etcd->endpoint());
  EtcdStore s(EtcdStoreOptions(relay.endpoint(), "kept_alive_reset").timeout(30s));
  for (int64_t i = 1; i <= 4; ++i) EXPECT_EQ(s.add("counter", 1), i);
  s.set("key", bytes("value"));
  EXPECT_EQ(s.get("key"), bytes("value"));
  EXPECT_TRUE(s.check({"key", "counter"}));
  EXPECT_GE(relay.resets(), 3);
  EXPECT_EQ(relay.connections(), relay.resets() + 1);
  // What etcd holds, read past the relay: every add applied once.
  EXPECT_EQ(store("kept_alive_reset")->add("counter", 0), 4);
}

TEST_F(EtcdStoreOps, BadOptionsAndValuesAreValueErrors) {
  expect_error_containing([] { EtcdStore(EtcdStoreOptions("localhost", "job")); },
                          {"endpoint 'localhost'", "HOST:PORT"});
  expect_error_containing([] { EtcdStore(EtcdStoreOptions("127.0.0.1:0", "job")); }, {"port '0'"});
  expect_error_containing([] { EtcdStore(EtcdStoreOptions("host/x:2379", "job")); },
                          {"host 'host/x'"});
  expect_error_containing([] { EtcdStore(EtcdStoreOptions("127.0.0.1:2379", "a/b")); },
                          {"job 'a/b'"});
  expect_error_containing([] { EtcdStore(EtcdStoreOptions("127.0.0.1:2379", "")); }, {"job ''"});
  auto s = store("big-value");
  EXPECT_THROW(s->set("big", std::vector<uint8_t>(EtcdStore::kMaxValueBytes + 1)), c10::ValueError);
  EXPECT_FALSE(s->check({"big"}));
  const std::vector<uint8_t> largest(EtcdStore::kMaxValueBytes, 0xab);
  s->set("largest", largest);
  EXPECT_EQ(s->get("largest"), largest);
}

TEST(EtcdStoreLost, UnreachableEtcdIsPeerLostNamingIt) {
  const std::string endpoint = "127.0.0.1:" + std::to_string(distoptim::testing::free_port());
  EtcdStore s(EtcdStoreOptions(endpoint, "job"));
  expect_error_containing([&] { s.set("k", {1}); }, {"etcd at " + endpoint, "set(k)"});
  EXPECT_THROW(s.getNumKeys(), PeerLostError);
}

TEST(EtcdStoreLost, KilledEtcdFailsABlockedWait) {
  EtcdServer etcd;
  EtcdStore s(EtcdStoreOptions(etcd.endpoint(), "killed").timeout(300s));
  auto waiting = std::async(std::launch::async, [&]() -> std::string {
    try {
      s.wait({"never"});
    } catch (const PeerLostError& e) {
      return e.what();
    } catch (const std::exception& e) {
      return std::string("not a PeerLostError: ") + e.what();
    }
    return "wait returned";
  });
  // Killed once the wait watches (etcd counts its watchers), so that it is blocked in etcd.
  EXPECT_TRUE(distoptim::testing::wait_until(
      [&] {
        const std::string metrics = etcd.http_get("/metrics");
        return metrics.find("\netcd_debugging_mvcc_watcher_total 1") != std::string::npos;
      },
      kHangBound));
  etcd.kill();
  ASSERT_EQ(waiting.wait_for(kHangBound), std::future_status::ready) << "the wait hung";
  const std::string message = waiting.get();
  EXPECT_NE(message.find("etcd at " + etcd.endpoint()), std::string::npos) << message;
  EXPECT_NE(message.find("wait(never)"), std::string::npos) << message;
}

// What a HostileEndpoint sends: `head`, then, when `endless`, bytes until the client goes.
struct Reply {
  std::string head;
  bool endless = false;
};

// A loopback listener that answers every connection with `reply` (a watch request with
// `watch_reply`, when given) and closes it. Counts what it sent.
class HostileEndpoint {
 public:
  explicit HostileEndpoint(Reply reply, std::optional<Reply> watch_reply = std::nullopt)
      : reply_(std::move(reply)), watch_reply_(std::move(watch_reply)) {
    fd_ = listen_on_loopback(port_);
    thread_ = std::thread([this] { serve(); });
  }
  ~HostileEndpoint() {
    stopping_ = true;
    ::shutdown(fd_, SHUT_RDWR);
    thread_.join();
    ::close(fd_);
  }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }
  // The most one connection was sent.
  size_t most_sent() const { return most_sent_; }

 private:
  void serve() {
    while (!stopping_) {
      const int client = ::accept(fd_, nullptr, nullptr);
      if (client < 0) return;
      // Reads the request's head first (it names the path; and closing a connection with unread
      // bytes would reset it).
      timeval bound{2, 0};
      ::setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof bound);
      std::string request;
      char buffer[4096];
      ssize_t got = 0;
      while (request.find("\r\n\r\n") == std::string::npos && request.size() < 65536 &&
             (got = ::recv(client, buffer, sizeof buffer, 0)) > 0) {
        request.append(buffer, static_cast<size_t>(got));
      }
      const bool watch = request.rfind("POST /v3/watch ", 0) == 0;
      const Reply& reply = watch && watch_reply_ ? *watch_reply_ : reply_;
      size_t sent = 0;
      if (!reply.head.empty() &&
          ::send(client, reply.head.data(), reply.head.size(), MSG_NOSIGNAL) > 0) {
        sent += reply.head.size();
      }
      const std::string chunk(64 << 10, 'x');
      // Stops when the client goes (the send fails), or past 1 GiB (a client that never stops).
      while (reply.endless && !stopping_ && sent < (size_t{1} << 30)) {
        const ssize_t n = ::send(client, chunk.data(), chunk.size(), MSG_NOSIGNAL);
        if (n <= 0) break;
        sent += static_cast<size_t>(n);
      }
      most_sent_ = std::max<size_t>(most_sent_, sent);
      ::close(client);
    }
  }

  const Reply reply_;
  const std::optional<Reply> watch_reply_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<size_t> most_sent_{0};
  std::thread thread_;
};

// Runs `op` on a store at `endpoint` and expects an error of `Error` naming the endpoint and
// the operation, with `detail` in its message, well before a hang.
template <class Error>
void expect_clear_error(const std::string& endpoint, const std::string& detail) {
  EtcdStore s(EtcdStoreOptions(endpoint, "hostile").timeout(5s).request_timeout(5s));
  const auto start = Clock::now();
  try {
    s.get("key");
    ADD_FAILURE() << "expected an error for " << detail;
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("etcd at " + endpoint + ": get(key)"), std::string::npos) << message;
    EXPECT_NE(message.find(detail), std::string::npos) << message;
  }
  EXPECT_LT(Clock::now() - start, kHangBound);
}

TEST(EtcdStoreHostile, GarbageIsAClearError) {
  static constexpr char kGarbage[] = "\x01\x02not http at all\x00\xff\r\n\r\n";
  HostileEndpoint garbage({std::string(kGarbage, sizeof kGarbage - 1)});
  expect_clear_error<DistributedError>(garbage.endpoint(), "HTTP/0.9");
}

TEST(EtcdStoreHostile, ClosedAtOnceIsPeerLost) {
  HostileEndpoint closes({""});
  expect_clear_error<PeerLostError>(closes.endpoint(), "the connection closed before the answer");
}

TEST(EtcdStoreHostile, HugeContentLengthIsNotRead) {
  HostileEndpoint huge({"HTTP/1.1 200 OK\r\nContent-Length: 1000000000000\r\n\r\n", true});
  expect_clear_error<DistributedError>(huge.endpoint(),
                                       "the answer announces 1000000000000 bytes, above the cap "
                                       "of 4194304 bytes; not read");
}

TEST(EtcdStoreHostile, EndlessBodyIsCutAtTheCap) {
  HostileEndpoint endless({"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", true});
  const int64_t before = distoptim::testing::allocated_bytes();
  expect_clear_error<DistributedError>(endless.endpoint(),
                                       "the answer is larger than the cap of 4194304 bytes");
  // The client stopped reading at the cap: what the endpoint got out is the cap plus what the
  // sockets' buffers held, not the 1 GiB it would send.
  EXPECT_LT(endless.most_sent(), EtcdStore::kMaxResponseBytes + (size_t{64} << 20));
  if (distoptim::testing::kChecksMemory) {
    EXPECT_LT(distoptim::testing::allocated_bytes() - before,
              static_cast<int64_t>(EtcdStore::kMaxResponseBytes));
  }
}

std::string ok(const std::string& body) {
  return "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

TEST(EtcdStoreHostile, EndlessWatchLineIsCutAtTheCap) {
  // The check of the key says it is absent (one response, no count); the watch that follows
  // never ends its first line.
  HostileEndpoint endless({ok("{\"header\":{\"revision\":\"1\"},\"responses\":[{}]}")},
                          Reply{"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", true});
  EtcdStore s(EtcdStoreOptions(endless.endpoint(), "hostile").timeout(30s));
  try {
    s.wait({"key"});
    ADD_FAILURE() << "expected a DistributedError";
  } catch (const DistributedError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("etcd at " + endless.endpoint() + ": wait(key)"), std::string::npos)
        << message;
    EXPECT_NE(message.find("a line of the answer is larger than the cap of 4194304 bytes"),
              std::string::npos)
        << message;
  }
  EXPECT_LT(endless.most_sent(), EtcdStore::kMaxResponseBytes + (size_t{64} << 20));
}

TEST(EtcdStoreHostile, MalformedAnswersAreClearErrors) {
  {
    HostileEndpoint not_json({ok("hello")});
    expect_clear_error<DistributedError>(not_json.endpoint(),
                                         "not an answer of etcd: not a JSON object: 'hello'");
  }
  {
    HostileEndpoint wrong_shape({ok("{\"kvs\":5}")});
    expect_clear_error<DistributedError>(wrong_shape.endpoint(), "'kvs' is not an array");
  }
  {
    HostileEndpoint bad_base64({ok("{\"kvs\":[{\"key\":\"!!!!\"}]}")});
    expect_clear_error<DistributedError>(bad_base64.endpoint(), "'key' is not base64");
  }
  {
    HostileEndpoint deep({ok(std::string(100000, '[') + std::string(100000, ']'))});
    expect_clear_error<DistributedError>(deep.endpoint(), "JSON nested more than 32 deep");
  }
  {
    HostileEndpoint error_status(
        {"HTTP/1.1 500 Internal\r\nContent-Length: 11\r\n\r\nbad\x01thing!!"});
    expect_clear_error<DistributedError>(error_status.endpoint(), "HTTP status 500: bad?thing!!");
  }
}

}  // namespace etcd_store_test
}  // namespace comm
}  // namespace distoptim
