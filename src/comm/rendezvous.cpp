#include <distoptim/comm/rendezvous.h>

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <tuple>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <distoptim/comm/errors.h>
#include <distoptim/comm/etcd_store.h>
#include <distoptim/comm/store_round.h>
#include <distoptim/comm/store_wait.h>

#include "error_text.h"
#include "host_port.h"

namespace distoptim {
namespace comm {

namespace {

using Clock = std::chrono::steady_clock;
using detail::seconds_text;

// The value of environment variable `name` as an int in [min, max]; nullopt when unset.
std::optional<int> env_int(const char* name, int min, int max) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  TORCH_CHECK_VALUE(errno == 0 && *end == '\0' && value >= min && value <= max,
                    "environment variable ", name, " = '", text, "' is not a whole number in [",
                    min, ", ", max, "]");
  return static_cast<int>(value);
}

std::optional<std::string> env_string(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return std::nullopt;
  return std::string(text);
}

std::string this_hostname() {
  char name[HOST_NAME_MAX + 1] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

std::vector<uint8_t> to_bytes(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

std::string from_bytes(const std::vector<uint8_t>& bytes) {
  return std::string(bytes.begin(), bytes.end());
}

// Where a rank or world size that failed its check came from, for the message.
std::string source_text(bool given, bool in_environment, const char* variable) {
  if (given) return "";
  if (in_environment) return " (from the launcher's environment)";
  return c10::str(" (not given, and ", variable, " is unset)");
}

c10::intrusive_ptr<c10d::Store> connect_tcp_store(const std::string& host, int port, int rank,
                                                  int world_size,
                                                  std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(port);
  store_options.isServer = rank == 0;
  if (world_size > 0) store_options.numWorkers = static_cast<size_t>(world_size);
  // We wait for the ranks ourselves, so a timeout can name the ones missing.
  store_options.waitWorkers = false;
  store_options.timeout = timeout;
  // A process group and an RPC agent of one process may meet on the same address.
  store_options.multiTenant = true;
  // c10d reports socket failures as std::runtime_error, not c10::Error.
  if (rank == 0) {
    try {
      return c10::make_intrusive<c10d::TCPStore>(host, store_options);
    } catch (const std::exception& e) {
      DISTOPTIM_THROW(DistributedError, "rendezvous: rank 0 could not serve the store on ", host,
                      ":", port, ": ", c10::GetExceptionString(e));
    }
  }
  // LibTorch 1.13's client, refused while rank 0 is not listening yet, sleeps a whole second
  // before it tries again, and may give up whatever its timeout: first wait for rank 0's store
  // to listen (trying every 10 ms), then retry the client until our timeout has passed.
  const auto deadline = Clock::now() + timeout;
  detail::wait_until_listening(host, port, deadline);
  while (true) {
    try {
      store_options.timeout =
          std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                   std::chrono::milliseconds(1));
      return c10::make_intrusive<c10d::TCPStore>(host, store_options);
    } catch (const std::exception& e) {
      if (Clock::now() >= deadline) {
        DISTOPTIM_THROW(TimeoutError, "rendezvous: rank ", rank,
                        " could not reach rank 0's store at ", host, ":", port, " within ",
                        seconds_text(timeout), ": ", c10::GetExceptionString(e));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

// The address this host sends from to reach host:port: the kernel picks it (the address of the
// interface on the route there) when a UDP socket is connected, which sends nothing. The
// hostname is no guide: it often resolves to 127.0.1.1, or to an address on another network.
std::string source_address_toward(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int resolved = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  DISTOPTIM_CHECK_WITH(DistributedError, resolved == 0, "rendezvous: cannot resolve '", host,
                       "' to find the local address on its route: ", ::gai_strerror(resolved));
  const std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> addresses(found, ::freeaddrinfo);
  std::string why = "no address";
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    sockaddr_storage local{};
    socklen_t length = sizeof local;
    const bool found_route = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
                             ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0;
    if (!found_route) why = std::strerror(errno);
    ::close(fd);
    char text[NI_MAXHOST] = {};
    if (found_route && ::getnameinfo(reinterpret_cast<sockaddr*>(&local), length, text, sizeof text,
                                     nullptr, 0, NI_NUMERICHOST) == 0) {
      return text;
    }
  }
  DISTOPTIM_THROW(DistributedError, "rendezvous: no local address has a route to '", host,
                  "': ", why);
}

// Keys of the rendezvous protocol, under the rendezvous prefix. Each rank claims its rank (its
// arrival in the round, counted, so that two processes claiming one rank are seen), then
// announces itself; after reading everyone's announcement it marks itself done, and rank 0
// (which may serve the store) returns only when all are done. A rank that fails leaves, and
// rank 0 publishes its own failure and lingers until the others have left, so they fail with its
// message rather than with a lost connection to its store (StoreRound).
const std::string kClaimKey = "rdzv/claim/";
const std::string kArrivedKey = "rdzv/rank/";
const std::string kDoneKey = "rdzv/done/";
const std::string kLeftKey = "rdzv/left/";
const std::string kFailedKey = "rdzv/failed";
// How long rank 0 lingers after a failure for the others to see it.
constexpr auto kFailureGrace = std::chrono::seconds(2);

// Claims this rank, announces it, waits for all, and fills in `result` from what the ranks
// announced.
void meet(StoreRound& round, DeadlineStore& store, const std::string& method,
          Clock::time_point deadline, const std::string& context, Rendezvous& result) {
  const int rank = result.rank;
  const int world_size = result.world_size;
  const int64_t claims = round.arrive(deadline);
  TORCH_CHECK_VALUE(claims == 1, "rendezvous(", method, "): rank ", rank,
                    " is claimed by more than one process (", claims, " claims)");
  const std::string host = this_hostname();
  store.set(kArrivedKey + std::to_string(rank), to_bytes(std::to_string(world_size) + "\n" + host),
            deadline);
  round.await_all(deadline, "rendezvous", context, kArrivedKey);

  result.hosts.resize(world_size);
  for (int r = 0; r < world_size; ++r) {
    const std::string value = from_bytes(store.get(kArrivedKey + std::to_string(r), deadline));
    const size_t newline = value.find('\n');
    const std::string their_size = value.substr(0, newline);
    TORCH_CHECK_VALUE(newline != std::string::npos && their_size == std::to_string(world_size),
                      "rendezvous(", method, "): rank ", r, " has world_size ", their_size,
                      ", rank ", rank, " has ", world_size);
    result.hosts[r] = value.substr(newline + 1);
  }
  result.local_rank = static_cast<int>(
      std::count(result.hosts.begin(), result.hosts.begin() + rank, result.hosts[rank]));
  result.local_world_size =
      static_cast<int>(std::count(result.hosts.begin(), result.hosts.end(), result.hosts[rank]));

  store.set(kDoneKey + std::to_string(rank), to_bytes("1"), deadline);
  if (rank == 0) {
    round.await_all(deadline, "rendezvous", context + " for the other ranks to read the rendezvous",
                    kDoneKey);
  }
}

// After a failure of `meet` on this rank: leave; rank 0 also publishes the failure and waits
// (briefly) until every process that had claimed a rank has left (two may have claimed one).
// Never throws; when the store itself failed, its first operation fails at once (see
// DeadlineStore).
void announce_failure(StoreRound& round, const c10::Error& error) {
  const auto until = Clock::now() + kFailureGrace;
  try {
    round.leave(until);
  } catch (const std::exception&) {
    return;  // the store is gone too: nothing more to tell anyone
  }
  if (round.rank() != 0) return;
  round.publish_failure(RoundFailure::of(error).encode(), until);
}

}  // namespace

LaunchEnv LaunchEnv::from_environment() {
  LaunchEnv env;
  env.rank = env_int("RANK", 0, INT_MAX);
  env.world_size = env_int("WORLD_SIZE", 1, INT_MAX);
  env.local_rank = env_int("LOCAL_RANK", 0, INT_MAX);
  env.local_world_size = env_int("LOCAL_WORLD_SIZE", 1, INT_MAX);
  if (!env.rank || !env.world_size) {
    // Open MPI's mpirun, then SLURM's srun.
    if (auto rank = env_int("OMPI_COMM_WORLD_RANK", 0, INT_MAX)) {
      env.rank = rank;
      env.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1, INT_MAX);
      env.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0, INT_MAX);
      env.local_world_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1, INT_MAX);
    } else if (auto procid = env_int("SLURM_PROCID", 0, INT_MAX)) {
      env.rank = procid;
      env.world_size = env_int("SLURM_NTASKS", 1, INT_MAX);
      env.local_rank = env_int("SLURM_LOCALID", 0, INT_MAX);
    }
  }
  env.master_addr = env_string("MASTER_ADDR");
  env.master_port = env_int("MASTER_PORT", 1, 65535);
  env.init_method = env_string(kInitMethodVariable);
  TORCH_CHECK_VALUE(!env.init_method || env.init_method->rfind("etcd://", 0) == 0,
                    "environment variable ", kInitMethodVariable, " = '",
                    env.init_method.value_or(""), "' is not etcd://HOST:PORT/JOB");
  return env;
}

bool is_loopback_address(const std::string& host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

namespace {

// HOST, PORT and JOB of an etcd://HOST:PORT/JOB init_method, checked.
std::tuple<std::string, int, std::string> parse_etcd_method(const std::string& method) {
  const std::string rest = method.substr(std::string("etcd://").size());
  const size_t slash = rest.find('/');
  TORCH_CHECK_VALUE(slash != std::string::npos && slash + 1 < rest.size(),
                    "rendezvous: init_method '", method, "' names no job; expected ",
                    "etcd://HOST:PORT/JOB");
  const std::string subject = c10::str("rendezvous: init_method '", method, "'");
  auto [host, port] =
      detail::parse_host_port(rest.substr(0, slash), subject, "etcd://HOST:PORT/JOB");
  const std::string job = rest.substr(slash + 1);
  return {host, port, job};
}

// An EtcdStore for `job`, once etcd answers: it may be (re)starting when the ranks start, so a
// refused connection is tried again until `timeout` has passed, as a tcp:// rank does for rank
// 0's store.
c10::intrusive_ptr<c10d::Store> connect_etcd_store(const std::string& endpoint,
                                                   const std::string& job, int rank,
                                                   std::chrono::milliseconds timeout) {
  c10::intrusive_ptr<EtcdStore> store;
  try {
    store = c10::make_intrusive<EtcdStore>(EtcdStoreOptions(endpoint, job).timeout(timeout));
  } catch (const c10::ValueError& e) {
    TORCH_CHECK_VALUE(false, "rendezvous: init_method 'etcd://", endpoint, "/", job,
                      "': ", e.what_without_backtrace());
  }
  const auto deadline = Clock::now() + timeout;
  while (true) {
    try {
      store->getNumKeys();
      return store;
    } catch (const PeerLostError& e) {
      if (Clock::now() >= deadline) {
        DISTOPTIM_THROW(TimeoutError, "rendezvous: rank ", rank, " could not reach etcd at ",
                        endpoint, " within ", seconds_text(timeout), ": ",
                        e.what_without_backtrace());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
}

// The init method the ranks meet by: the one env:// stands for when the launcher named one
// (distrun --rdzv-backend etcd), else options.init_method().
std::string effective_method(const RendezvousOptions& options, const LaunchEnv& env) {
  const std::string& method = options.init_method();
  if (method.rfind("env://", 0) == 0 && env.init_method) return *env.init_method;
  return method;
}

// The store of a rendezvous by `method` (served by rank 0 over tcp:// and env://, kept in etcd by
// etcd://), wrapped with deadlines and the prefix, in `result` with the addresses; `world_size` 0
// for a group of unknown size.
void open_store_into(const RendezvousOptions& options, const std::string& method,
                     const LaunchEnv& env, int rank, int world_size, Rendezvous& result) {
  const bool is_tcp = method.rfind("tcp://", 0) == 0;
  const bool is_file = method.rfind("file://", 0) == 0;
  const bool is_etcd = method.rfind("etcd://", 0) == 0;
  result.rank = rank;
  result.world_size = world_size;
  result.timeout = options.timeout();
  c10::intrusive_ptr<c10d::Store> store;
  std::string address;
  if (is_file) {
    const std::string path = method.substr(std::string("file://").size());
    TORCH_CHECK_VALUE(!path.empty(), "rendezvous: init_method '", method, "' names no file");
    store = c10::make_intrusive<c10d::FileStore>(path, world_size);
    store->setTimeout(options.timeout());
    address = "file " + path;
    result.local_address = "127.0.0.1";
  } else if (is_etcd) {
    std::string host;
    int port = 0;
    std::string job;
    std::tie(host, port, job) = parse_etcd_method(method);
    const std::string endpoint = detail::host_port_text(host, port);
    store = connect_etcd_store(endpoint, job, rank, options.timeout());
    result.local_address =
        is_loopback_address(host) ? "127.0.0.1" : source_address_toward(host, port);
    address = c10::str("etcd ", endpoint, " (job ", job, ")");
  } else {
    std::string host;
    int port = 0;
    if (is_tcp) {
      std::tie(host, port) = detail::parse_host_port(
          method.substr(std::string("tcp://").size()),
          c10::str("rendezvous: init_method '", method, "'"), "tcp://HOST:PORT");
    } else {
      TORCH_CHECK_VALUE(env.master_addr.has_value(),
                        "rendezvous(env://): MASTER_ADDR is unset (rank ", rank, ")");
      TORCH_CHECK_VALUE(env.master_port.has_value(),
                        "rendezvous(env://): MASTER_PORT is unset (rank ", rank, ")");
      host = *env.master_addr;
      port = *env.master_port;
    }
    result.master_addr = host;
    store = connect_tcp_store(host, port, rank, world_size, options.timeout());
    result.local_address =
        is_loopback_address(host) ? "127.0.0.1" : source_address_toward(host, port);
    address = detail::host_port_text(host, port);
  }
  result.store = c10::make_intrusive<DeadlineStore>(
      c10::make_intrusive<c10d::PrefixStore>(options.prefix() + "/", store), address,
      options.timeout());
  if (!is_file && !is_etcd) {
    // LibTorch 1.13's TCPStore sets its socket's receive timeout to the timeout of a wait and
    // keeps it. After this wait for no keys (answered at once), no receive on the connection
    // blocks longer than the rendezvous timeout: an operation that DeadlineStore abandoned at
    // its deadline ends by then on its thread, even if the server never answers.
    try {
      result.store->wait({}, options.timeout());
    } catch (c10::Error& e) {
      e.add_context(c10::str("rendezvous(", method, "): rank ", rank, " was connecting"));
      throw;
    }
  }
}

void check_method(const RendezvousOptions& options) {
  const std::string& method = options.init_method();
  TORCH_CHECK_VALUE(options.timeout().count() > 0,
                    "rendezvous: timeout = ", options.timeout().count(), " ms; must be positive");
  TORCH_CHECK_VALUE(!options.prefix().empty(), "rendezvous: prefix must not be empty");
  TORCH_CHECK_VALUE(method.rfind("env://", 0) == 0 || method.rfind("tcp://", 0) == 0 ||
                        method.rfind("file://", 0) == 0 || method.rfind("etcd://", 0) == 0,
                    "rendezvous: init_method '", method,
                    "' is not env://, tcp://HOST:PORT, file:///PATH or etcd://HOST:PORT/JOB");
}

}  // namespace

Rendezvous open_store(const RendezvousOptions& options) {
  check_method(options);
  const std::string& method = options.init_method();
  TORCH_CHECK_VALUE(method.rfind("file://", 0) != 0, "open_store: init_method '", method,
                    "': a group of unknown size meets through tcp://, env:// (rank 0 serves "
                    "the store) or etcd://");
  TORCH_CHECK_VALUE(options.rank() >= 0, "open_store(", method, "): rank = ", options.rank(),
                    "; must be given, at least 0");
  const LaunchEnv env =
      options.launch_env() ? *options.launch_env() : LaunchEnv::from_environment();
  Rendezvous result;
  open_store_into(options, effective_method(options, env), env, options.rank(), 0, result);
  return result;
}

Rendezvous rendezvous(const RendezvousOptions& options) {
  check_method(options);
  // Rank and world size: given, else from the launcher's environment.
  const LaunchEnv env =
      options.launch_env() ? *options.launch_env() : LaunchEnv::from_environment();
  const std::string method = effective_method(options, env);
  const int rank = options.rank() >= 0 ? options.rank() : env.rank.value_or(-1);
  const int world_size =
      options.world_size() >= 0 ? options.world_size() : env.world_size.value_or(-1);
  TORCH_CHECK_VALUE(
      world_size >= 1, "rendezvous(", method, "): world_size = ", world_size,
      source_text(options.world_size() >= 0, env.world_size.has_value(), "WORLD_SIZE"),
      "; must be at least 1");
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size, "rendezvous(", method, "): rank = ", rank,
                    source_text(options.rank() >= 0, env.rank.has_value(), "RANK"),
                    "; must be in [0, ", world_size, ")");

  Rendezvous result;
  open_store_into(options, method, env, rank, world_size, result);
  const auto deadline = Clock::now() + options.timeout();
  const std::string context = c10::str("rendezvous(", method, "): rank ", rank, " of ", world_size,
                                       " waited ", seconds_text(options.timeout()));
  StoreRound round(*result.store, StoreRound::Keys{kClaimKey, kFailedKey, kLeftKey}, rank,
                   world_size);
  try {
    meet(round, *result.store, method, deadline, context, result);
  } catch (const c10::Error& e) {
    announce_failure(round, e);
    throw;
  }
  return result;
}

}  // namespace comm
}  // namespace distoptim
