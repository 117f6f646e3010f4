#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>

#include <distoptim/comm/store_wait.h>

namespace distoptim {
namespace comm {

/// Where this process stands in a job, as its launcher describes it in the environment. Read
/// once, by `from_environment`; the library reads no environment variable anywhere else.
struct LaunchEnv {
  std::optional<int> rank;
  std::optional<int> world_size;
  std::optional<int> local_rank;
  std::optional<int> local_world_size;
  std::optional<std::string> master_addr;
  std::optional<int> master_port;
  /// The init method "env://" stands for, when the launcher names one: an
  /// "etcd://HOST:PORT/JOB" (distrun --rdzv-backend etcd). It takes precedence over master_addr
  /// and master_port.
  std::optional<std::string> init_method;

  /// torchrun's and distrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
  /// MASTER_PORT; where RANK or WORLD_SIZE is unset, Open MPI's OMPI_COMM_WORLD_{RANK,SIZE,
  /// LOCAL_RANK,LOCAL_SIZE}, then SLURM's SLURM_{PROCID,NTASKS,LOCALID}; and distrun's
  /// DISTOPTIM_RDZV_INIT_METHOD (kInitMethodVariable) into init_method. A set variable that is
  /// not a whole number in range, or a DISTOPTIM_RDZV_INIT_METHOD that is not etcd://, throws
  /// c10::ValueError naming it.
  static LaunchEnv from_environment();

  /// The variable a launcher sets to name the store its ranks meet in, so that "env://" means
  /// it (distrun sets it to "etcd://HOST:PORT/JOB" under --rdzv-backend etcd).
  static constexpr const char* kInitMethodVariable = "DISTOPTIM_RDZV_INIT_METHOD";
};

/// How ranks find each other (torch.distributed's `init_method`, `rank`, `world_size`,
/// `timeout`). init_method is one of
///   "env://"            MASTER_ADDR / MASTER_PORT (and RANK / WORLD_SIZE unless given here);
///                       or, when the launcher set DISTOPTIM_RDZV_INIT_METHOD (LaunchEnv's
///                       init_method), the etcd://HOST:PORT/JOB it names, whatever MASTER_ADDR
///                       and MASTER_PORT say;
///   "tcp://HOST:PORT"   rank 0 serves the store on PORT, the others connect to HOST:PORT;
///   "file:///PATH"      a file every rank can reach (a fresh one per job);
///   "etcd://HOST:PORT/JOB"  the ranks meet in the etcd 3.4 at HOST:PORT, under
///                       "/distoptim/JOB/" (EtcdStore, etcd_store.h): no rank serves the store,
///                       so none is special. JOB is letters, digits, '.', '_' and '-', and must
///                       be fresh per run of a job (like a file://'s file): the keys of an
///                       earlier run under the same JOB are still there, and its claims would
///                       count against this one's.
/// rank and world_size of -1 mean "from the environment" (env:// only).
struct RendezvousOptions {
  /* implicit */ RendezvousOptions(std::string init_method = "env://")
      : init_method_(std::move(init_method)) {}
  TORCH_ARG(std::string, init_method);
  TORCH_ARG(int, rank) = -1;
  TORCH_ARG(int, world_size) = -1;
  /// How long to wait for every rank (and, for rank 0's peers, the store) to arrive.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(30);
  /// Keys of this rendezvous live under this prefix, so several rendezvous (a process group
  /// and an RPC agent) can share one store.
  TORCH_ARG(std::string, prefix) = "distoptim/default";
  /// Where this process stands if not read from the environment (tests, embedding launchers).
  TORCH_ARG(std::optional<LaunchEnv>, launch_env) = std::nullopt;
};

/// The outcome of a rendezvous: a key-value store every rank shares, and who is where.
struct Rendezvous {
  /// Keys under the rendezvous prefix. Every operation ends by a deadline (by default the
  /// rendezvous timeout) and names the store's host:port (or file) when it fails.
  c10::intrusive_ptr<DeadlineStore> store;
  int rank = -1;
  int world_size = 0;
  /// The host of every rank (its hostname), by rank.
  std::vector<std::string> hosts;
  /// This rank's position among the ranks on its own host, and how many those are.
  int local_rank = -1;
  int local_world_size = 0;
  /// The address ranks met at (tcp:// and env://), empty for file:// and etcd://.
  std::string master_addr;
  /// The address this host reaches master_addr from: the source address its kernel picks on
  /// the route there (its interface on the network the ranks met on). "127.0.0.1" when
  /// master_addr is a loopback address or empty (file://); for etcd://, the address this host
  /// reaches etcd from (or "127.0.0.1" when etcd is on loopback). What Gloo and the RPC agent
  /// listen on unless told otherwise, so that ranks on other hosts can reach them.
  std::string local_address;
  std::chrono::milliseconds timeout{0};
};

/// Meets the other ranks. Blocks until all `world_size` ranks have arrived or `timeout` passes.
/// Errors: c10::ValueError for a bad init_method, rank or world_size (named, with its value);
/// distoptim::TimeoutError naming the ranks that never arrived, or the store (host:port) that
/// could not be reached or stopped answering; distoptim::PeerLostError naming the store when its
/// connection breaks (rank 0 died; etcd went down during the rendezvous); c10::ValueError when two
/// processes claim one rank or ranks disagree on the world size. Bounded by `timeout` (a store that
/// stops answering just before it may add up to DeadlineStore::kMinAnswerTime). Thread safety: safe
/// to call from any thread; each call is independent.
Rendezvous rendezvous(const RendezvousOptions& options);

/// The rendezvous store alone, for a group whose size is not known (a dynamic rpc group): over
/// tcp:// and env:// rank 0 serves it (options.rank() must be given), the others connect to it;
/// over etcd:// every rank connects to etcd; each waits up to options.timeout() for the store to
/// come up (to answer); nobody waits for anyone else. Not file://. (env:// reads MASTER_ADDR and
/// MASTER_PORT, or the launcher's DISTOPTIM_RDZV_INIT_METHOD.) The result has world_size 0 and no
/// hosts. Errors: c10::ValueError for a bad init_method or rank, file://; TimeoutError naming the
/// store (host:port) when it cannot be reached; DistributedError when rank 0 cannot serve it.
Rendezvous open_store(const RendezvousOptions& options);

/// True when `host` names this machine's loopback ("localhost", 127.0.0.0/8, "::1").
bool is_loopback_address(const std::string& host);

}  // namespace comm
}  // namespace distoptim
