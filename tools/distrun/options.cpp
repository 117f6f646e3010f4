#include "distrun/options.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "distrun/job_secret.h"
#include "distrun/signals_fds.h"
#include "distrun/store_module.h"

namespace distoptim {
namespace launcher {
namespace {

constexpr double kMaxGraceSeconds = 86400.0;
constexpr int kMaxRestarts = 1000000;
constexpr double kMaxRdzvTimeoutSeconds = 604800.0;
constexpr const char* kDefaultMasterAddr = "127.0.0.1";
constexpr const char* kUsageLine = "distrun --nproc-per-node N [OPTIONS] [--] PROGRAM [ARGS...]";

// CLI11's help, with distrun's usage line (CLI11's own would leave out PROGRAM).
class HelpFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string) const override {
    return fmt::format("Usage: {}\n", kUsageLine);
  }
};

// What the command line gave as words, checked and stored into LaunchOptions after parsing.
struct Words {
  std::string policy;
  std::string backend;
};

// Registers distrun's options on `app`, storing into `options` (--restart-policy and
// --rdzv-backend as given into `words`). The underscore spellings are torchrun's, accepted so its
// command lines port unchanged.
void add_options(CLI::App& app, LaunchOptions& options, Words& words) {
  app.formatter(std::make_shared<HelpFormatter>());
  app.get_formatter()->column_width(38);
  app.description(
      "Starts N processes (ranks) of PROGRAM on this node with the environment of a distributed\n"
      "job, relays their output line by line, and stops them all when one fails.");
  // Stop at PROGRAM: it and everything after it are the ranks' command line, never ours.
  app.prefix_command();
  app.add_option("--nproc-per-node,--nproc_per_node", options.nproc_per_node,
                 "Processes (ranks) to start on this node, at least 1")
      ->type_name("N")
      ->required();
  app.add_option("--nnodes", options.nnodes, "Nodes in the job, each running distrun (default 1)")
      ->type_name("M");
  app.add_option("--node-rank,--node_rank", options.node_rank,
                 "This node's index in [0, M) (default 0)")
      ->type_name("R");
  app.add_option("--master-addr,--master_addr", options.master_addr,
                 "Address of rank 0's rendezvous (default 127.0.0.1;\nrequired with M > 1)")
      ->type_name("ADDR");
  app.add_option("--master-port,--master_port", options.master_port,
                 "Its port, 1..65535 (default: one free on 127.0.0.1;\nrequired with M > 1)")
      ->type_name("PORT");
  app.add_option("--grace-seconds,--grace_seconds", options.grace_seconds,
                 "After a failure or SIGINT/SIGTERM, seconds the ranks\nhave between SIGTERM and "
                 "SIGKILL (default 5)")
      ->type_name("S");
  app.add_option("--max-restarts,--max_restarts", options.max_restarts,
                 "After a rank fails, start all local ranks again, at most\nK times (default 0; "
                 "with M > 1, every node restarts)")
      ->type_name("K");
  app.add_option("--restart-policy,--restart_policy", words.policy,
                 "all: a failure restarts every local rank (default);\nrank: only the failed "
                 "rank, on the same MASTER_PORT\n(or etcd job), while the others run (K restarts "
                 "per\nrank; with the static backend, rank 0's failure ends\nthe job; only with "
                 "M = 1)")
      ->type_name("POLICY");
  app.add_option("--rdzv-backend,--rdzv_backend", words.backend,
                 "Where the ranks meet: static (default): rank 0 serves\nthe store on MASTER_ADDR:"
                 "MASTER_PORT; etcd: in the\netcd at --rdzv-endpoint, which no rank serves")
      ->type_name("BACKEND");
  app.add_option("--rdzv-endpoint,--rdzv_endpoint", options.rdzv_endpoint,
                 "With etcd: the etcd's client address (etcd 3.4, v3 API)")
      ->type_name("HOST:PORT");
  app.add_option("--rdzv-id,--rdzv_id", options.rdzv_id,
                 "With etcd: the job's name in etcd, letters, digits,\n'.', '_', '-' (default: "
                 "one made for this launch;\nrequired with M > 1)")
      ->type_name("JOB");
  app.add_option("--rdzv-timeout,--rdzv_timeout", options.rdzv_timeout_seconds,
                 "With M > 1 and K > 0: seconds to wait for every node\nto join a round, or to "
                 "report its end (default 900)")
      ->type_name("T");
  app.add_option("--rpc-secret-file,--rpc_secret_file", options.rpc_secret_file,
                 "The job's RPC secret (1-4096 bytes, mode 0600), the\nsame file on every node "
                 "(default: on one node, one made\nfor the job; across nodes, required unless "
                 "--rpc-insecure)")
      ->type_name("FILE");
  app.add_flag("--rpc-insecure,--rpc_insecure", options.rpc_insecure,
               "No RPC secret: the ranks take RPC connections from\nanyone who can reach them");
  app.footer(
      "Each rank's environment gets RANK (R * N + local rank), WORLD_SIZE (M * N), LOCAL_RANK,\n"
      "LOCAL_WORLD_SIZE (N), GROUP_RANK (R), MASTER_ADDR, MASTER_PORT, DISTRUN_RESTART_COUNT\n"
      "(restarts so far: 0 in the first attempt) and DISTRUN_MAX_RESTARTS (K); with N > 1,\n"
      "also OMP_NUM_THREADS=1 (as torchrun) and OPENBLAS_THREAD_TIMEOUT=4, each unless set\n"
      "(idle OpenBLAS threads sleep at once rather than spin on a core another rank needs).\n"
      "Every line a rank writes is printed as \"[rank RANK] line\" on distrun's stdout or stderr.\n"
      "When a rank exits non-zero or is killed by a signal, the others get SIGTERM, then SIGKILL\n"
      "after the grace period. With --max-restarts K, once all have exited, all are started again\n"
      "(at most K times) on a new MASTER_PORT (the same one if --master-port was given);\n"
      "SIGINT or SIGTERM to distrun never leads to a restart.\n"
      "With --restart-policy rank (for RPC jobs whose workers rejoin the running group), a rank\n"
      "that fails is started again alone, at most K times, with its own DISTRUN_RESTART_COUNT\n"
      "and the same MASTER_PORT, while the others run on; rank 0, which serves the rendezvous\n"
      "store, is never restarted: its failure ends the job as without restarts.\n"
      "With --rdzv-backend etcd, ranks get DISTOPTIM_RDZV_INIT_METHOD=etcd://HOST:PORT/JOB\n"
      "instead of MASTER_ADDR and MASTER_PORT (env:// then means it): no rank serves the store,\n"
      "so under --restart-policy rank rank 0 is restarted alone like any other, rejoining the\n"
      "same JOB; under --restart-policy all each restart meets under JOB.restart-K. Across\n"
      "nodes, give every node the same --rdzv-id; restarts across nodes need the static backend.\n"
      "With M > 1 and K > 0, node 0's distrun serves the launchers' store on --master-addr and\n"
      "--master-port; each round, every node joins, node 0 picks the ranks' MASTER_PORT (free on\n"
      "node 0), and a failure or a signal on any node stops the ranks of every node; after a\n"
      "failure, every node starts its ranks again together.\n"
      "Exit status: 0 if every rank exited 0; 128 + signal if distrun got SIGINT or SIGTERM; else\n"
      "the first failing rank's status in the last attempt (128 + signal if it was killed); 2 for\n"
      "a bad command line. Across nodes with K > 0, every node exits with the status of the\n"
      "failure that ended the last round, 128 + signal when a node's distrun got one, or 1 when\n"
      "the nodes could not coordinate (a node never joined within T, options that differ).");
}

// The name of a job made for one launch: 64 random bits, so that no other job's keys in etcd
// (an earlier launch, another user's) are taken for this one's.
std::string fresh_job_id() {
  uint64_t bits = 0;
  auto* bytes = reinterpret_cast<unsigned char*>(&bits);
  size_t filled = 0;
  while (filled < sizeof bits) {
    const ssize_t n = ::getrandom(bytes + filled, sizeof bits - filled, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw errno_error(errno, "making an etcd job name: getrandom");
    filled += static_cast<size_t>(n);
  }
  return fmt::format("distrun-{:016x}", bits);
}

bool is_job_name(const std::string& job) {
  return !job.empty() && std::all_of(job.begin(), job.end(), [](unsigned char c) {
    return std::isalnum(c) != 0 || c == '.' || c == '_' || c == '-';
  });
}

// The options of --rdzv-backend, each only with the backend it belongs to.
void validate_rendezvous(const LaunchOptions& options) {
  if (options.rdzv_backend == RdzvBackend::kStatic) {
    if (!options.rdzv_endpoint.empty() || !options.rdzv_id.empty()) {
      const bool endpoint = !options.rdzv_endpoint.empty();
      throw UsageError(fmt::format(
          "{} {}: only with --rdzv-backend etcd (the static backend meets on --master-addr and "
          "--master-port)",
          endpoint ? "--rdzv-endpoint" : "--rdzv-id",
          single_quoted(endpoint ? options.rdzv_endpoint : options.rdzv_id)));
    }
    return;
  }
  if (!options.master_addr.empty() || options.master_port != 0) {
    const bool addr = !options.master_addr.empty();
    throw UsageError(fmt::format(
        "{} {}: only with --rdzv-backend static (with etcd the ranks meet in the etcd at "
        "--rdzv-endpoint)",
        addr ? "--master-addr" : "--master-port",
        addr ? single_quoted(options.master_addr) : std::to_string(options.master_port)));
  }
  if (options.rdzv_endpoint.empty()) {
    throw UsageError(
        "--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT, the client address of the etcd the "
        "ranks meet in");
  }
  // Checked as the ranks' store will check it, without contacting etcd.
  const std::string endpoint_error = etcd_endpoint_error(options.rdzv_endpoint);
  if (!endpoint_error.empty()) {
    throw UsageError(fmt::format("--rdzv-endpoint {}: must be HOST:PORT or [IPV6]:PORT ({})",
                                 single_quoted(options.rdzv_endpoint), endpoint_error));
  }
  if (!options.rdzv_id.empty() && !is_job_name(options.rdzv_id)) {
    throw UsageError(fmt::format("--rdzv-id {}: must be letters, digits, '.', '_' or '-'",
                                 single_quoted(options.rdzv_id)));
  }
  if (options.nnodes > 1 && options.rdzv_id.empty()) {
    throw UsageError(fmt::format(
        "--rdzv-id is required with --rdzv-backend etcd and --nnodes {}: every node's distrun "
        "must name the same job",
        options.nnodes));
  }
  if (options.nnodes > 1 && options.max_restarts > 0) {
    throw UsageError(fmt::format(
        "--max-restarts {} with --nnodes {}: not with --rdzv-backend etcd (the nodes' distruns "
        "coordinate restarts through a store node 0 serves, on --master-addr and --master-port; "
        "use --rdzv-backend static)",
        options.max_restarts, options.nnodes));
  }
}

// The RPC secret's file as init_rpc will read it (1-4096 bytes), and the owner's alone; across
// nodes, a secret or the explicit opt-out.
void validate_rpc_secret(const LaunchOptions& options) {
  if (options.rpc_insecure && !options.rpc_secret_file.empty()) {
    throw UsageError(
        fmt::format("--rpc-insecure with --rpc-secret-file {} (or {} in the "
                    "environment): either a secret or none",
                    single_quoted(options.rpc_secret_file), kRpcSecretFileVariable));
  }
  if (options.nnodes > 1 && options.rpc_secret_file.empty() && !options.rpc_insecure) {
    throw UsageError(fmt::format(
        "--nnodes {} needs --rpc-secret-file FILE, the same secret on every node (the ranks' RPC "
        "authenticates every connection with it; without one it takes no connection from another "
        "machine), or --rpc-insecure to run without (any process that can reach a rank may call "
        "it)",
        options.nnodes));
  }
  if (options.rpc_secret_file.empty()) return;
  const std::string file = single_quoted(options.rpc_secret_file);
  struct stat status {};
  if (::stat(options.rpc_secret_file.c_str(), &status) != 0) {
    throw UsageError(fmt::format("--rpc-secret-file {}: {}", file, std::strerror(errno)));
  }
  if (!S_ISREG(status.st_mode) || status.st_size < 1 || status.st_size > 4096) {
    throw UsageError(
        fmt::format("--rpc-secret-file {}: must be a file of 1-4096 bytes (it {})", file,
                    S_ISREG(status.st_mode) ? fmt::format("holds {} bytes", status.st_size)
                                            : std::string("is not a regular file")));
  }
  if ((status.st_mode & 077) != 0) {
    throw UsageError(fmt::format(
        "--rpc-secret-file {}: mode {:04o} lets other users read or change the secret; make it "
        "the owner's alone (chmod 600 {})",
        file, status.st_mode & 07777, file));
  }
  if (::access(options.rpc_secret_file.c_str(), R_OK) != 0) {
    throw UsageError(
        fmt::format("--rpc-secret-file {}: cannot be read ({})", file, std::strerror(errno)));
  }
}

// "etcd://ENDPOINT/JOB" for the attempt after `restart_count` restarts.
std::string etcd_init_method(const LaunchOptions& options, int restart_count) {
  return fmt::format("etcd://{}/{}", options.rdzv_endpoint, etcd_job(options, restart_count));
}

}  // namespace

const char* restart_policy_name(RestartPolicy policy) {
  return policy == RestartPolicy::kRank ? "rank" : "all";
}

const char* rdzv_backend_name(RdzvBackend backend) {
  return backend == RdzvBackend::kEtcd ? "etcd" : "static";
}

int find_free_port(bool all_addresses) {
  const Fd sock(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!sock.valid()) throw errno_error(errno, "socket");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = 0;
  address.sin_addr.s_addr = htonl(all_addresses ? INADDR_ANY : INADDR_LOOPBACK);
  if (::bind(sock.get(), reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    throw errno_error(errno, fmt::format("finding a free port: bind to {} port 0",
                                         all_addresses ? "0.0.0.0" : "127.0.0.1"));
  }
  socklen_t length = sizeof address;
  if (::getsockname(sock.get(), reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    throw errno_error(errno, "finding a free port: getsockname");
  }
  return ntohs(address.sin_port);
}

int fresh_port(int previous, bool all_addresses) {
  int port = previous;
  for (int attempt = 0; attempt < 10 && port == previous; ++attempt) {
    port = find_free_port(all_addresses);
  }
  return port;
}

std::string single_quoted(const std::string& s) { return fmt::format("'{}'", s); }

LaunchOptions parse_command_line(const std::vector<std::string>& args) {
  LaunchOptions options;
  Words words{restart_policy_name(options.restart_policy), rdzv_backend_name(options.rdzv_backend)};
  CLI::App app("", "distrun");
  add_options(app, options, words);
  // CLI11 takes the arguments last-first.
  std::vector<std::string> reversed(args.rbegin(), args.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    throw HelpRequested(app.help());
  } catch (const CLI::ParseError& e) {
    throw UsageError(e.what());
  }
  // Explicit values that mean "unset" in LaunchOptions are errors, not requests for a default.
  if (app.count("--master-port") > 0 && options.master_port == 0) {
    throw UsageError("--master-port 0: must be in 1..65535");
  }
  if (words.policy == "all" || words.policy == "rank") {
    options.restart_policy = words.policy == "rank" ? RestartPolicy::kRank : RestartPolicy::kAll;
  } else {
    throw UsageError(
        fmt::format("--restart-policy {}: must be all or rank", single_quoted(words.policy)));
  }
  if (words.backend == "static" || words.backend == "etcd") {
    options.rdzv_backend = words.backend == "etcd" ? RdzvBackend::kEtcd : RdzvBackend::kStatic;
  } else {
    throw UsageError(
        fmt::format("--rdzv-backend {}: must be static or etcd", single_quoted(words.backend)));
  }
  // A secret's file given as distrun's environment (as init_rpc reads it) counts as the option.
  const char* secret_in_environment = std::getenv(kRpcSecretFileVariable);
  if (app.count("--rpc-secret-file") == 0 && secret_in_environment != nullptr) {
    options.rpc_secret_file = secret_in_environment;
  }
  if (!options.rpc_secret_file.empty()) {
    options.rpc_secret_file = std::filesystem::absolute(options.rpc_secret_file).string();
  }
  const std::pair<const char*, const std::string*> words_given[] = {
      {"--rpc-secret-file", &options.rpc_secret_file},
      {"--master-addr", &options.master_addr},
      {"--rdzv-endpoint", &options.rdzv_endpoint},
      {"--rdzv-id", &options.rdzv_id}};
  for (const auto& [name, value] : words_given) {
    if (app.count(name) > 0 && value->empty()) {
      throw UsageError(fmt::format("{} '': must not be empty", name));
    }
  }

  // With prefix_command, remaining() holds an unknown option and what follows it, or "--" and
  // the command, or the command.
  std::vector<std::string> rest = app.remaining();
  if (!rest.empty() && rest.front() == "--") {
    rest.erase(rest.begin());
  } else if (!rest.empty() && rest.front().size() > 1 && rest.front()[0] == '-') {
    throw UsageError(fmt::format("unknown option {} (put -- before a PROGRAM that starts with -)",
                                 rest.front()));
  }
  options.command = std::move(rest);
  validate(options);
  return options;
}

void validate(const LaunchOptions& options) {
  if (options.nproc_per_node < 1) {
    throw UsageError(
        fmt::format("--nproc-per-node {}: must be at least 1", options.nproc_per_node));
  }
  if (options.nnodes < 1) {
    throw UsageError(fmt::format("--nnodes {}: must be at least 1", options.nnodes));
  }
  if (static_cast<int64_t>(options.nnodes) * options.nproc_per_node > INT_MAX) {
    throw UsageError(
        fmt::format("--nnodes {} --nproc-per-node {}: the world size must be at most {}",
                    options.nnodes, options.nproc_per_node, INT_MAX));
  }
  if (options.node_rank < 0 || options.node_rank >= options.nnodes) {
    throw UsageError(fmt::format("--node-rank {}: must be in [0, {}) (--nnodes {})",
                                 options.node_rank, options.nnodes, options.nnodes));
  }
  if (options.master_port < 0 || options.master_port > 65535) {
    throw UsageError(fmt::format("--master-port {}: must be in 1..65535", options.master_port));
  }
  validate_rendezvous(options);
  if (options.rdzv_backend == RdzvBackend::kStatic && options.nnodes > 1 &&
      (options.master_addr.empty() || options.master_port == 0)) {
    throw UsageError(fmt::format(
        "{} is required with --nnodes {}: the address of rank 0's rendezvous, the same on every "
        "node (--master-addr {}, --master-port {})",
        options.master_addr.empty() ? "--master-addr" : "--master-port", options.nnodes,
        options.master_addr.empty() ? "not given" : options.master_addr,
        options.master_port == 0 ? "not given" : std::to_string(options.master_port)));
  }
  if (!(options.grace_seconds >= 0 && options.grace_seconds <= kMaxGraceSeconds)) {
    throw UsageError(fmt::format("--grace-seconds {}: must be in [0, {}]", options.grace_seconds,
                                 kMaxGraceSeconds));
  }
  if (options.max_restarts < 0 || options.max_restarts > kMaxRestarts) {
    throw UsageError(
        fmt::format("--max-restarts {}: must be in [0, {}]", options.max_restarts, kMaxRestarts));
  }
  if (options.restart_policy == RestartPolicy::kRank && options.nnodes > 1) {
    // Restarting a rank alone needs no coordination, but ending the job does: rank 0's failure
    // on node 0 must stop every node, which only the rounds of --restart-policy all do.
    throw UsageError(fmt::format(
        "--restart-policy rank: only with --nnodes 1 (got --nnodes {}); across nodes, use "
        "--restart-policy all",
        options.nnodes));
  }
  validate_rpc_secret(options);
  if (!(options.rdzv_timeout_seconds > 0 &&
        options.rdzv_timeout_seconds <= kMaxRdzvTimeoutSeconds)) {
    throw UsageError(fmt::format("--rdzv-timeout {}: must be in (0, {}]",
                                 options.rdzv_timeout_seconds, kMaxRdzvTimeoutSeconds));
  }
  if (options.command.empty()) {
    throw UsageError(fmt::format("no PROGRAM given; usage: {}", kUsageLine));
  }
  if (options.command.front().empty()) {
    throw UsageError(
        fmt::format("PROGRAM {}: must not be empty", single_quoted(options.command.front())));
  }
}

std::string help_text() {
  LaunchOptions options;
  Words words;
  CLI::App app("", "distrun");
  add_options(app, options, words);
  return app.help();
}

LaunchOptions resolve_rendezvous(LaunchOptions options) {
  if (options.rdzv_backend == RdzvBackend::kEtcd) {
    if (options.rdzv_id.empty()) options.rdzv_id = fresh_job_id();
    return options;
  }
  if (options.master_addr.empty()) options.master_addr = kDefaultMasterAddr;
  if (options.master_port == 0) options.master_port = find_free_port();
  return options;
}

std::string etcd_job(const LaunchOptions& options, int restart_count) {
  if (options.restart_policy == RestartPolicy::kRank || restart_count == 0) return options.rdzv_id;
  return fmt::format("{}.restart-{}", options.rdzv_id, restart_count);
}

std::string meeting_point(const LaunchOptions& options, int restart_count) {
  if (options.rdzv_backend == RdzvBackend::kStatic) {
    return fmt::format("MASTER_PORT={}", options.master_port);
  }
  return fmt::format("{}={}", kRdzvInitMethodVariable, etcd_init_method(options, restart_count));
}

bool is_rendezvous_variable(const std::string& name) {
  return name == "MASTER_ADDR" || name == "MASTER_PORT" || name == kRdzvInitMethodVariable;
}

std::vector<std::pair<std::string, std::string>> rank_environment(const LaunchOptions& options,
                                                                  int local_rank, int restart_count,
                                                                  const std::string& secret_file) {
  const int rank = options.node_rank * options.nproc_per_node + local_rank;
  std::vector<std::pair<std::string, std::string>> environment = {
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(options.nnodes * options.nproc_per_node)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(options.nproc_per_node)},
      {"GROUP_RANK", std::to_string(options.node_rank)},
  };
  if (options.rdzv_backend == RdzvBackend::kStatic) {
    environment.emplace_back("MASTER_ADDR", options.master_addr);
    environment.emplace_back("MASTER_PORT", std::to_string(options.master_port));
  } else {
    environment.emplace_back(kRdzvInitMethodVariable, etcd_init_method(options, restart_count));
  }
  environment.emplace_back("DISTRUN_RESTART_COUNT", std::to_string(restart_count));
  environment.emplace_back("DISTRUN_MAX_RESTARTS", std::to_string(options.max_restarts));
  // Ranks sharing a machine, as torchrun: one OpenMP thread each, which also sizes LibTorch's
  // intra-op pool and the system OpenBLAS's own pool (OMP_NUM_THREADS is its third choice, after
  // OPENBLAS_NUM_THREADS and GOTO_NUM_THREADS). Without it every rank starts a BLAS thread per
  // core: with 2 ranks on 2 cores, DDP + ZeRO used 1.3x the CPU time per iteration. A value the
  // user set stays.
  if (options.nproc_per_node > 1 && std::getenv("OMP_NUM_THREADS") == nullptr) {
    environment.emplace_back("OMP_NUM_THREADS", kSharedMachineOmpThreads);
  }
  // Ranks sharing a machine: an idle OpenBLAS thread spins (sched_yield) for 2^28 cycles after
  // each product, about 0.1 s, taking a core from the rank that computes while this one waits
  // for it. 2^4 cycles: it sleeps at once. A value the user set stays.
  if (options.nproc_per_node > 1 && std::getenv("OPENBLAS_THREAD_TIMEOUT") == nullptr &&
      std::getenv("GOTO_THREAD_TIMEOUT") == nullptr) {
    environment.emplace_back("OPENBLAS_THREAD_TIMEOUT", kSharedMachineBlasThreadTimeout);
  }
  if (!secret_file.empty()) environment.emplace_back(kRpcSecretFileVariable, secret_file);
  if (options.rpc_insecure) environment.emplace_back("DISTOPTIM_RPC_INSECURE", "1");
  return environment;
}

}  // namespace launcher
}  // namespace distoptim
