#pragma once

// distrun's options: parsing and validating its command line, and the environment each rank
// gets.

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace distoptim {
namespace launcher {

/// distrun's exit status for a bad command line.
constexpr int kUsageExitCode = 2;

/// A bad command line or option value. The message names the option and the value given.
class UsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// Thrown by parse_command_line for --help; what() is the help text.
class HelpRequested : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Which ranks a failure restarts (with max_restarts > 0).
enum class RestartPolicy {
  /// Every local rank is stopped and all start again together (data-parallel jobs: torchrun's
  /// only policy).
  kAll,
  /// The failed rank alone starts again, meeting the others where they met (the same
  /// MASTER_PORT, or the same etcd job), while the others keep running (RPC jobs whose workers
  /// rejoin a running group). Under RdzvBackend::kStatic rank 0 is never restarted: it serves
  /// the rendezvous store the others meet in, so its failure ends the job; under kEtcd no rank
  /// serves it, and rank 0 restarts like the others. One node only.
  kRank,
};

/// "all" or "rank", as --restart-policy takes it.
const char* restart_policy_name(RestartPolicy policy);

/// Where the ranks meet (torchrun's --rdzv-backend).
enum class RdzvBackend {
  /// "static", torchrun's default: rank 0 serves the store on MASTER_ADDR:MASTER_PORT.
  kStatic,
  /// "etcd": the store is kept in an etcd 3.4 (LaunchOptions::rdzv_endpoint) under the job
  /// rdzv_id, which no process of the job serves; env:// in a rank means
  /// etcd://ENDPOINT/JOB (DISTOPTIM_RDZV_INIT_METHOD).
  kEtcd,
};

/// "static" or "etcd", as --rdzv-backend takes it.
const char* rdzv_backend_name(RdzvBackend backend);

/// What distrun runs: `nproc_per_node` copies of `command` on this node, which is node
/// `node_rank` of `nnodes`.
struct LaunchOptions {
  /// Processes (ranks) started on this node; at least 1.
  int nproc_per_node = 0;
  /// Nodes in the job, each running its own distrun with the same nproc_per_node.
  int nnodes = 1;
  /// This node's index, in [0, nnodes); its ranks are node_rank * nproc_per_node + local rank.
  int node_rank = 0;
  /// Address of rank 0's rendezvous. Empty: 127.0.0.1 (only allowed with nnodes == 1). Static
  /// backend only.
  std::string master_addr;
  /// Port of rank 0's rendezvous, 1..65535. 0: a port free on 127.0.0.1 when distrun starts
  /// (only allowed with nnodes == 1). Static backend only.
  int master_port = 0;
  /// Where the ranks meet.
  RdzvBackend rdzv_backend = RdzvBackend::kStatic;
  /// kEtcd: the client address of the etcd, "HOST:PORT" or "[IPV6]:PORT"; required. Empty
  /// under kStatic.
  std::string rdzv_endpoint;
  /// kEtcd: the job's name in etcd (letters, digits, '.', '_', '-'), the same on every node.
  /// Empty: one made for this launch (resolve_rendezvous), so that no earlier job's keys count;
  /// required with nnodes > 1. Empty under kStatic.
  std::string rdzv_id;
  /// After the first failure (or a signal), how long the other ranks have to exit after being
  /// sent SIGTERM before they are sent SIGKILL. In [0, 86400].
  double grace_seconds = 5.0;
  /// How many times the whole group of local ranks is started again after a rank fails (torchrun's
  /// --max-restarts). 0: a failure ends the job. With nnodes > 1, every node's distrun restarts
  /// its ranks together (node_coordination.h); all nodes must give the same value.
  int max_restarts = 0;
  /// What a failure restarts. With kRank, max_restarts bounds each rank's own restarts (its
  /// DISTRUN_RESTART_COUNT), not the job's; nnodes must be 1. Under kEtcd with nnodes > 1,
  /// max_restarts must be 0 (the nodes' distruns coordinate through a store node 0 serves).
  RestartPolicy restart_policy = RestartPolicy::kAll;
  /// With nnodes > 1 and max_restarts > 0: how long a node's distrun waits for every node to
  /// join a round, and for every node to report the end of a round its own ranks finished, in
  /// seconds; in (0, 604800].
  double rdzv_timeout_seconds = 900.0;
  /// --rpc-secret-file: the job's RPC secret, a file of 1-4096 bytes that only its owner may
  /// read or write (mode 0600 or stricter), the same bytes on every node; the ranks get its
  /// absolute path in DISTOPTIM_RPC_SECRET_FILE, so the secret itself is never in a command line
  /// or an environment. Given DISTOPTIM_RPC_SECRET_FILE in distrun's own environment, that file.
  /// Empty: on one node distrun makes one per job (job_secret.h); across nodes the job needs a
  /// file or rpc_insecure (without a secret the ranks' RPC takes no connection from another
  /// machine).
  std::string rpc_secret_file;
  /// --rpc-insecure: no secret; the ranks' RPC takes connections with any process that can
  /// reach it (DISTOPTIM_RPC_INSECURE=1 in their environment). Not with rpc_secret_file.
  bool rpc_insecure = false;
  /// PROGRAM and its arguments, passed to every rank untouched.
  std::vector<std::string> command;
};

/// Parses distrun's arguments (without argv[0]):
/// `--nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P]
///  [--rdzv-backend static|etcd --rdzv-endpoint HOST:PORT --rdzv-id JOB]
///  [--grace-seconds S] [--max-restarts K] [--restart-policy all|rank] [--rdzv-timeout T] [--]
///  PROGRAM ARGS...`.
/// Everything from PROGRAM on is kept as given, even words that look like distrun's options.
/// Returns validated options (validate() has run). Throws UsageError, or HelpRequested for --help.
LaunchOptions parse_command_line(const std::vector<std::string>& args);

/// Checks every field; throws UsageError naming the first bad option and its value.
void validate(const LaunchOptions& options);

/// distrun's --help text.
std::string help_text();

/// `options` with where the ranks meet filled in. kStatic: master_addr and master_port, when left
/// empty/0, become 127.0.0.1 and a port found free by binding a TCP socket to 127.0.0.1 port 0
/// (std::system_error if no socket can be bound). kEtcd: rdzv_id, when empty, becomes a name
/// made for this launch, "distrun-" and 16 random hex digits (std::system_error if the system
/// gives no random bytes).
LaunchOptions resolve_rendezvous(LaunchOptions options);

/// kEtcd: the etcd job the ranks of the attempt after `restart_count` restarts meet under:
/// rdzv_id, or under --restart-policy all after a restart (a new group, as a new MASTER_PORT
/// is under kStatic) rdzv_id + ".restart-" + restart_count. A rank restarted alone (kRank)
/// rejoins rdzv_id. `options` must be resolved.
std::string etcd_job(const LaunchOptions& options, int restart_count);

/// Where the ranks of the attempt after `restart_count` restarts meet, as distrun's messages
/// name it: "MASTER_PORT=29500", or "DISTOPTIM_RDZV_INIT_METHOD=etcd://HOST:PORT/JOB".
std::string meeting_point(const LaunchOptions& options, int restart_count);

/// Whether the variable `name` says where the ranks meet (MASTER_ADDR, MASTER_PORT,
/// DISTOPTIM_RDZV_INIT_METHOD): only rank_environment's values of these reach a rank, never
/// distrun's own, which may name another job's store.
bool is_rendezvous_variable(const std::string& name);

/// A TCP port free when called: on 127.0.0.1 or, with `all_addresses`, on every address of this
/// machine (what a store listening on all of them needs), found by binding port 0. Throws
/// std::system_error if no socket can be bound.
int find_free_port(bool all_addresses = false);

/// A port found free as find_free_port does, other than `previous` if the system offers another
/// within a few tries: each round of a restarted job gets its own.
int fresh_port(int previous, bool all_addresses = false);

/// OpenMP threads (and so LibTorch's intra-op and OpenBLAS's threads) of ranks that share a
/// machine: torchrun's value.
constexpr const char* kSharedMachineOmpThreads = "1";

/// OpenBLAS's idle-thread spin, as a power of two of cycles, for ranks that share a machine.
constexpr const char* kSharedMachineBlasThreadTimeout = "4";

/// The variable that gives the ranks of an etcd job their rendezvous's init method (the comm
/// layer's LaunchEnv::kInitMethodVariable; the store module checks that they agree).
constexpr const char* kRdzvInitMethodVariable = "DISTOPTIM_RDZV_INIT_METHOD";

/// The variables set for local rank `local_rank` in the attempt after `restart_count` restarts,
/// in this order: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and
/// MASTER_PORT (torchrun's names; kStatic) or DISTOPTIM_RDZV_INIT_METHOD=etcd://ENDPOINT/JOB with
/// JOB = etcd_job(options, restart_count) (kEtcd: comm::LaunchEnv reads it, and env:// means
/// it), DISTRUN_RESTART_COUNT and DISTRUN_MAX_RESTARTS (torchrun's
/// TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_MAX_RESTARTS); then, with several ranks on this
/// node, OMP_NUM_THREADS=kSharedMachineOmpThreads unless distrun's environment has it, and
/// OPENBLAS_THREAD_TIMEOUT=kSharedMachineBlasThreadTimeout unless it has that or
/// GOTO_THREAD_TIMEOUT; then, given a `secret_file` (the job's RPC secret: options'
/// rpc_secret_file, or the one distrun made, job_secret.h), DISTOPTIM_RPC_SECRET_FILE=secret_file;
/// with rpc_insecure, DISTOPTIM_RPC_INSECURE=1. `options` must be resolved (resolve_rendezvous)
/// and valid.
std::vector<std::pair<std::string, std::string>> rank_environment(
    const LaunchOptions& options, int local_rank, int restart_count = 0,
    const std::string& secret_file = std::string());

/// `s` in single quotes, as error messages quote a program's name.
std::string single_quoted(const std::string& s);

}  // namespace launcher
}  // namespace distoptim
