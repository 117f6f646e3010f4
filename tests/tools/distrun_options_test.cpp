// distrun's command line, parsed and validated in-process (the launcher library).

#include "distrun/launcher.h"
#include "distrun/restart_policy.h"

#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

namespace distoptim {
namespace launcher {
namespace {

using Args = std::vector<std::string>;

// Expects parsing `args` to throw UsageError whose message contains every one of `parts`.
void expect_usage_error(const Args& args, const std::vector<std::string>& parts) {
  try {
    parse_command_line(args);
  } catch (const UsageError& e) {
    const std::string message = e.what();
    for (const auto& part : parts) {
      EXPECT_NE(message.find(part), std::string::npos)
          << "message lacks '" << part << "': " << message;
    }
    return;
  }
  ADD_FAILURE() << "expected a UsageError";
}

TEST(DistrunOptions, DefaultsNeedOnlyTheProcessCountAndTheProgram) {
  const LaunchOptions options = parse_command_line({"--nproc-per-node", "3", "prog"});
  EXPECT_EQ(options.nproc_per_node, 3);
  EXPECT_EQ(options.nnodes, 1);
  EXPECT_EQ(options.node_rank, 0);
  EXPECT_EQ(options.master_addr, "");
  EXPECT_EQ(options.master_port, 0);
  EXPECT_EQ(options.grace_seconds, 5.0);
  EXPECT_EQ(options.max_restarts, 0);
  EXPECT_EQ(options.command, Args{"prog"});
}

TEST(DistrunOptions, ParsesEveryOption) {
  const LaunchOptions options = parse_command_line(
      {"--nproc-per-node=2", "--nnodes", "4", "--node-rank", "3", "--master-addr", "10.0.0.7",
       "--master-port", "29500", "--grace-seconds", "0.5", "--rpc-insecure", "prog", "a"});
  EXPECT_EQ(
      parse_command_line({"--nproc-per-node", "2", "--max-restarts", "3", "prog"}).max_restarts, 3);
  EXPECT_EQ(options.nproc_per_node, 2);
  EXPECT_EQ(options.nnodes, 4);
  EXPECT_EQ(options.node_rank, 3);
  EXPECT_EQ(options.master_addr, "10.0.0.7");
  EXPECT_EQ(options.master_port, 29500);
  EXPECT_EQ(options.grace_seconds, 0.5);
  EXPECT_EQ(options.command, (Args{"prog", "a"}));
}

TEST(DistrunOptions, AcceptsTorchrunSpellings) {
  const LaunchOptions options = parse_command_line(
      {"--nproc_per_node", "2", "--nnodes", "2", "--node_rank", "1", "--master_addr", "host",
       "--master_port", "1234", "--rpc_insecure", "prog"});
  EXPECT_EQ(
      parse_command_line({"--nproc_per_node", "2", "--max_restarts", "1", "prog"}).max_restarts, 1);
  EXPECT_EQ(options.nproc_per_node, 2);
  EXPECT_EQ(options.node_rank, 1);
  EXPECT_EQ(options.master_addr, "host");
  EXPECT_EQ(options.master_port, 1234);
}

TEST(DistrunOptions, EverythingFromTheProgramOnIsPassedUntouched) {
  const Args command = {"prog", "--nproc-per-node", "9", "--", "-x", "--help", ""};
  Args args = {"--nproc-per-node", "2"};
  args.insert(args.end(), command.begin(), command.end());
  EXPECT_EQ(parse_command_line(args).command, command);
}

TEST(DistrunOptions, DoubleDashEndsDistrunsOptions) {
  EXPECT_EQ(parse_command_line({"--nproc-per-node", "1", "--", "prog", "--nnodes", "2"}).command,
            (Args{"prog", "--nnodes", "2"}));
  // After --, a program whose name starts with a dash is a program.
  EXPECT_EQ(parse_command_line({"--nproc-per-node", "1", "--", "-prog"}).command, Args{"-prog"});
}

TEST(DistrunOptions, HelpNamesTheOptionsAndTheEnvironment) {
  try {
    parse_command_line({"--help"});
    ADD_FAILURE() << "expected HelpRequested";
  } catch (const HelpRequested& help) {
    const std::string text = help.what();
    EXPECT_EQ(text, help_text());
    for (const char* part : {"--nproc-per-node",
                             "--nnodes",
                             "--node-rank",
                             "--master-addr",
                             "--master-port",
                             "--grace-seconds",
                             "--max-restarts",
                             "--restart-policy",
                             "rank 0",
                             "--rdzv-timeout",
                             "--rdzv-backend",
                             "--rdzv-endpoint",
                             "--rdzv-id",
                             "static",
                             "etcd",
                             "DISTOPTIM_RDZV_INIT_METHOD",
                             "DISTRUN_RESTART_COUNT",
                             "RANK",
                             "WORLD_SIZE",
                             "LOCAL_RANK",
                             "MASTER_ADDR",
                             "MASTER_PORT"}) {
      EXPECT_NE(text.find(part), std::string::npos) << part;
    }
  }
}

TEST(DistrunOptions, RejectsBadValuesNamingTheOptionAndValue) {
  expect_usage_error({"prog"}, {"--nproc-per-node", "required"});
  expect_usage_error({"--nproc-per-node", "0", "prog"}, {"--nproc-per-node 0", "at least 1"});
  expect_usage_error({"--nproc-per-node", "-3", "prog"}, {"--nproc-per-node -3"});
  expect_usage_error({"--nproc-per-node", "abc", "prog"}, {"--nproc-per-node", "abc"});
  expect_usage_error({"--nproc-per-node", "2", "--nnodes", "0", "prog"}, {"--nnodes 0"});
  expect_usage_error({"--nproc-per-node", "2", "--node-rank", "1", "prog"},
                     {"--node-rank 1", "[0, 1)"});
  expect_usage_error({"--nproc-per-node", "2", "--node-rank", "-1", "prog"}, {"--node-rank -1"});
  expect_usage_error({"--nproc-per-node", "2", "--master-port", "0", "prog"},
                     {"--master-port 0", "1..65535"});
  expect_usage_error({"--nproc-per-node", "2", "--master-port", "65536", "prog"},
                     {"--master-port 65536", "1..65535"});
  expect_usage_error({"--nproc-per-node", "2", "--master-addr", "", "prog"}, {"--master-addr"});
  expect_usage_error({"--nproc-per-node", "2", "--grace-seconds", "-1", "prog"},
                     {"--grace-seconds -1"});
  expect_usage_error({"--nproc-per-node", "2", "--max-restarts", "-1", "prog"},
                     {"--max-restarts -1", "[0, 1000000]"});
  expect_usage_error({"--nproc-per-node", "65536", "--nnodes", "65536", "prog"},
                     {"--nnodes 65536", "--nproc-per-node 65536"});
  expect_usage_error({"--nproc-per-node", "2", "--nnodes", "2", "--nnodes", "3", "prog"},
                     {"--nnodes"});
}

TEST(DistrunOptions, SeveralNodesNeedTheMasterAddressAndPort) {
  expect_usage_error({"--nproc-per-node", "2", "--nnodes", "2", "prog"},
                     {"--master-addr", "--nnodes 2"});
  expect_usage_error({"--nproc-per-node", "2", "--nnodes", "2", "--master-addr", "h", "prog"},
                     {"--master-port", "--nnodes 2"});
  expect_usage_error({"--nproc-per-node", "2", "--nnodes", "2", "--master-port", "80", "prog"},
                     {"--master-addr", "--nnodes 2"});
}

// The RPC secret's file must be one init_rpc can use and the owner's alone; across nodes the job
// needs one, or the explicit --rpc-insecure; not both.
TEST(DistrunOptions, ASecretFileIsTheOwnersAloneAndAcrossNodesOneIsRequired) {
  const std::string base =
      ::testing::TempDir() + "distrun_options_secret_" + std::to_string(::getpid());
  auto file = [&](const std::string& name, const std::string& content, mode_t mode) {
    const std::string path = base + name;
    std::ofstream(path) << content;
    EXPECT_EQ(::chmod(path.c_str(), mode), 0);
    return path;
  };
  const std::string good = file("good", "secret", 0600);
  const std::string shared = file("shared", "secret", 0644);
  const std::string empty = file("empty", "", 0600);
  const std::string large = file("large", std::string(4097, 'x'), 0600);
  const Args across = {"--nproc-per-node", "1", "--nnodes",      "2",
                       "--master-addr",    "h", "--master-port", "80"};
  auto with = [&](Args more) {
    Args args = across;
    args.insert(args.end(), more.begin(), more.end());
    args.push_back("prog");
    return args;
  };
  EXPECT_EQ(parse_command_line(with({"--rpc-secret-file", good})).rpc_secret_file, good);
  EXPECT_TRUE(parse_command_line(with({"--rpc-insecure"})).rpc_insecure);
  expect_usage_error(with({}), {"--nnodes 2 needs --rpc-secret-file FILE", "--rpc-insecure"});
  expect_usage_error(with({"--rpc-secret-file", shared}),
                     {"--rpc-secret-file '" + shared + "'", "mode 0644", "chmod 600"});
  expect_usage_error(with({"--rpc-secret-file", empty}),
                     {"--rpc-secret-file '" + empty + "'", "1-4096 bytes", "holds 0 bytes"});
  expect_usage_error(with({"--rpc-secret-file", large}),
                     {"--rpc-secret-file '" + large + "'", "holds 4097 bytes"});
  expect_usage_error(with({"--rpc-secret-file", base + "missing"}),
                     {"--rpc-secret-file '" + base + "missing'", "No such file"});
  expect_usage_error(with({"--rpc-secret-file", good, "--rpc-insecure"}),
                     {"--rpc-insecure with --rpc-secret-file"});
  // A relative path reaches the ranks made absolute (they may change their directory).
  const std::string here = std::filesystem::current_path().string();
  std::filesystem::current_path(::testing::TempDir());
  const std::string relative = std::filesystem::path(good).filename().string();
  EXPECT_EQ(parse_command_line({"--nproc-per-node", "1", "--rpc-secret-file", relative, "prog"})
                .rpc_secret_file,
            (std::filesystem::path(::testing::TempDir()) / relative).string());
  std::filesystem::current_path(here);
  for (const std::string& path : {good, shared, empty, large}) std::remove(path.c_str());
}

// Restarts across nodes are coordinated by the nodes' distruns, within a join timeout.
TEST(DistrunOptions, RestartsAcrossNodesTakeAJoinTimeout) {
  const LaunchOptions options =
      parse_command_line({"--nproc-per-node", "2", "--nnodes", "2", "--master-addr", "h",
                          "--master-port", "80", "--max-restarts", "1", "--rpc-insecure", "prog"});
  EXPECT_EQ(options.max_restarts, 1);
  EXPECT_EQ(options.rdzv_timeout_seconds, 900.0);
  EXPECT_EQ(parse_command_line({"--nproc-per-node", "2", "--rdzv_timeout", "2.5", "prog"})
                .rdzv_timeout_seconds,
            2.5);
  expect_usage_error({"--nproc-per-node", "2", "--rdzv-timeout", "0", "prog"},
                     {"--rdzv-timeout 0", "(0, 604800]"});
  expect_usage_error({"--nproc-per-node", "2", "--rdzv-timeout", "1e9", "prog"},
                     {"--rdzv-timeout 1000000000"});
  expect_usage_error({"--nproc-per-node", "2", "--rdzv-timeout", "nan", "prog"},
                     {"--rdzv-timeout nan"});
}

// A failure restarts every local rank by default; with `rank`, only the failed one (one node).
TEST(DistrunOptions, RestartPolicyIsAllOrRankAndRankNeedsOneNode) {
  EXPECT_EQ(parse_command_line({"--nproc-per-node", "2", "prog"}).restart_policy,
            RestartPolicy::kAll);
  EXPECT_EQ(parse_command_line({"--nproc-per-node", "2", "--restart-policy", "rank", "prog"})
                .restart_policy,
            RestartPolicy::kRank);
  EXPECT_EQ(parse_command_line({"--nproc-per-node", "2", "--restart_policy", "all", "prog"})
                .restart_policy,
            RestartPolicy::kAll);
  expect_usage_error({"--nproc-per-node", "2", "--restart-policy", "1", "prog"},
                     {"--restart-policy '1'", "all or rank"});
  expect_usage_error({"--nproc-per-node", "2", "--nnodes", "2", "--master-addr", "h",
                      "--master-port", "80", "--restart-policy", "rank", "prog"},
                     {"--restart-policy rank", "--nnodes 2"});
}

TEST(DistrunOptions, RejectsAMissingProgramAndUnknownOptions) {
  expect_usage_error({"--nproc-per-node", "2"}, {"PROGRAM"});
  expect_usage_error({"--nproc-per-node", "2", "--"}, {"PROGRAM"});
  expect_usage_error({"--nproc-per-node", "2", "--", ""}, {"PROGRAM ''"});
  expect_usage_error({"--nproc-per-node", "2", "--nproc", "4", "prog"}, {"unknown option --nproc"});
  expect_usage_error({"--nproc-per-node", "2", "-x", "prog"}, {"unknown option -x"});
}

TEST(DistrunOptions, ValidateChecksOptionsBuiltInCode) {
  LaunchOptions options;
  options.nproc_per_node = 2;
  options.command = {"prog"};
  EXPECT_NO_THROW(validate(options));
  options.node_rank = 1;
  EXPECT_THROW(validate(options), UsageError);
  options.node_rank = 0;
  options.command.clear();
  EXPECT_THROW(validate(options), UsageError);
  options.command = {"prog"};
  options.master_port = 70000;
  EXPECT_THROW(validate(options), UsageError);
  EXPECT_THROW(run(options), UsageError);
}

TEST(DistrunOptions, RankEnvironmentFollowsTorchrun) {
  ::unsetenv("OMP_NUM_THREADS");
  ::unsetenv("OPENBLAS_THREAD_TIMEOUT");
  ::unsetenv("GOTO_THREAD_TIMEOUT");
  LaunchOptions options;
  options.nproc_per_node = 4;
  options.nnodes = 3;
  options.node_rank = 2;
  options.master_addr = "10.1.2.3";
  options.master_port = 29400;
  options.command = {"prog"};
  std::vector<std::pair<std::string, std::string>> expected = {{"RANK", "9"},
                                                               {"WORLD_SIZE", "12"},
                                                               {"LOCAL_RANK", "1"},
                                                               {"LOCAL_WORLD_SIZE", "4"},
                                                               {"GROUP_RANK", "2"},
                                                               {"MASTER_ADDR", "10.1.2.3"},
                                                               {"MASTER_PORT", "29400"},
                                                               {"DISTRUN_RESTART_COUNT", "0"},
                                                               {"DISTRUN_MAX_RESTARTS", "0"},
                                                               {"OMP_NUM_THREADS", "1"},
                                                               {"OPENBLAS_THREAD_TIMEOUT", "4"}};
  EXPECT_EQ(rank_environment(options, 1), expected);
  options.nnodes = 1;
  options.node_rank = 0;
  options.max_restarts = 5;
  expected[0].second = "1";
  expected[1].second = "4";
  expected[4].second = "0";
  expected[7].second = "2";
  expected[8].second = "5";
  EXPECT_EQ(rank_environment(options, 1, 2), expected);
  // The job's RPC secret file comes last, when there is one.
  expected.emplace_back("DISTOPTIM_RPC_SECRET_FILE", "/tmp/distrun-x/rpc_secret");
  EXPECT_EQ(rank_environment(options, 1, 2, "/tmp/distrun-x/rpc_secret"), expected);
}

// The value distrun gives variable `name` in the environment of local rank 0 of a job of
// `nproc_per_node` ranks per node, or "(not set)".
std::string rank_variable(int nproc_per_node, const std::string& name) {
  LaunchOptions options;
  options.nproc_per_node = nproc_per_node;
  options.master_addr = "127.0.0.1";
  options.master_port = 29400;
  options.command = {"prog"};
  for (const auto& [variable, value] : rank_environment(options, 0)) {
    if (variable == name) return value;
  }
  return "(not set)";
}

// Several ranks on one node get OpenBLAS's idle threads to sleep at once, unless the user chose
// otherwise (either of OpenBLAS's two names); a single rank keeps OpenBLAS's default.
TEST(DistrunOptions, SharedNodeRanksGetAShortBlasThreadTimeout) {
  auto blas_timeout = [](int nproc_per_node) {
    return rank_variable(nproc_per_node, "OPENBLAS_THREAD_TIMEOUT");
  };
  ::unsetenv("OPENBLAS_THREAD_TIMEOUT");
  ::unsetenv("GOTO_THREAD_TIMEOUT");
  EXPECT_EQ(blas_timeout(2), "4");
  EXPECT_EQ(blas_timeout(1), "(not set)");
  ::setenv("OPENBLAS_THREAD_TIMEOUT", "12", 1);
  EXPECT_EQ(blas_timeout(2), "(not set)");  // distrun's own environment passes it on
  ::unsetenv("OPENBLAS_THREAD_TIMEOUT");
  ::setenv("GOTO_THREAD_TIMEOUT", "12", 1);
  EXPECT_EQ(blas_timeout(2), "(not set)");
  ::unsetenv("GOTO_THREAD_TIMEOUT");
}

TEST(DistrunOptions, ResolveMasterDefaultsToLoopbackAndAFreePort) {
  LaunchOptions options;
  options.nproc_per_node = 1;
  options.command = {"prog"};
  const LaunchOptions resolved = resolve_rendezvous(options);
  EXPECT_EQ(resolved.master_addr, "127.0.0.1");
  EXPECT_GE(resolved.master_port, 1);
  EXPECT_LE(resolved.master_port, 65535);

  // Given values are kept.
  options.master_addr = "example.org";
  options.master_port = 4242;
  const LaunchOptions kept = resolve_rendezvous(options);
  EXPECT_EQ(kept.master_addr, "example.org");
  EXPECT_EQ(kept.master_port, 4242);
}

// Several ranks on one node get one OpenMP thread each, as under torchrun (LibTorch's intra-op
// pool and OpenBLAS's own follow it), unless the user chose a count; a single rank keeps the
// defaults.
TEST(DistrunOptions, SharedNodeRanksGetOneOmpThread) {
  auto omp_threads = [](int nproc_per_node) {
    return rank_variable(nproc_per_node, "OMP_NUM_THREADS");
  };
  ::unsetenv("OMP_NUM_THREADS");
  EXPECT_EQ(omp_threads(2), "1");
  EXPECT_EQ(omp_threads(1), "(not set)");
  ::setenv("OMP_NUM_THREADS", "3", 1);
  EXPECT_EQ(omp_threads(2), "(not set)");  // distrun's own environment passes it on
  ::unsetenv("OMP_NUM_THREADS");
}

// --rdzv-backend: static (torchrun's default, today's behaviour) or etcd, with torchrun's names.
TEST(DistrunOptions, RdzvBackendIsStaticByDefaultOrEtcdWithAnEndpoint) {
  const LaunchOptions defaults = parse_command_line({"--nproc-per-node", "2", "prog"});
  EXPECT_EQ(defaults.rdzv_backend, RdzvBackend::kStatic);
  EXPECT_EQ(defaults.rdzv_endpoint, "");
  EXPECT_EQ(defaults.rdzv_id, "");
  EXPECT_EQ(parse_command_line({"--nproc-per-node", "2", "--rdzv-backend", "static", "prog"})
                .rdzv_backend,
            RdzvBackend::kStatic);
  const LaunchOptions etcd =
      parse_command_line({"--nproc-per-node", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                          "10.0.0.5:2379", "--rdzv-id", "train_42.a-b", "prog"});
  EXPECT_EQ(etcd.rdzv_backend, RdzvBackend::kEtcd);
  EXPECT_EQ(etcd.rdzv_endpoint, "10.0.0.5:2379");
  EXPECT_EQ(etcd.rdzv_id, "train_42.a-b");
  const LaunchOptions underscores = parse_command_line(
      {"--nproc_per_node", "2", "--rdzv_backend", "etcd", "--rdzv_endpoint", "[::1]:2379", "prog"});
  EXPECT_EQ(underscores.rdzv_backend, RdzvBackend::kEtcd);
  EXPECT_EQ(underscores.rdzv_endpoint, "[::1]:2379");
  EXPECT_EQ(underscores.rdzv_id, "") << "made at launch (resolve_rendezvous)";
  // Across nodes without restarts the ranks meet in etcd; every node names the job.
  const LaunchOptions nodes = parse_command_line(
      {"--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "etcd",
       "--rdzv-endpoint", "etcd.example:2379", "--rdzv-id", "job", "--rpc-insecure", "prog"});
  EXPECT_EQ(nodes.nnodes, 2);
  EXPECT_EQ(nodes.master_addr, "");
}

TEST(DistrunOptions, RdzvOptionsAreCheckedNamingTheOptionAndValue) {
  const Args base = {"--nproc-per-node", "2"};
  auto with = [&base](Args more) {
    Args args = base;
    args.insert(args.end(), more.begin(), more.end());
    args.push_back("prog");
    return args;
  };
  expect_usage_error(with({"--rdzv-backend", "c10d"}), {"--rdzv-backend 'c10d'", "static or etcd"});
  expect_usage_error(with({"--rdzv-backend", "etcd"}), {"--rdzv-backend etcd", "--rdzv-endpoint"});
  expect_usage_error(with({"--rdzv-endpoint", "h:2379"}),
                     {"--rdzv-endpoint 'h:2379'", "only with --rdzv-backend etcd"});
  expect_usage_error(with({"--rdzv-id", "job"}),
                     {"--rdzv-id 'job'", "only with --rdzv-backend etcd"});
  for (const char* bad : {"h", "h:0", "h:65536", ":2379", "h:x", "h/x:2379", "[::1]2379"}) {
    expect_usage_error(with({"--rdzv-backend", "etcd", "--rdzv-endpoint", bad}),
                       {std::string("--rdzv-endpoint '") + bad + "'", "HOST:PORT"});
  }
  expect_usage_error(with({"--rdzv-backend", "etcd", "--rdzv-endpoint", ""}),
                     {"--rdzv-endpoint ''", "must not be empty"});
  expect_usage_error(
      with({"--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379", "--rdzv-id", "a/b"}),
      {"--rdzv-id 'a/b'", "letters, digits"});
  expect_usage_error(with({"--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379", "--rdzv-id", ""}),
                     {"--rdzv-id ''", "must not be empty"});
  expect_usage_error(
      with({"--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379", "--master-addr", "h"}),
      {"--master-addr 'h'", "only with --rdzv-backend static"});
  expect_usage_error(
      with({"--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379", "--master-port", "29500"}),
      {"--master-port 29500", "only with --rdzv-backend static"});
  // Across nodes: the job must be named alike on every node, and restarts need the static
  // backend (the nodes' distruns coordinate through a store node 0 serves).
  expect_usage_error(with({"--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379"}),
                     {"--rdzv-id is required", "--nnodes 2"});
  expect_usage_error(with({"--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379",
                           "--rdzv-id", "j", "--max-restarts", "1"}),
                     {"--max-restarts 1 with --nnodes 2", "--rdzv-backend static"});
}

// Under etcd, each launch meets under a job of its own; a rank restarted alone rejoins it, and
// every restart of all ranks gets its own (as a new MASTER_PORT under the static backend).
TEST(DistrunOptions, EtcdRanksMeetUnderTheLaunchsJob) {
  ::unsetenv("OMP_NUM_THREADS");
  ::unsetenv("OPENBLAS_THREAD_TIMEOUT");
  ::unsetenv("GOTO_THREAD_TIMEOUT");
  LaunchOptions options =
      parse_command_line({"--nproc-per-node", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                          "127.0.0.1:2379", "--max-restarts", "2", "prog"});
  const LaunchOptions first = resolve_rendezvous(options);
  const LaunchOptions second = resolve_rendezvous(options);
  EXPECT_TRUE(std::regex_match(first.rdzv_id, std::regex("distrun-[0-9a-f]{16}"))) << first.rdzv_id;
  EXPECT_NE(first.rdzv_id, second.rdzv_id);
  EXPECT_EQ(first.master_addr, "") << "no rank serves a store";
  EXPECT_EQ(first.master_port, 0);
  const std::string method = "etcd://127.0.0.1:2379/" + first.rdzv_id;
  const std::vector<std::pair<std::string, std::string>> expected = {
      {"RANK", "0"},
      {"WORLD_SIZE", "1"},
      {"LOCAL_RANK", "0"},
      {"LOCAL_WORLD_SIZE", "1"},
      {"GROUP_RANK", "0"},
      {"DISTOPTIM_RDZV_INIT_METHOD", method},
      {"DISTRUN_RESTART_COUNT", "0"},
      {"DISTRUN_MAX_RESTARTS", "2"}};
  EXPECT_EQ(rank_environment(first, 0), expected);
  EXPECT_EQ(meeting_point(first, 0), "DISTOPTIM_RDZV_INIT_METHOD=" + method);
  // --restart-policy all: a restart is a new group, under a job of its own.
  EXPECT_EQ(etcd_job(first, 2), first.rdzv_id + ".restart-2");
  EXPECT_EQ(rank_environment(first, 0, 2)[5].second, method + ".restart-2");
  // --restart-policy rank: the restarted rank rejoins the others' job.
  LaunchOptions rank_policy = first;
  rank_policy.restart_policy = RestartPolicy::kRank;
  EXPECT_EQ(etcd_job(rank_policy, 2), first.rdzv_id);
  // A job named on the command line is kept.
  options.rdzv_id = "named";
  EXPECT_EQ(resolve_rendezvous(options).rdzv_id, "named");
}

// Only distrun's own values say where the ranks meet: inherited ones would name another job's.
TEST(DistrunOptions, RendezvousVariablesAreDistrunsAlone) {
  for (const char* name : {"MASTER_ADDR", "MASTER_PORT", "DISTOPTIM_RDZV_INIT_METHOD"}) {
    EXPECT_TRUE(is_rendezvous_variable(name)) << name;
  }
  for (const char* name : {"RANK", "MASTER", "DISTOPTIM_RPC_SECRET_FILE", ""}) {
    EXPECT_FALSE(is_rendezvous_variable(name)) << name;
  }
}

// Rank 0 serves the store under the static backend and is never restarted alone; in etcd it is
// restarted like any other rank.
TEST(DistrunOptions, Rank0RestartsAloneOnlyWhenNoRankServesTheStore) {
  LaunchOptions options;
  options.nproc_per_node = 3;
  options.max_restarts = 1;
  options.restart_policy = RestartPolicy::kRank;
  options.command = {"prog"};
  EXPECT_FALSE(may_restart_alone(options, 0, 0, false));
  EXPECT_TRUE(may_restart_alone(options, 1, 0, false));
  options.rdzv_backend = RdzvBackend::kEtcd;
  EXPECT_TRUE(may_restart_alone(options, 0, 0, false));
  EXPECT_FALSE(may_restart_alone(options, 0, 1, false)) << "no restart left";
  EXPECT_FALSE(may_restart_alone(options, 0, 0, true)) << "the job is stopping";
  options.restart_policy = RestartPolicy::kAll;
  EXPECT_FALSE(may_restart_alone(options, 0, 0, false));
}

}  // namespace
}  // namespace launcher
}  // namespace distoptim
