// StoreServer (store_server.h): one thread polls the listening socket, every client and a
// wake-up eventfd. A client's bytes gather in its own buffer until a whole query has come; the
// query is then answered into the client's output buffer, sent as the socket takes it. Nothing
// here blocks on one client. A wait is answered once its keys are all set, by whichever query
// sets the last of them. The queries and their parsing: store_protocol.h.

#include <distoptim/comm/store_server.h>

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <vector>

#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>

#include "store_protocol.h"

namespace distoptim {
namespace comm {

namespace {

using Clock = std::chrono::steady_clock;
using detail::Parse;
using detail::Query;

// What a held key costs beyond its bytes, for max_stored_bytes.
constexpr size_t kKeyOverhead = 64;
// The most bytes read from one client per wake-up, so each client gets its turn.
constexpr size_t kReceiveChunk = 64 * 1024;
// How long the server stops accepting when it runs out of descriptors.
constexpr auto kAcceptPause = std::chrono::milliseconds(100);

void check_bound(size_t value, const char* name) {
  TORCH_CHECK_VALUE(value > 0, "StoreServer: ", name, " is 0; it must be at least 1");
}

}  // namespace

class StoreServer::Loop {
 public:
  explicit Loop(const StoreServerOptions& options) : options_(options) {
    TORCH_CHECK_VALUE(options.port >= 0 && options.port <= 65535, "StoreServer: port ",
                      options.port, " is outside 0..65535");
    check_bound(options.max_key_bytes, "max_key_bytes");
    check_bound(options.max_value_bytes, "max_value_bytes");
    check_bound(options.max_keys_per_query, "max_keys_per_query");
    check_bound(options.max_stored_bytes, "max_stored_bytes");
    check_bound(options.max_buffered_bytes, "max_buffered_bytes");
    check_bound(options.max_clients, "max_clients");
    TORCH_CHECK_VALUE(options.query_timeout.count() > 0, "StoreServer: query_timeout is ",
                      options.query_timeout.count(), " ms; it must be positive");
    listen_fd_ = listen_on(options.port);
    wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_fd_ < 0) {
      const int error = errno;
      ::close(listen_fd_);
      DISTOPTIM_THROW(DistributedError, "StoreServer: eventfd failed: ", std::strerror(error));
    }
    thread_ = std::thread([this] { run(); });
  }

  ~Loop() {
    stopping_.store(true);
    const uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof one);
    thread_.join();
    for (auto& entry : clients_) ::close(entry.second.fd);
    ::close(listen_fd_);
    ::close(wake_fd_);
  }

  int port() const { return port_; }

  StoreServerCounts counts() const {
    StoreServerCounts c;
    c.connections_accepted = accepted_.load();
    c.connections_refused = refused_.load();
    c.clients_dropped = dropped_.load();
    c.queries_answered = answered_.load();
    const std::lock_guard<std::mutex> lock(last_drop_mutex_);
    c.last_drop = last_drop_;
    return c;
  }

 private:
  struct Client {
    uint64_t id = 0;
    int fd = -1;
    std::string in;   // bytes received and not yet answered
    std::string out;  // answers not yet sent, from out_sent on
    size_t out_sent = 0;
    Clock::time_point query_started;  // when `in` last became non-empty
    // A wait whose keys are not all set yet: how many are missing, and which (for clean-up).
    size_t missing = 0;
    std::vector<std::string> awaited;
    bool closing = false;
  };

  int listen_on(int port) {
    // Every address: IPv6 with IPv4 mapped into it, or IPv4 alone where IPv6 is off.
    int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    sockaddr_storage address{};
    socklen_t length = 0;
    if (fd >= 0) {
      const int off = 0;
      (void)::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off);
      auto* in6 = reinterpret_cast<sockaddr_in6*>(&address);
      in6->sin6_family = AF_INET6;
      in6->sin6_addr = in6addr_any;
      in6->sin6_port = htons(static_cast<uint16_t>(port));
      length = sizeof *in6;
    } else {
      fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      auto* in4 = reinterpret_cast<sockaddr_in*>(&address);
      in4->sin_family = AF_INET;
      in4->sin_addr.s_addr = htonl(INADDR_ANY);
      in4->sin_port = htons(static_cast<uint16_t>(port));
      length = sizeof *in4;
    }
    if (fd < 0) {
      DISTOPTIM_THROW(DistributedError, "StoreServer: cannot make a socket for port ", port, ": ",
                      std::strerror(errno));
    }
    const int on = 1;
    (void)::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
        ::listen(fd, SOMAXCONN) != 0) {
      const int error = errno;
      ::close(fd);
      DISTOPTIM_THROW(DistributedError, "StoreServer: cannot listen on port ", port, ": ",
                      std::strerror(error));
    }
    sockaddr_storage bound{};
    socklen_t bound_length = sizeof bound;
    (void)::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &bound_length);
    port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    return fd;
  }

  void run() {
    std::vector<pollfd> polled;
    std::vector<uint64_t> ids;
    while (!stopping_.load()) {
      polled.clear();
      ids.clear();
      polled.push_back({wake_fd_, POLLIN, 0});
      // While accepting is paused the listening socket is left out (a negative descriptor is
      // skipped by poll), or its queued connection would wake poll at once, again and again.
      const bool accepting = Clock::now() >= accept_paused_until_;
      polled.push_back({accepting ? listen_fd_ : -1, POLLIN, 0});
      for (auto& [id, client] : clients_) {
        const bool unsent = client.out.size() > client.out_sent;
        polled.push_back({client.fd, static_cast<short>(POLLIN | (unsent ? POLLOUT : 0)), 0});
        ids.push_back(id);
      }
      const int ready = ::poll(polled.data(), polled.size(), poll_timeout_ms());
      if (stopping_.load()) break;
      // poll fails only for want of memory (EINTR aside): a while later the loop tries again.
      if (ready < 0 && errno != EINTR) std::this_thread::sleep_for(kAcceptPause);
      if (ready > 0) {
        if (polled[1].revents != 0) accept_clients();
        for (size_t i = 0; i < ids.size(); ++i) {
          const short events = polled[i + 2].revents;
          if (events == 0) continue;
          Client& client = clients_.at(ids[i]);
          if ((events & (POLLIN | POLLHUP | POLLERR)) != 0) receive(client);
          if (!client.closing && (events & POLLOUT) != 0) send_answers(client);
        }
      }
      answer_woken();
      drop_stalled();
      reap();
    }
  }

  // Until the earliest deadline of a partial query, at most a second.
  int poll_timeout_ms() const {
    auto wait = std::chrono::milliseconds(1000);
    const auto now = Clock::now();
    if (now < accept_paused_until_) wait = kAcceptPause;
    for (const auto& entry : clients_) {
      const Client& client = entry.second;
      if (client.in.empty() || client.missing > 0) continue;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          client.query_started + options_.query_timeout - now);
      wait = std::min(wait,
                      std::max(left + std::chrono::milliseconds(1), std::chrono::milliseconds(0)));
    }
    return static_cast<int>(wait.count());
  }

  void accept_clients() {
    while (true) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        // Out of descriptors or memory: the pending connection stays queued, and the listening
        // socket would wake poll at once again; try later.
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          accept_paused_until_ = Clock::now() + kAcceptPause;
        }
        return;  // EAGAIN, or a connection reset before it was accepted
      }
      if (clients_.size() >= options_.max_clients) {
        ++refused_;  // before the close, which a client may see at once
        ::close(fd);
        continue;
      }
      keep_alive(fd);
      Client client;
      client.id = next_id_++;
      client.fd = fd;
      clients_.emplace(client.id, std::move(client));
      ++accepted_;
    }
  }

  // Answers go out at once; and a client whose host or link went away for good (it never
  // closed its connection) is found by keepalive probes within about 45 s and its connection
  // closed, rather than held until max_clients are.
  static void keep_alive(int fd) {
    const int on = 1;
    const int idle_s = 30, interval_s = 5, probes = 3;
    const unsigned int unacknowledged_ms = 45000;
    (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
    (void)::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
    (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof idle_s);
    (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof interval_s);
    (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes);
    (void)::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &unacknowledged_ms,
                       sizeof unacknowledged_ms);
  }

  void receive(Client& client) {
    char chunk[kReceiveChunk];
    const ssize_t got = ::recv(client.fd, chunk, sizeof chunk, 0);
    if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) {
      client.closing = true;  // the client closed or its connection broke
      return;
    }
    if (got < 0) return;
    const auto n = static_cast<size_t>(got);
    if (buffered_ + n > options_.max_buffered_bytes) return drop(client, budget_spent());
    if (client.in.empty()) client.query_started = Clock::now();
    client.in.append(chunk, n);
    buffered_ += n;
    answer_queries(client);
    const size_t longest = detail::max_query_bytes(options_);
    if (!client.closing && client.in.size() > longest) {
      drop(client, c10::str("a query longer than ", longest, " bytes"));
    }
  }

  // Answers the whole queries at the front of the client's input, in order; a wait not yet
  // answered holds the ones behind it.
  void answer_queries(Client& client) {
    size_t consumed = 0;
    while (!client.closing && client.missing == 0) {
      const std::string_view rest = std::string_view(client.in).substr(consumed);
      detail::QueryParser parser(rest, options_);
      detail::WholeQuery query;
      std::string why;
      const Parse parsed = parser.parse(query, why);
      if (parsed == Parse::kPartial) break;
      if (parsed == Parse::kWhole) why = answer(client, query);
      if (!why.empty()) return drop(client, why);
      consumed += parser.consumed();
      if (client.missing == 0) ++answered_;  // a wait is counted when it is answered
    }
    if (consumed == 0) return;
    client.in.erase(0, consumed);
    buffered_ -= consumed;
    if (!client.in.empty()) client.query_started = Clock::now();
    send_answers(client);
  }

  // Applies one query, or says why it cannot be (the client is then dropped, the store as it
  // was).
  std::string answer(Client& client, const detail::WholeQuery& query) {
    std::string reply;
    switch (query.type) {
      case Query::kSet:
        return put(std::string(query.keys[0]), std::string(query.value));  // not answered
      case Query::kCompareSet: {
        const std::string key(query.keys[0]);
        const auto found = store_.find(key);
        if (found == store_.end() ? query.value.empty() : found->second == query.value) {
          if (auto why = put(key, std::string(query.desired)); !why.empty()) return why;
          detail::append_bytes(reply, query.desired);
        } else {
          detail::append_bytes(reply, found == store_.end() ? query.value : found->second);
        }
        break;
      }
      case Query::kGet: {
        // LibTorch's client waits for a key before it gets it: a get of a key not held is not
        // one of its queries.
        const auto found = store_.find(std::string(query.keys[0]));
        if (found == store_.end()) return c10::str("a get of '", query.keys[0], "', not held");
        detail::append_bytes(reply, found->second);
        break;
      }
      case Query::kAdd: {
        const std::string key(query.keys[0]);
        int64_t total = 0;
        if (const auto found = store_.find(key); found != store_.end()) {
          const std::string& text = found->second;
          const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), total);
          if (error != std::errc() || end != text.data() + text.size()) {
            return c10::str("an add to '", key, "', which holds no number");
          }
        }
        if (__builtin_add_overflow(total, query.delta, &total)) {
          return c10::str("an add of ", query.delta, " to '", key, "' past a 64-bit integer");
        }
        if (auto why = put(key, std::to_string(total)); !why.empty()) return why;
        detail::append_u64(reply, static_cast<uint64_t>(total));
        break;
      }
      case Query::kCheck: {
        const bool all = std::all_of(query.keys.begin(), query.keys.end(), [this](auto key) {
          return store_.count(std::string(key)) > 0;
        });
        reply.push_back(static_cast<char>(all ? detail::kReady : detail::kNotReady));
        break;
      }
      case Query::kWait:
        for (const std::string_view key : query.keys) {
          if (store_.count(std::string(key)) > 0) continue;
          client.awaited.emplace_back(key);
          ++client.missing;
        }
        if (client.missing > 0) {
          for (const auto& key : client.awaited) waiters_[key].push_back(client.id);
          return "";  // answered when the last key is set
        }
        reply.push_back(static_cast<char>(detail::kStopWaiting));
        break;
      case Query::kNumKeys:
        detail::append_u64(reply, store_.size());
        break;
      case Query::kDeleteKey: {
        const auto found = store_.find(std::string(query.keys[0]));
        uint64_t deleted = 0;
        if (found != store_.end()) {
          stored_ -= found->first.size() + found->second.size() + kKeyOverhead;
          store_.erase(found);
          deleted = 1;
        }
        detail::append_u64(reply, deleted);
        break;
      }
      case Query::kWatchKey:
        return "a watch, which this server does not serve";  // the parser refuses it first
    }
    queue_answer(client, reply);
    return "";
  }

  // Holds key = value within max_stored_bytes, and answers the waits it completes; or says why
  // it cannot.
  std::string put(const std::string& key, std::string value) {
    const auto found = store_.find(key);
    const size_t before =
        found == store_.end() ? 0 : key.size() + found->second.size() + kKeyOverhead;
    const size_t after = key.size() + value.size() + kKeyOverhead;
    if (stored_ - before + after > options_.max_stored_bytes) {
      return c10::str("a set of '", key, "' past max_stored_bytes (", options_.max_stored_bytes,
                      ")");
    }
    stored_ = stored_ - before + after;
    if (found != store_.end()) {
      found->second = std::move(value);
      return "";
    }
    store_.emplace(key, std::move(value));
    const auto waiting = waiters_.find(key);
    if (waiting == waiters_.end()) return "";
    const std::vector<uint64_t> ids = std::move(waiting->second);
    waiters_.erase(waiting);
    for (const uint64_t id : ids) {
      const auto it = clients_.find(id);
      if (it == clients_.end() || it->second.closing || it->second.missing == 0) continue;
      Client& waiter = it->second;
      if (--waiter.missing > 0) continue;
      waiter.awaited.clear();
      ++answered_;
      // Its answer and the queries it sent behind the wait are seen to by the loop
      // (answer_woken), not here in the middle of another client's query.
      if (queue_answer(waiter, std::string(1, static_cast<char>(detail::kStopWaiting)))) {
        woken_.push_back(id);
      }
    }
    return "";
  }

  // Sends the answers of waits completed since the last call and answers the queries behind
  // them (which may complete more waits).
  void answer_woken() {
    while (!woken_.empty()) {
      const uint64_t id = woken_.back();
      woken_.pop_back();
      const auto it = clients_.find(id);
      if (it == clients_.end() || it->second.closing) continue;
      answer_queries(it->second);
      send_answers(it->second);
    }
  }

  bool queue_answer(Client& client, const std::string& reply) {
    if (buffered_ + reply.size() > options_.max_buffered_bytes) {
      drop(client, budget_spent());
      return false;
    }
    client.out += reply;
    buffered_ += reply.size();
    return true;
  }

  void send_answers(Client& client) {
    if (client.closing) return;  // reap() accounts for what is left unsent
    while (client.out.size() > client.out_sent) {
      const ssize_t sent = ::send(client.fd, client.out.data() + client.out_sent,
                                  client.out.size() - client.out_sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (sent < 0) {
        if (errno == EAGAIN || errno == EINTR) return;  // the rest on POLLOUT
        client.closing = true;
        return;
      }
      client.out_sent += static_cast<size_t>(sent);
      buffered_ -= static_cast<size_t>(sent);
    }
    client.out.clear();
    client.out_sent = 0;
  }

  std::string budget_spent() const {
    return c10::str("its bytes would pass max_buffered_bytes (", options_.max_buffered_bytes,
                    ") with those of every client");
  }

  void drop(Client& client, const std::string& why) {
    if (client.closing) return;
    client.closing = true;
    ++dropped_;
    const std::lock_guard<std::mutex> lock(last_drop_mutex_);
    last_drop_ = why;
  }

  void drop_stalled() {
    const auto now = Clock::now();
    for (auto& entry : clients_) {
      Client& client = entry.second;
      if (!client.in.empty() && client.missing == 0 &&
          now - client.query_started >= options_.query_timeout) {
        drop(client, c10::str("a query begun more than ", options_.query_timeout.count(),
                              " ms ago (query_timeout) and not yet whole"));
      }
    }
  }

  // Closes the connections marked closing and forgets what they held.
  void reap() {
    for (auto it = clients_.begin(); it != clients_.end();) {
      Client& client = it->second;
      if (!client.closing) {
        ++it;
        continue;
      }
      for (const auto& key : client.awaited) {
        const auto waiting = waiters_.find(key);
        if (waiting == waiters_.end()) continue;
        auto& ids = waiting->second;
        ids.erase(std::remove(ids.begin(), ids.end(), it->first), ids.end());
        if (ids.empty()) waiters_.erase(waiting);
      }
      buffered_ -= client.in.size() + (client.out.size() - client.out_sent);
      ::close(client.fd);
      it = clients_.erase(it);
    }
  }

  const StoreServerOptions options_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
  // Owned by the thread.
  std::map<uint64_t, Client> clients_;
  uint64_t next_id_ = 0;
  std::unordered_map<std::string, std::string> store_;
  std::unordered_map<std::string, std::vector<uint64_t>> waiters_;
  std::vector<uint64_t> woken_;
  Clock::time_point accept_paused_until_;
  size_t stored_ = 0;
  size_t buffered_ = 0;
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> dropped_{0};
  std::atomic<uint64_t> answered_{0};
  mutable std::mutex last_drop_mutex_;
  std::string last_drop_;
};

StoreServer::StoreServer(const StoreServerOptions& options)
    : loop_(std::make_unique<Loop>(options)) {}

StoreServer::~StoreServer() = default;

int StoreServer::port() const { return loop_->port(); }

StoreServerCounts StoreServer::counts() const { return loop_->counts(); }

}  // namespace comm
}  // namespace distoptim
