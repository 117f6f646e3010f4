// StoreServer: LibTorch 1.13's TCPStore client gets the answers LibTorch's own server gives; a
// client that stalls in the middle of a query delays no one (LibTorch's server stops for every
// client then); and hostile bytes (unknown queries, huge lengths, stalled or unread clients,
// connect-and-close, too many connections) close that one connection and leave the store and
// the listener as they were.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <distoptim/comm.h>

#include "support/wait_until.h"

namespace distoptim {
namespace comm {
namespace store_server_test {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using distoptim::testing::wait_until;

std::vector<uint8_t> bytes_of(const std::string& text) { return {text.begin(), text.end()}; }
std::string text_of(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }

c10::intrusive_ptr<c10d::TCPStore> client_of(int port) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(port);
  options.isServer = false;
  options.waitWorkers = false;
  options.timeout = 20s;
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", options);
}

// A connection that sends what the test writes, byte for byte.
class RawClient {
 public:
  explicit RawClient(int port) : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof address), 0)
        << std::strerror(errno);
  }
  ~RawClient() { ::close(fd_); }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  RawClient& byte(uint8_t value) { return put(&value, 1); }
  RawClient& number(uint64_t value) { return put(&value, sizeof value); }
  RawClient& field(const std::string& text) {
    number(text.size());
    return put(text.data(), text.size());
  }
  // A send may fail once the server has closed the connection on a hostile query: what counts
  // is closed_by_server.
  RawClient& put(const void* data, size_t size) {
    (void)::send(fd_, data, size, MSG_NOSIGNAL);
    return *this;
  }

  // Whether the server closed this connection within `limit` (what it sent before is read and
  // discarded).
  bool closed_by_server(std::chrono::milliseconds limit) {
    const auto until = Clock::now() + limit;
    char sink[4096];
    while (Clock::now() < until) {
      pollfd polled{fd_, POLLIN, 0};
      if (::poll(&polled, 1, 50) <= 0) continue;
      const ssize_t got = ::recv(fd_, sink, sizeof sink, 0);
      if (got <= 0) return true;
    }
    return false;
  }

 private:
  int fd_;
};

// The query types of LibTorch 1.13's protocol.
constexpr uint8_t kSet = 0, kGet = 2, kAdd = 3, kCheck = 4, kWait = 5, kWatchKey = 7;

// The key LibTorch's client sends for `key`: it puts "/" before every key.
std::string wire_key(const std::string& key) { return "/" + key; }

// The same operations through LibTorch's client, answered by `port`'s server, as text.
std::vector<std::string> run_operations(int port) {
  auto store = client_of(port);
  std::vector<std::string> seen;
  store->set("a", bytes_of("1"));
  seen.push_back(text_of(store->get("a")));
  seen.push_back(std::to_string(store->add("n", 5)));
  seen.push_back(std::to_string(store->add("n", -7)));
  seen.push_back(text_of(store->get("n")));
  seen.push_back(text_of(store->compareSet("a", bytes_of("1"), bytes_of("2"))));
  seen.push_back(text_of(store->compareSet("a", bytes_of("x"), bytes_of("3"))));
  seen.push_back(text_of(store->compareSet("fresh", {}, bytes_of("v"))));
  seen.push_back(text_of(store->compareSet("absent", bytes_of("x"), bytes_of("y"))));
  seen.push_back(std::to_string(store->check({"a", "n", "fresh"})));
  seen.push_back(std::to_string(store->check({"a", "absent"})));
  seen.push_back(std::to_string(store->getNumKeys()));
  seen.push_back(std::to_string(store->deleteKey("a")));
  seen.push_back(std::to_string(store->deleteKey("a")));
  seen.push_back(std::to_string(store->check({"a"})));
  seen.push_back(std::to_string(store->getNumKeys()));
  std::string big(300000, 'b');
  for (size_t i = 0; i < big.size(); i += 7) big[i] = static_cast<char>(i);
  store->set("big", bytes_of(big));
  seen.push_back(text_of(store->get("big")) == big ? "big intact" : "big differs");
  store->wait({"n", "fresh"}, 5s);
  seen.push_back("waited");
  return seen;
}

TEST(StoreServer, AnswersAsLibTorchsOwnServer) {
  c10d::TCPStoreOptions options;
  options.port = 0;
  options.isServer = true;
  options.waitWorkers = false;
  options.timeout = 20s;
  c10d::TCPStore libtorch_server("127.0.0.1", options);
  const auto expected = run_operations(libtorch_server.getPort());

  StoreServer server(StoreServerOptions{});
  EXPECT_EQ(run_operations(server.port()), expected);
  EXPECT_EQ(server.counts().clients_dropped, 0u);
}

TEST(StoreServer, AWaitIsAnsweredOnceItsLastKeyIsSet) {
  StoreServer server(StoreServerOptions{});
  auto setter = client_of(server.port());
  setter->set("first", bytes_of("1"));
  std::thread waiter([port = server.port()] {
    // Whether its wait arrives before or after the last key is set, it must end: both routes
    // (answered at once, answered by the set) give the same outcome, which is what is asserted.
    auto store = client_of(port);
    store->wait({"first", "second", "second"}, 20s);
    store->set("waiter done", bytes_of("1"));
  });
  setter->set("second", bytes_of("2"));
  setter->wait({"waiter done"}, 20s);
  waiter.join();
  // A wait for a key no one sets ends at its client's timeout, naming no answer.
  EXPECT_THROW(setter->wait({"never"}, 200ms), std::exception);
}

TEST(StoreServer, AClientStalledInAQueryDelaysNoOne) {
  StoreServer server(StoreServerOptions{});
  auto store = client_of(server.port());
  // The first bytes of a set (its type and its key's length), then nothing: as a client whose
  // link went down between two of its writes. LibTorch's server would now wait for the rest.
  RawClient stalled(server.port());
  stalled.byte(kSet).number(wire_key("late").size());
  store->set("k", bytes_of("v"));
  EXPECT_EQ(text_of(store->get("k")), "v");
  EXPECT_EQ(store->add("count", 1), 1);
  // The rest comes: the set is whole and applied.
  stalled.put(wire_key("late").data(), wire_key("late").size()).field("value");
  store->wait({"late"}, 20s);
  EXPECT_EQ(text_of(store->get("late")), "value");
  EXPECT_EQ(server.counts().clients_dropped, 0u);
}

// One malformed or out-of-bounds query on a connection of its own: the server closes that
// connection, counts one client dropped for the reason `why`, and the store is as it was.
void expect_dropped_alone(StoreServer& server, const std::function<void(RawClient&)>& send,
                          const std::string& why) {
  SCOPED_TRACE(why);
  auto store = client_of(server.port());
  const auto keys_before = store->getNumKeys();
  const auto dropped_before = server.counts().clients_dropped;
  RawClient hostile(server.port());
  send(hostile);
  EXPECT_TRUE(hostile.closed_by_server(20000ms));
  EXPECT_EQ(server.counts().clients_dropped, dropped_before + 1);
  EXPECT_EQ(server.counts().last_drop, why);
  EXPECT_EQ(store->getNumKeys(), keys_before);
  EXPECT_EQ(text_of(store->get("kept")), "kept value");
}

TEST(StoreServer, HostileQueriesCloseTheirConnectionAndChangeNothing) {
  StoreServerOptions options;
  options.max_key_bytes = 64;
  options.max_value_bytes = 1024;
  options.max_keys_per_query = 8;
  options.max_stored_bytes = 4096;
  StoreServer server(options);
  // A set is not answered: a wait on what it set says it is held.
  auto setter = client_of(server.port());
  setter->set("kept", bytes_of("kept value"));
  setter->set("text", bytes_of("not a number"));
  setter->wait({"kept", "text"});

  expect_dropped_alone(
      server, [](RawClient& c) { c.byte(200); }, "a query of unknown or unsupported type 200");
  expect_dropped_alone(
      server, [](RawClient& c) { c.byte(kWatchKey).field(wire_key("kept")); },
      "a query of unknown or unsupported type 7");
  expect_dropped_alone(
      server, [](RawClient& c) { c.byte(kSet).number(uint64_t{1} << 62); },
      "a key of 4611686018427387904 bytes (at most 64)");
  expect_dropped_alone(
      server, [](RawClient& c) { c.byte(kSet).field(std::string(65, 'k')); },
      "a key of 65 bytes (at most 64)");
  expect_dropped_alone(
      server, [](RawClient& c) { c.byte(kSet).field("k").number(1025); },
      "a value of 1025 bytes (at most 1024)");
  expect_dropped_alone(
      server, [](RawClient& c) { c.byte(kCheck).number(uint64_t{1} << 40); },
      "a query of 1099511627776 keys (at most 8)");
  expect_dropped_alone(
      server, [](RawClient& c) { c.byte(kWait).number(9); }, "a query of 9 keys (at most 8)");
  expect_dropped_alone(
      server, [](RawClient& c) { c.byte(kGet).field(wire_key("absent")); },
      "a get of '/absent', not held");
  expect_dropped_alone(
      server, [](RawClient& c) { c.byte(kAdd).field(wire_key("text")).number(1); },
      "an add to '/text', which holds no number");
  setter->set("largest", bytes_of(std::to_string(INT64_MAX)));
  setter->wait({"largest"});
  expect_dropped_alone(
      server, [](RawClient& c) { c.byte(kAdd).field(wire_key("largest")).number(1); },
      "an add of 1 to '/largest' past a 64-bit integer");
  // max_stored_bytes (4096) holds three values of 1000 bytes beside the keys above, not four.
  for (const char* key : {"v1", "v2", "v3"}) {
    setter->set(key, std::vector<uint8_t>(1000, 1));
  }
  setter->wait({"v1", "v2", "v3"});
  expect_dropped_alone(
      server,
      [](RawClient& c) { c.byte(kSet).field(wire_key("v4")).field(std::string(1000, 'v')); },
      "a set of '/v4' past max_stored_bytes (4096)");
}

TEST(StoreServer, AStalledQueryIsDroppedAfterItsTimeout) {
  StoreServerOptions options;
  options.query_timeout = 200ms;
  StoreServer server(options);
  RawClient stalled(server.port());
  stalled.byte(kSet).number(3).put("ab", 2);
  EXPECT_TRUE(stalled.closed_by_server(20000ms));
  EXPECT_EQ(server.counts().clients_dropped, 1u);
  EXPECT_EQ(server.counts().last_drop,
            "a query begun more than 200 ms ago (query_timeout) and not yet whole");
  // A client that sends nothing holds no query, and is kept.
  RawClient idle(server.port());
  EXPECT_FALSE(idle.closed_by_server(600ms));
}

TEST(StoreServer, ConnectAndCloseLeavesTheListener) {
  StoreServer server(StoreServerOptions{});
  for (int i = 0; i < 200; ++i) {
    RawClient passing(server.port());
    if (i % 2 == 1) passing.byte(kGet);  // and some leave half a query behind
  }
  auto store = client_of(server.port());
  store->set("after", bytes_of("1"));
  EXPECT_EQ(text_of(store->get("after")), "1");
  EXPECT_TRUE(wait_until([&] { return server.counts().connections_accepted >= 201; }, 20000ms));
}

TEST(StoreServer, ConnectionsBeyondMaxClientsAreClosed) {
  StoreServerOptions options;
  options.max_clients = 3;
  StoreServer server(options);
  std::vector<std::unique_ptr<RawClient>> held;
  for (int i = 0; i < 3; ++i) held.push_back(std::make_unique<RawClient>(server.port()));
  ASSERT_TRUE(wait_until([&] { return server.counts().connections_accepted == 3; }, 20000ms));
  RawClient extra(server.port());
  EXPECT_TRUE(extra.closed_by_server(20000ms));
  EXPECT_EQ(server.counts().connections_refused, 1u);
  for (const auto& client : held) EXPECT_FALSE(client->closed_by_server(50ms));
}

TEST(StoreServer, AClientThatNeverReadsItsAnswersIsDropped) {
  StoreServerOptions options;
  options.max_value_bytes = 256 * 1024;
  options.max_buffered_bytes = 1024 * 1024;
  StoreServer server(options);
  auto store = client_of(server.port());
  store->set("large", std::vector<uint8_t>(options.max_value_bytes, 7));
  store->wait({"large"});  // a set is not answered: held once a wait on it is
  RawClient greedy(server.port());
  // 200 gets of 256 KiB, 50 MiB of answers: more than the kernel's socket buffers and the
  // server's budget hold.
  for (int i = 0; i < 200; ++i) greedy.byte(kGet).field(wire_key("large"));
  EXPECT_TRUE(wait_until([&] { return server.counts().clients_dropped == 1; }, 20000ms));
  EXPECT_EQ(server.counts().last_drop,
            "its bytes would pass max_buffered_bytes (1048576) with those of every client");
  EXPECT_EQ(store->get("large").size(), options.max_value_bytes);
}

TEST(StoreServer, BadOptionsAndABusyPortAreNamed) {
  StoreServerOptions options;
  options.port = 70000;
  try {
    StoreServer server(options);
    FAIL() << "port 70000 was taken";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("port 70000 is outside 0..65535"), std::string::npos)
        << e.what();
  }
  options.port = 0;
  options.max_clients = 0;
  EXPECT_THROW(StoreServer{options}, c10::ValueError);
  StoreServer first(StoreServerOptions{});
  options = StoreServerOptions{};
  options.port = first.port();
  try {
    StoreServer second(options);
    FAIL() << "two servers listened on port " << options.port;
  } catch (const DistributedError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot listen on port " + std::to_string(options.port)),
              std::string::npos)
        << e.what();
  }
}

}  // namespace store_server_test
}  // namespace comm
}  // namespace distoptim
