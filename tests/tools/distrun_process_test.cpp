// The real distrun binary, run on distrun_child: environment, output relaying, failure handling,
// signals, usage errors. Every run is killed after kRunTimeout and then fails the test.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "harness/etcd_server.h"

extern char** environ;

namespace {

// A bound on a hung distrun, not on its speed: a run of the etcd tests under ASan on a 2-core
// machine kept busy by other work took 30 s (a restart of every rank meeting twice in etcd).
constexpr auto kRunTimeout = std::chrono::seconds(90);
const std::string kDistrun = DISTOPTIM_DISTRUN_PATH;
const std::string kChild = DISTOPTIM_DISTRUN_CHILD_PATH;
const std::string kRendezvousChild = DISTOPTIM_DISTRUN_RENDEZVOUS_CHILD_PATH;

using Args = std::vector<std::string>;
using Clock = std::chrono::steady_clock;

struct RunResult {
  int status = -1;  // distrun's exit status, or 128 + the signal that killed it
  bool timed_out = false;
  std::string out;
  std::string err;
};

// Called after each read with distrun's pid and its output so far; may send signals.
using OutputHook = std::function<void(pid_t, const RunResult&)>;

// Called after each read with the pid of every distrun and their output so far; may send
// signals.
using OutputsHook = std::function<void(const std::vector<pid_t>&, const std::vector<RunResult>&)>;

// Starts distrun with `args` and this process's environment with `extra_env` (NAME=value) set,
// its stdout and stderr on pipes whose read ends go to `out_fd` and `err_fd`. Returns its pid, or
// -1 after a test failure.
pid_t spawn_distrun(const Args& args, const Args& extra_env, int* out_fd, int* err_fd) {
  int out[2];
  int err[2];
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
    ADD_FAILURE() << "pipe2 failed";
    return -1;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err[1], STDERR_FILENO);

  Args argv_strings = {kDistrun};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  Args env_strings = extra_env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('=') + 1);
    if (std::none_of(extra_env.begin(), extra_env.end(),
                     [&](const std::string& extra) { return extra.rfind(name, 0) == 0; })) {
      env_strings.push_back(entry);
    }
  }
  std::vector<char*> argv;
  std::vector<char*> envp;
  for (auto& s : argv_strings) argv.push_back(s.data());
  for (auto& s : env_strings) envp.push_back(s.data());
  argv.push_back(nullptr);
  envp.push_back(nullptr);

  pid_t pid = -1;
  const int spawn_error =
      ::posix_spawn(&pid, kDistrun.c_str(), &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  ::close(out[1]);
  ::close(err[1]);
  if (spawn_error != 0) {
    ::close(out[0]);
    ::close(err[0]);
    ADD_FAILURE() << "cannot start " << kDistrun << ": " << std::strerror(spawn_error);
    return -1;
  }
  *out_fd = out[0];
  *err_fd = err[0];
  return pid;
}

// Runs one distrun per element of `runs` at the same time (as the nodes of one job), collecting
// their stdout and stderr until all have exited. Kills those still running after kRunTimeout.
std::vector<RunResult> run_distruns(const std::vector<Args>& runs, const OutputsHook& hook = {},
                                    const Args& extra_env = {}) {
  std::vector<RunResult> results(runs.size());
  std::vector<pid_t> pids;
  std::vector<pollfd> fds;
  std::vector<std::string*> sinks;
  for (size_t i = 0; i < runs.size(); ++i) {
    int out = -1;
    int err = -1;
    const pid_t pid = spawn_distrun(runs[i], extra_env, &out, &err);
    pids.push_back(pid);
    if (pid < 0) continue;
    fds.push_back({out, POLLIN, 0});
    fds.push_back({err, POLLIN, 0});
    sinks.push_back(&results[i].out);
    sinks.push_back(&results[i].err);
  }

  // distrun's death closes the pipes (its ranks die with it), so reading ends after a kill too;
  // the second deadline only guards against a broken test.
  const auto deadline = Clock::now() + kRunTimeout;
  bool killed = false;
  const auto open = [&] {
    return std::any_of(fds.begin(), fds.end(), [](const pollfd& fd) { return fd.fd >= 0; });
  };
  while (open()) {
    const auto now = Clock::now();
    if (!killed && now >= deadline) {
      killed = true;
      for (size_t i = 0; i < pids.size(); ++i) {
        if (pids[i] > 0) ::kill(pids[i], SIGKILL);
        results[i].timed_out = true;
      }
    }
    if (now >= deadline + std::chrono::seconds(10)) break;
    ::poll(fds.data(), fds.size(), 100);
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char buffer[65536];
      const ssize_t n = ::read(fds[i].fd, buffer, sizeof buffer);
      if (n > 0) {
        sinks[i]->append(buffer, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
      }
    }
    if (hook) hook(pids, results);
  }
  for (const auto& fd : fds) {
    if (fd.fd >= 0) ::close(fd.fd);
  }
  for (size_t i = 0; i < pids.size(); ++i) {
    if (pids[i] < 0) continue;
    int status = 0;
    ::waitpid(pids[i], &status, 0);
    RunResult& result = results[i];
    result.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    EXPECT_FALSE(result.timed_out)
        << "distrun ran longer than " << kRunTimeout.count() << " s and was killed; stdout:\n"
        << result.out << "\nstderr:\n"
        << result.err;
  }
  return results;
}

// Runs distrun with `args` (see run_distruns).
RunResult run_distrun(const Args& args, const OutputHook& hook = {}, const Args& extra_env = {}) {
  OutputsHook each;
  if (hook) {
    each = [&hook](const std::vector<pid_t>& pids, const std::vector<RunResult>& results) {
      hook(pids[0], results[0]);
    };
  }
  return run_distruns({args}, each, extra_env)[0];
}

Args split_lines(const std::string& text) {
  Args lines;
  size_t start = 0;
  while (start < text.size()) {
    const size_t newline = text.find('\n', start);
    if (newline == std::string::npos) {
      ADD_FAILURE() << "output does not end with a newline: ..." << text.substr(start);
      lines.push_back(text.substr(start));
      break;
    }
    lines.push_back(text.substr(start, newline - start));
    start = newline + 1;
  }
  return lines;
}

// Lines of `text` by rank, prefix removed. Lines without a rank prefix (distrun's own) go to
// `other`.
std::map<int, Args> lines_by_rank(const std::string& text, Args* other = nullptr) {
  static const std::regex kPrefix(R"(^\[rank (\d+)\] )");
  std::map<int, Args> by_rank;
  for (const auto& line : split_lines(text)) {
    std::smatch match;
    if (std::regex_search(line, match, kPrefix)) {
      by_rank[std::stoi(match[1])].push_back(match.suffix());
    } else if (other != nullptr) {
      other->push_back(line);
    } else {
      ADD_FAILURE() << "line without a rank prefix: " << line;
    }
  }
  return by_rank;
}

void expect_ends_with(const std::string& err, const std::string& end) {
  EXPECT_TRUE(err.size() >= end.size() &&
              err.compare(err.size() - end.size(), end.size(), end) == 0)
      << "stderr does not end with:\n"
      << end << "stderr:\n"
      << err;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The pid of every rank that printed "ready pid=P" so far.
std::map<int, pid_t> ready_ranks(const std::string& out) {
  static const std::regex kReady(R"(\[rank (\d+)\] ready pid=(\d+))");
  std::map<int, pid_t> pids;
  for (std::sregex_iterator it(out.begin(), out.end(), kReady), end; it != end; ++it) {
    pids[std::stoi((*it)[1])] = std::stoi((*it)[2]);
  }
  return pids;
}

// A hook that, once `ranks` ranks are ready, calls `action(distrun_pid, rank_pids)` once.
OutputHook when_ready(size_t ranks,
                      std::function<void(pid_t, const std::map<int, pid_t>&)> action) {
  auto done = std::make_shared<bool>(false);
  return [=](pid_t distrun, const RunResult& so_far) {
    if (*done) return;
    const auto pids = ready_ranks(so_far.out);
    if (pids.size() < ranks) return;
    *done = true;
    action(distrun, pids);
  };
}

// Whether process `pid` is gone or a zombie.
bool process_gone(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content;
  if (!std::getline(stat, content)) return true;
  const size_t paren = content.rfind(')');
  return paren == std::string::npos || paren + 2 >= content.size() || content[paren + 2] == 'Z' ||
         content[paren + 2] == 'X';
}

TEST(Distrun, EachLocalRankGetsItsEnvironment) {
  const RunResult r = run_distrun({"--nproc-per-node", "3", kChild, "env"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");
  const auto by_rank = lines_by_rank(r.out);
  ASSERT_EQ(by_rank.size(), 3u) << r.out;
  // The port is found free at start; every rank must see the same one.
  std::smatch match;
  ASSERT_TRUE(std::regex_search(by_rank.at(0).at(0), match, std::regex(R"(MASTER_PORT=(\d+)$)")));
  const int port = std::stoi(match[1]);
  EXPECT_GE(port, 1);
  EXPECT_LE(port, 65535);
  for (int rank = 0; rank < 3; ++rank) {
    const std::string expected =
        "RANK=" + std::to_string(rank) + " WORLD_SIZE=3 LOCAL_RANK=" + std::to_string(rank) +
        " LOCAL_WORLD_SIZE=3 GROUP_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
        std::to_string(port);
    EXPECT_EQ(by_rank.at(rank), Args{expected}) << "rank " << rank;
  }
}

TEST(Distrun, SecondNodeOfTwoGetsTheUpperRanks) {
  const RunResult r =
      run_distrun({"--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--master-addr",
                   "10.0.0.5", "--master-port", "29512", "--rpc-insecure", kChild, "env"});
  ASSERT_EQ(r.status, 0) << r.err;
  const std::map<int, Args> expected = {
      {2,
       {"RANK=2 WORLD_SIZE=4 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 GROUP_RANK=1 MASTER_ADDR=10.0.0.5 "
        "MASTER_PORT=29512"}},
      {3,
       {"RANK=3 WORLD_SIZE=4 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 GROUP_RANK=1 MASTER_ADDR=10.0.0.5 "
        "MASTER_PORT=29512"}}};
  EXPECT_EQ(lines_by_rank(r.out), expected);
}

TEST(Distrun, DistrunsVariablesReplaceInheritedOnes) {
  const RunResult r = run_distrun({"--nproc-per-node", "1", kChild, "env"}, {},
                                  {"RANK=77", "MASTER_ADDR=elsewhere", "WORLD_SIZE=9"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 0] RANK=0 WORLD_SIZE=1 ")) << r.out;
  EXPECT_TRUE(contains(r.out, " MASTER_ADDR=127.0.0.1 ")) << r.out;
}

// A job on one node gets an RPC secret of its own: the same file for every rank, readable by its
// user alone, gone when distrun exits.
TEST(Distrun, AJobOnOneNodeGetsAPrivateSecretFile) {
  const RunResult r =
      run_distrun({"--nproc-per-node", "2", kChild, "secret"}, {}, {"DISTOPTIM_RPC_SECRET_FILE="});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto by_rank = lines_by_rank(r.out);
  ASSERT_EQ(by_rank.size(), 2u) << r.out;
  std::smatch match;
  ASSERT_TRUE(std::regex_match(
      by_rank.at(0).at(0), match,
      std::regex(R"(secret path=(\S+) file-mode=600 dir-mode=700 bytes=64 hex=yes)")))
      << r.out;
  const std::string path = match[1];
  EXPECT_EQ(by_rank.at(1), by_rank.at(0));
  EXPECT_FALSE(std::filesystem::exists(path)) << path << " outlived the job";
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(path).parent_path()));

  // Another job, another secret.
  const RunResult again =
      run_distrun({"--nproc-per-node", "1", kChild, "secret"}, {}, {"DISTOPTIM_RPC_SECRET_FILE="});
  ASSERT_EQ(again.status, 0) << again.err;
  EXPECT_FALSE(contains(again.out, "path=" + path + " ")) << again.out;
}

// A secret file the user names (--rpc-secret-file, or DISTOPTIM_RPC_SECRET_FILE in distrun's
// environment) reaches the ranks as it is, on one node or several; --rpc-insecure reaches them as
// DISTOPTIM_RPC_INSECURE=1 and no secret, even when distrun's environment named one.
TEST(Distrun, ASecretFileTheUserNamesIsKept) {
  const std::string path =
      ::testing::TempDir() + "distrun_users_secret_" + std::to_string(::getpid());
  std::ofstream(path) << "users-secret";
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  const std::string expected = "[rank 0] secret path=" + path + " file-mode=600 ";
  const RunResult given =
      run_distrun({"--nproc-per-node", "1", "--rpc-secret-file", path, kChild, "secret"});
  ASSERT_EQ(given.status, 0) << given.err;
  EXPECT_TRUE(contains(given.out, expected)) << given.out;
  const RunResult in_environment = run_distrun({"--nproc-per-node", "1", kChild, "secret"}, {},
                                               {"DISTOPTIM_RPC_SECRET_FILE=" + path});
  ASSERT_EQ(in_environment.status, 0) << in_environment.err;
  EXPECT_TRUE(contains(in_environment.out, expected)) << in_environment.out;
  const RunResult across = run_distrun({"--nnodes", "2", "--node-rank", "1", "--master-addr",
                                        "10.0.0.5", "--master-port", "29512", "--nproc-per-node",
                                        "1", "--rpc-secret-file", path, kChild, "secret"});
  ASSERT_EQ(across.status, 0) << across.err;
  EXPECT_TRUE(contains(across.out, "[rank 1] secret path=" + path + " file-mode=600 "))
      << across.out;
  const RunResult insecure =
      run_distrun({"--nproc-per-node", "1", "--rpc-insecure", kChild, "secret"}, {},
                  {"DISTOPTIM_RPC_SECRET_FILE=", "DISTOPTIM_RPC_INSECURE=0"});
  ASSERT_EQ(insecure.status, 0) << insecure.err;
  EXPECT_EQ(insecure.out, "[rank 0] secret none insecure=1\n");
  std::remove(path.c_str());
}

// LibTorch is in distrun's store module, loaded only for what needs a store of its own: a job on
// one node starts without it (its ranks load their own), one whose ranks meet in etcd loads it
// to check the endpoint as their store will.
TEST(Distrun, LoadsLibTorchOnlyWhereAStoreNeedsIt) {
  const RunResult alone =
      run_distrun({"--nproc-per-node", "1", kChild, "parent-maps", "libtorch_cpu"});
  ASSERT_EQ(alone.status, 0) << alone.err;
  EXPECT_EQ(alone.out, "[rank 0] parent maps libtorch_cpu: no\n");
  const RunResult etcd =
      run_distrun({"--nproc-per-node", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                   "127.0.0.1:1", kChild, "parent-maps", "libtorch_cpu"});
  ASSERT_EQ(etcd.status, 0) << etcd.err;
  EXPECT_EQ(etcd.out, "[rank 0] parent maps libtorch_cpu: yes\n");
}

TEST(Distrun, ArgumentsReachTheProgramUntouched) {
  const RunResult r = run_distrun(
      {"--nproc-per-node", "1", kChild, "args", "--nproc-per-node", "9", "--", "-x", "--help"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out,
            "[rank 0] arg=--nproc-per-node\n[rank 0] arg=9\n[rank 0] arg=--\n[rank 0] arg=-x\n"
            "[rank 0] arg=--help\n");

  const RunResult dashed = run_distrun({"--nproc-per-node", "1", "--", kChild, "args", "-y"});
  ASSERT_EQ(dashed.status, 0) << dashed.err;
  EXPECT_EQ(dashed.out, "[rank 0] arg=-y\n");
}

TEST(Distrun, FindsTheProgramOnPath) {
  const std::string dir = kChild.substr(0, kChild.rfind('/'));
  const std::string name = kChild.substr(kChild.rfind('/') + 1);
  const RunResult r = run_distrun({"--nproc-per-node", "2", name, "args", "ok"}, {},
                                  {"PATH=" + dir + ":/usr/bin:/bin"});
  ASSERT_EQ(r.status, 0) << r.err;
  const std::map<int, Args> expected = {{0, {"arg=ok"}}, {1, {"arg=ok"}}};
  EXPECT_EQ(lines_by_rank(r.out), expected);
}

TEST(Distrun, EveryLineIsPrefixedWholeAndInOrder) {
  constexpr int kRanks = 4;
  constexpr int kLines = 300;
  const RunResult r = run_distrun(
      {"--nproc-per-node", std::to_string(kRanks), kChild, "lines", std::to_string(kLines)});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto out = lines_by_rank(r.out);
  const auto err = lines_by_rank(r.err);
  ASSERT_EQ(out.size(), static_cast<size_t>(kRanks));
  ASSERT_EQ(err.size(), static_cast<size_t>(kRanks));
  for (int rank = 0; rank < kRanks; ++rank) {
    Args expected_out;
    Args expected_err;
    for (int i = 0; i < kLines; ++i) {
      const std::string id = std::to_string(rank) + "-" + std::to_string(i);
      expected_out.push_back("line " + id + " " +
                             std::string(80, static_cast<char>('a' + (rank + i) % 26)));
      expected_err.push_back("err " + id);
    }
    // The partial last lines, completed with a newline at end of file.
    expected_out.push_back("tail " + std::to_string(rank));
    expected_err.push_back("errtail " + std::to_string(rank));
    EXPECT_EQ(out.at(rank), expected_out) << "stdout of rank " << rank;
    EXPECT_EQ(err.at(rank), expected_err) << "stderr of rank " << rank;
  }
}

TEST(Distrun, ALineLongerThan64KiBIsWrittenInPieces) {
  constexpr size_t kBytes = 200000;
  constexpr size_t kPiece = 64 * 1024;
  const RunResult r =
      run_distrun({"--nproc-per-node", "1", kChild, "long", std::to_string(kBytes)});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto out = lines_by_rank(r.out);
  ASSERT_EQ(out.size(), 1u);
  const Args& pieces = out.at(0);
  ASSERT_EQ(pieces.size(), (kBytes + kPiece - 1) / kPiece);
  std::string joined;
  for (const auto& piece : pieces) {
    EXPECT_LE(piece.size(), kPiece);
    joined += piece;
  }
  std::string expected(kBytes, ' ');
  for (size_t i = 0; i < kBytes; ++i) expected[i] = static_cast<char>('a' + i % 26);
  EXPECT_EQ(joined, expected);
}

// Ranks print "ready pid=P"; once all are ready, rank `failing` is told to fail.
RunResult run_with_failing_rank(const Args& distrun_args, int ranks, int failing,
                                const std::string& how, int n, const std::string& others) {
  Args args = distrun_args;
  for (const std::string& a :
       {std::string("--nproc-per-node"), std::to_string(ranks), kChild, std::string("fail-on"),
        std::to_string(failing), how, std::to_string(n), others}) {
    args.push_back(a);
  }
  return run_distrun(args, when_ready(ranks, [failing](pid_t, const std::map<int, pid_t>& pids) {
                       ::kill(pids.at(failing), SIGUSR1);
                     }));
}

TEST(Distrun, AFailingRankStopsTheOthersAndSetsTheExitStatus) {
  const RunResult r = run_with_failing_rank({}, 3, 1, "exit", 3, "sleep");
  EXPECT_EQ(r.status, 3) << r.err;
  const auto pids = ready_ranks(r.out);
  ASSERT_EQ(pids.size(), 3u) << r.out;
  EXPECT_TRUE(contains(
      r.err, "distrun: rank 1 (pid " + std::to_string(pids.at(1)) + ") exited with status 3\n"))
      << r.err;
  // The sleeping ranks were stopped by distrun's SIGTERM, before their sleep ended.
  for (int rank : {0, 2}) {
    EXPECT_TRUE(contains(r.err, "distrun: rank " + std::to_string(rank) + " (pid " +
                                    std::to_string(pids.at(rank)) +
                                    ") was killed by signal SIGTERM\n"))
        << r.err;
  }
  EXPECT_FALSE(contains(r.out, "done")) << r.out;
}

// Rank 2 fails while rank 1 hangs (as a rank whose collective failed exits while the rank it
// waited for still sleeps): the summary shows both, not only the first to exit.
TEST(Distrun, AFailedJobEndsWithHowEveryRankEnded) {
  const RunResult r = run_with_failing_rank({}, 3, 2, "exit", 3, "sleep");
  EXPECT_EQ(r.status, 3) << r.err;
  const auto pids = ready_ranks(r.out);
  ASSERT_EQ(pids.size(), 3u) << r.out;
  const auto stopped = [&](int rank) {
    return "distrun:   rank " + std::to_string(rank) + " (pid " + std::to_string(pids.at(rank)) +
           "): killed by signal SIGTERM; it was still running and distrun stopped it with "
           "SIGTERM\n";
  };
  const std::string summary = "distrun: how each rank ended:\n" + stopped(0) + stopped(1) +
                              "distrun:   rank 2 (pid " + std::to_string(pids.at(2)) +
                              "): exited with status 3 (the first failure)\n";
  expect_ends_with(r.err, summary);
}

TEST(Distrun, ARankKilledByASignalGivesStatus128PlusTheSignal) {
  const RunResult r = run_with_failing_rank({}, 2, 0, "signal", SIGKILL, "sleep");
  EXPECT_EQ(r.status, 128 + SIGKILL) << r.err;
  EXPECT_TRUE(contains(r.err, "distrun: rank 0 (pid ")) << r.err;
  EXPECT_TRUE(contains(r.err, ") was killed by signal SIGKILL\n")) << r.err;
  EXPECT_FALSE(contains(r.out, "done")) << r.out;
}

TEST(Distrun, RanksIgnoringSigtermAreKilledAfterTheGracePeriod) {
  const RunResult r =
      run_with_failing_rank({"--grace-seconds", "0.5"}, 3, 2, "exit", 5, "ignore-term");
  EXPECT_EQ(r.status, 5) << r.err;
  EXPECT_TRUE(contains(r.err, "distrun: rank 2 (pid ")) << r.err;
  EXPECT_TRUE(contains(r.err, "sending SIGKILL to rank(s) 0 1\n")) << r.err;
  for (int rank : {0, 1}) {
    EXPECT_TRUE(
        std::regex_search(r.err, std::regex("distrun: rank " + std::to_string(rank) +
                                            R"( \(pid \d+\) was killed by signal SIGKILL)")))
        << r.err;
  }
  EXPECT_FALSE(contains(r.out, "done")) << r.out;
}

class DistrunSignal : public ::testing::TestWithParam<int> {};

TEST_P(DistrunSignal, ASignalToDistrunReachesEveryRank) {
  const int signo = GetParam();
  const RunResult r = run_distrun(
      {"--nproc-per-node", "3", kChild, "trap"},
      when_ready(3,
                 [signo](pid_t distrun, const std::map<int, pid_t>&) { ::kill(distrun, signo); }));
  EXPECT_EQ(r.status, 128 + signo) << r.err;
  const std::string got = std::string("got SIG") + ::sigabbrev_np(signo);
  const auto out = lines_by_rank(r.out);
  ASSERT_EQ(out.size(), 3u) << r.out;
  for (const auto& [rank, lines] : out) {
    EXPECT_EQ(lines.back(), got) << "rank " << rank << "\n" << r.out;
  }
}

INSTANTIATE_TEST_SUITE_P(SigtermAndSigint, DistrunSignal, ::testing::Values(SIGTERM, SIGINT));

// The numbers `line` captures in each line of rank `rank` that matches it whole.
template <size_t N>
std::vector<std::array<int, N>> matching_lines(const std::string& out, int rank,
                                               const std::regex& line) {
  std::vector<std::array<int, N>> found;
  const auto by_rank = lines_by_rank(out);
  if (by_rank.count(rank) == 0) return found;
  for (const auto& text : by_rank.at(rank)) {
    std::smatch match;
    if (!std::regex_match(text, match, line)) continue;
    std::array<int, N> numbers{};
    for (size_t i = 0; i < N; ++i) numbers[i] = std::stoi(match[i + 1]);
    found.push_back(numbers);
  }
  return found;
}

// The "attempt ..." lines of rank `rank`: {DISTRUN_RESTART_COUNT, DISTRUN_MAX_RESTARTS, port}.
std::vector<std::array<int, 3>> attempts_of(const std::string& out, int rank) {
  static const std::regex kAttempt(
      R"(^attempt DISTRUN_RESTART_COUNT=(\d+) DISTRUN_MAX_RESTARTS=(\d+) MASTER_PORT=(\d+)$)");
  return matching_lines<3>(out, rank, kAttempt);
}

// Rank 1 fails in the first two attempts; each time every rank is stopped and all start again,
// on a new port, with the restart count one higher; the third attempt succeeds.
TEST(Distrun, RestartsEveryRankAfterAFailureUntilAnAttemptSucceeds) {
  const RunResult r = run_distrun(
      {"--nproc-per-node", "2", "--max-restarts", "3", kChild, "fail-until", "2", "1", "3"});
  EXPECT_EQ(r.status, 0) << r.err;
  const auto attempts = attempts_of(r.out, 1);
  ASSERT_EQ(attempts.size(), 3u) << r.out;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(attempts[i][0], i) << r.out;
    EXPECT_EQ(attempts[i][1], 3) << r.out;
  }
  EXPECT_NE(attempts[0][2], attempts[1][2]) << "a restart must not reuse the old round's port";
  EXPECT_NE(attempts[1][2], attempts[2][2]) << "a restart must not reuse the old round's port";
  // Rank 0 of the last attempt met on the same port as rank 1.
  const auto rank0 = attempts_of(r.out, 0);
  ASSERT_FALSE(rank0.empty()) << r.out;
  EXPECT_EQ(rank0.back(), attempts[2]) << r.out;
  for (int restart : {1, 2}) {
    EXPECT_TRUE(contains(
        r.err, "distrun: attempt " + std::to_string(restart) +
                   " failed (rank 1 failed first); restarting the 2 local rank(s): restart " +
                   std::to_string(restart) +
                   " of at most 3, DISTRUN_RESTART_COUNT=" + std::to_string(restart) +
                   ", MASTER_PORT=" + std::to_string(attempts[restart][2]) + "\n"))
        << r.err;
  }
  EXPECT_FALSE(contains(r.err, "attempt 3 failed")) << r.err;
  // The sleeping rank 0 of the failed attempts was stopped, not left to finish.
  EXPECT_FALSE(contains(r.out, "done")) << r.out;
}

TEST(Distrun, ARestartKeepsAPortGivenOnTheCommandLine) {
  const RunResult r = run_distrun({"--nproc-per-node", "1", "--master-port", "29517",
                                   "--max-restarts", "1", kChild, "fail-until", "1", "0", "3"});
  EXPECT_EQ(r.status, 0) << r.err;
  const auto attempts = attempts_of(r.out, 0);
  ASSERT_EQ(attempts.size(), 2u) << r.out;
  EXPECT_EQ(attempts[0][2], 29517);
  EXPECT_EQ(attempts[1][2], 29517);
}

// Every attempt fails: the exit status is the last attempt's first failure, and stderr ends with
// why no restart followed and how every rank ended in every attempt.
TEST(Distrun, WhenNoRestartIsLeftTheJobEndsWithEveryAttempt) {
  const RunResult r = run_distrun(
      {"--nproc-per-node", "2", "--max-restarts", "2", kChild, "fail-until", "99", "0", "4"});
  EXPECT_EQ(r.status, 4) << r.err;
  EXPECT_EQ(attempts_of(r.out, 0).size(), 3u) << r.out;
  std::string pattern =
      R"(distrun: attempt 3 failed and no restart is left \(--max-restarts 2\); exit status 4\n)";
  for (int attempt = 1; attempt <= 3; ++attempt) {
    pattern += "distrun: attempt " + std::to_string(attempt) + R"( \(DISTRUN_RESTART_COUNT=)" +
               std::to_string(attempt - 1) +
               R"(\), how each rank ended:\n)"
               R"(distrun:   rank 0 \(pid \d+\): exited with status 4 \(the first failure\)\n)"
               R"(distrun:   rank 1 \(pid \d+\): killed by signal SIGTERM; it was still running )"
               R"(and distrun stopped it with SIGTERM\n)";
  }
  EXPECT_TRUE(std::regex_search(r.err, std::regex(pattern + "$"))) << r.err;
  EXPECT_TRUE(contains(r.err, "restart 2 of at most 2, DISTRUN_RESTART_COUNT=2")) << r.err;
}

TEST(Distrun, ASignalToDistrunIsNeverFollowedByARestart) {
  const RunResult r = run_distrun(
      {"--nproc-per-node", "2", "--max-restarts", "3", kChild, "trap"},
      when_ready(2, [](pid_t distrun, const std::map<int, pid_t>&) { ::kill(distrun, SIGTERM); }));
  EXPECT_EQ(r.status, 128 + SIGTERM) << r.err;
  EXPECT_EQ(ready_ranks(r.out).size(), 2u) << r.out;
  EXPECT_EQ(lines_by_rank(r.out)[0].size(), 2u) << "one attempt only\n" << r.out;
  EXPECT_FALSE(contains(r.err, "restarting")) << r.err;
  EXPECT_TRUE(contains(r.err, "distrun: got SIGTERM during attempt 1; no restart after a signal\n"))
      << r.err;
}

// The "attempt ... pid=P" lines of rank-fail-until for rank `rank`: {DISTRUN_RESTART_COUNT,
// DISTRUN_MAX_RESTARTS, MASTER_PORT, pid}.
std::vector<std::array<int, 4>> runs_of(const std::string& out, int rank) {
  static const std::regex kRun(
      R"(^attempt DISTRUN_RESTART_COUNT=(\d+) DISTRUN_MAX_RESTARTS=(\d+) MASTER_PORT=(\d+) )"
      R"(pid=(\d+)$)");
  return matching_lines<4>(out, rank, kRun);
}

// --restart-policy rank: rank 1 of 3 fails in its first two runs and is restarted alone, with
// its own DISTRUN_RESTART_COUNT and the same MASTER_PORT, while ranks 0 and 2 run on untouched
// (they exit once the test has seen rank 1's third run).
TEST(Distrun, ARankPolicyRestartsTheFailedRankAloneWhileTheOthersRun) {
  auto released = std::make_shared<bool>(false);
  const RunResult r =
      run_distrun({"--nproc-per-node", "3", "--max-restarts", "3", "--restart-policy", "rank",
                   kChild, "rank-fail-until", "2", "1", "3"},
                  [released](pid_t, const RunResult& so_far) {
                    const auto ready = ready_ranks(so_far.out);
                    if (*released || ready.size() < 2 || runs_of(so_far.out, 1).size() < 3) return;
                    *released = true;
                    for (const auto& [rank, pid] : ready) ::kill(pid, SIGUSR1);
                  });
  ASSERT_TRUE(*released) << r.out << r.err;
  EXPECT_EQ(r.status, 0) << r.err;
  const auto ready = ready_ranks(r.out);
  const auto failing = runs_of(r.out, 1);
  ASSERT_EQ(failing.size(), 3u) << r.out;
  for (int rank : {0, 2}) {
    // One run only: its pid never changed.
    const auto runs = runs_of(r.out, rank);
    ASSERT_EQ(runs.size(), 1u) << "rank " << rank << " was restarted\n" << r.out;
    EXPECT_EQ(runs[0][3], ready.at(rank)) << r.out;
    EXPECT_EQ(runs[0][0], 0);
    EXPECT_EQ(runs[0][2], failing[0][2]) << "rank 1 rejoins on the job's MASTER_PORT";
  }
  for (int run = 0; run < 3; ++run) {
    EXPECT_EQ(failing[run][0], run) << r.out;
    EXPECT_EQ(failing[run][1], 3) << r.out;
    EXPECT_EQ(failing[run][2], failing[0][2]) << "a rank restarted alone keeps the port";
  }
  EXPECT_NE(failing[0][3], failing[1][3]);
  EXPECT_NE(failing[1][3], failing[2][3]);
  const std::string port = std::to_string(failing[0][2]);
  for (int restart : {1, 2}) {
    EXPECT_TRUE(contains(
        r.err, "distrun: rank 1 (pid " + std::to_string(failing[restart - 1][3]) +
                   ") exited with status 3\ndistrun: restarting rank 1 alone "
                   "(--restart-policy rank): restart " +
                   std::to_string(restart) +
                   " of at most 3 for this rank, DISTRUN_RESTART_COUNT=" + std::to_string(restart) +
                   ", MASTER_PORT=" + port + "; the other ranks keep running\n"))
        << r.err;
  }
  const auto pid = [&](int rank) { return std::to_string(ready.at(rank)); };
  const std::string report =
      "distrun: every rank exited with status 0\n"
      "distrun: restarted alone (--restart-policy rank): rank 1 2 time(s)\n"
      "distrun: how each rank ended (--restart-policy rank; a restarted rank's earlier runs below "
      "it):\n"
      "distrun:   rank 0 (pid " +
      pid(0) +
      "): exited with status 0\n"
      "distrun:   rank 1 (pid " +
      std::to_string(failing[2][3]) +
      "): exited with status 0; restarted alone 2 time(s), its earlier runs:\n"
      "distrun:     run 1 (pid " +
      std::to_string(failing[0][3]) +
      ", DISTRUN_RESTART_COUNT=0): exited with status 3\n"
      "distrun:     run 2 (pid " +
      std::to_string(failing[1][3]) +
      ", DISTRUN_RESTART_COUNT=1): exited with status 3\n"
      "distrun:   rank 2 (pid " +
      pid(2) + "): exited with status 0\n";
  expect_ends_with(r.err, report);
}

// --restart-policy rank: rank 0 (the rendezvous store's host) is never restarted, and a rank out
// of restarts ends the job; either way the others are stopped, as without restarts.
TEST(Distrun, ARankPolicyEndsTheJobWhenRank0FailsOrARankRunsOutOfRestarts) {
  const RunResult rank0 =
      run_distrun({"--nproc-per-node", "2", "--max-restarts", "2", "--restart-policy", "rank",
                   kChild, "rank-fail-until", "1", "0", "3"});
  EXPECT_EQ(rank0.status, 3) << rank0.err;
  EXPECT_EQ(runs_of(rank0.out, 0).size(), 1u) << rank0.out;
  EXPECT_FALSE(contains(rank0.err, "restarting")) << rank0.err;
  EXPECT_TRUE(std::regex_search(
      rank0.err,
      std::regex(R"(distrun: rank 0 failed; under --restart-policy rank it is never restarted )"
                 R"(\(it serves the rendezvous store the other ranks meet in\), so the job ends; )"
                 R"(exit status 3\n)"
                 R"(distrun: how each rank ended \(--restart-policy rank; [^\n]*\n)"
                 R"(distrun:   rank 0 \(pid \d+\): exited with status 3 \(the first failure\)\n)"
                 R"(distrun:   rank 1 \(pid \d+\): killed by signal SIGTERM; it was still )"
                 R"(running and distrun stopped it with SIGTERM\n$)")))
      << rank0.err;

  const RunResult spent =
      run_distrun({"--nproc-per-node", "2", "--max-restarts", "1", "--restart-policy", "rank",
                   kChild, "rank-fail-until", "99", "1", "4"});
  EXPECT_EQ(spent.status, 4) << spent.err;
  const auto runs = runs_of(spent.out, 1);
  ASSERT_EQ(runs.size(), 2u) << spent.out;
  EXPECT_EQ(runs_of(spent.out, 0).size(), 1u) << spent.out;
  EXPECT_TRUE(std::regex_search(
      spent.err,
      std::regex(R"(distrun: rank 1 failed after 1 restart\(s\) and no restart is left for it )"
                 R"(\(--max-restarts 1, per rank\); exit status 4\n)"
                 R"(distrun: restarted alone \(--restart-policy rank\): rank 1 1 time\(s\)\n)"
                 R"(distrun: how each rank ended \(--restart-policy rank; [^\n]*\n)"
                 R"(distrun:   rank 0 \(pid \d+\): killed by signal SIGTERM; it was still )"
                 R"(running and distrun stopped it with SIGTERM\n)"
                 "distrun:   rank 1 \\(pid " +
                 std::to_string(runs[1][3]) +
                 R"(\): exited with status 4 \(the first failure\); restarted alone 1 time\(s\), )"
                 R"(its earlier runs:\n)"
                 "distrun:     run 1 \\(pid " +
                 std::to_string(runs[0][3]) +
                 R"(, DISTRUN_RESTART_COUNT=0\): exited with status 4\n$)")))
      << spent.err;
}

// --restart-policy rank: after SIGTERM to distrun, the ranks it kills are not restarted.
TEST(Distrun, ARankPolicyNeverRestartsAfterASignal) {
  const RunResult r = run_distrun(
      {"--nproc-per-node", "2", "--max-restarts", "3", "--restart-policy", "rank", kChild, "sleep"},
      when_ready(2, [](pid_t distrun, const std::map<int, pid_t>&) { ::kill(distrun, SIGTERM); }));
  EXPECT_EQ(r.status, 128 + SIGTERM) << r.err;
  EXPECT_EQ(ready_ranks(r.out).size(), 2u) << r.out;
  EXPECT_EQ(lines_by_rank(r.out)[1].size(), 1u) << "rank 1 ran once\n" << r.out;
  EXPECT_FALSE(contains(r.err, "restarting")) << r.err;
  EXPECT_TRUE(contains(r.err, "distrun: got SIGTERM; no restart after a signal\n")) << r.err;
}

// The first rank to fail (rank 1) names, in one of distoptim's error formats, rank 2, which
// still sleeps: the summary points there.
TEST(Distrun, TheSummaryPointsAtTheRankTheFirstFailureNames) {
  const Args errors = {
      "allreduce #4 on group [0, 1, 2] failed at rank 1: timed out; these ranks never reached "
      "it: 2",
      "broadcast #2 on group [0, 1, 2] failed at rank 1: rank 2 is lost",
      "rpc shutdown: worker 'ps' waited 3000 ms at barrier 'entered'; never arrived: "
      "'trainer' (rank 2)",
      "new_group: rank 1 cannot connect: could not reach rank 2; Gloo: Connect timeout",
  };
  for (const auto& error : errors) {
    const RunResult r =
        run_distrun({"--nproc-per-node", "3", kChild, "fail-saying", "1", "1", error});
    EXPECT_EQ(r.status, 1) << r.err;
    EXPECT_TRUE(std::regex_search(
        r.err,
        std::regex(R"(distrun: how each rank ended:\n)"
                   R"(distrun:   rank 0 \(pid \d+\): killed by signal SIGTERM; it was still )"
                   R"(running and distrun stopped it with SIGTERM\n)"
                   R"(distrun:   rank 1 \(pid \d+\): exited with status 1 \(the first to fail, )"
                   R"(but its error names rank 2, which was still running \(stopped by )"
                   R"(distrun\): look there first\)\n)"
                   R"(distrun:   rank 2 \(pid \d+\): killed by signal SIGTERM; it was still )"
                   R"(running and distrun stopped it with SIGTERM; named by the error of rank )"
                   R"(1, the first to fail\n$)")))
        << error << "\n"
        << r.err;
  }
  // A named rank on another node (node 1's distrun alone, without restarts) is named, no more.
  const RunResult remote =
      run_distrun({"--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                   "--master-port", "9", "--nproc-per-node", "1", "--rpc-insecure", kChild,
                   "fail-saying", "1", "1", "rank 0 is lost"});
  EXPECT_EQ(remote.status, 1) << remote.err;
  EXPECT_TRUE(std::regex_search(
      remote.err, std::regex(R"(distrun:   rank 1 \(pid \d+\): exited with status 1 \(the first )"
                             R"(failure; its error names rank 0 \(not on this node\)\)\n$)")))
      << remote.err;
  // An error that names only its own rank changes nothing.
  const RunResult own =
      run_distrun({"--nproc-per-node", "2", kChild, "fail-saying", "1", "5", "rank 1 is lost"});
  EXPECT_EQ(own.status, 5) << own.err;
  EXPECT_TRUE(std::regex_search(
      own.err, std::regex(R"(distrun:   rank 1 \(pid \d+\): exited with status 5 \(the first )"
                          R"(failure\)\n$)")))
      << own.err;
}

// Restarts across nodes: two distruns on loopback as nodes 0 and 1 of one job, one rank each,
// meeting in node 0's store on a port free now.
int free_loopback_port() {
  const int sock = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  const bool bound = ::bind(sock, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
                     ::getsockname(sock, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  ::close(sock);
  EXPECT_TRUE(bound) << std::strerror(errno);
  return ntohs(address.sin_port);
}

// The command line of node `node` of a job of two nodes with `options`, running `program`.
Args node_args(int node, int port, const Args& options, const Args& program) {
  Args args = {"--nnodes",         "2",         "--node-rank",   std::to_string(node),
               "--master-addr",    "127.0.0.1", "--master-port", std::to_string(port),
               "--nproc-per-node", "1",         "--rpc-insecure"};
  args.insert(args.end(), options.begin(), options.end());
  args.push_back(kChild);
  args.insert(args.end(), program.begin(), program.end());
  return args;
}

std::vector<RunResult> run_two_nodes(const Args& options, const Args& program,
                                     const OutputsHook& hook = {}) {
  const int port = free_loopback_port();
  return run_distruns({node_args(0, port, options, program), node_args(1, port, options, program)},
                      hook);
}

// Rank 1, on node 1, fails in the first round: node 0 stops its rank 0, and both nodes start
// their ranks again, together, on a new port; the second round succeeds on both.
TEST(DistrunNodes, EveryNodeRestartsAfterAFailureOnOne) {
  const auto r =
      run_two_nodes({"--max-restarts", "2", "--rdzv-timeout", "20"}, {"fail-until", "1", "1", "3"});
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].status, 0) << r[0].err;
  EXPECT_EQ(r[1].status, 0) << r[1].err;
  const auto rank0 = attempts_of(r[0].out, 0);
  const auto rank1 = attempts_of(r[1].out, 1);
  ASSERT_EQ(rank0.size(), 2u) << r[0].out;
  ASSERT_EQ(rank1.size(), 2u) << r[1].out;
  for (int round = 0; round < 2; ++round) {
    EXPECT_EQ(rank0[round][0], round);
    EXPECT_EQ(rank1[round][0], round);
    EXPECT_EQ(rank0[round][1], 2);
    // Both nodes' ranks meet on the port node 0 picked for the round.
    EXPECT_EQ(rank0[round][2], rank1[round][2]) << "round " << round;
  }
  EXPECT_NE(rank0[0][2], rank0[1][2]) << "a restart must not reuse the old round's port";
  for (const auto& node : r) {
    EXPECT_TRUE(contains(node.err,
                         "distrun: attempt 1 failed (node 1's rank 1 failed with status 3); every "
                         "node restarts its ranks: restart 1 of at most 2, "
                         "DISTRUN_RESTART_COUNT=1\n"))
        << node.err;
    EXPECT_TRUE(contains(node.err,
                         "distrun: all 2 nodes joined round 1; the ranks meet on "
                         "MASTER_PORT=" +
                             std::to_string(rank0[1][2]) + "\n"))
        << node.err;
  }
  EXPECT_TRUE(contains(r[0].err,
                       "distrun: attempt 1 ended on another node (node 1's rank 1 "
                       "failed with status 3); stopping the local rank(s)\n"))
      << r[0].err;
  // Node 0's rank 0 of the first round was stopped, not left to sleep.
  EXPECT_FALSE(contains(r[0].out, "done")) << r[0].out;
}

// Every round fails on node 1: both nodes exit with its status, and each summary names the node
// whose failure ended every round.
TEST(DistrunNodes, WhenNoRestartIsLeftEveryNodeExitsWithTheFailingStatus) {
  const auto r = run_two_nodes({"--max-restarts", "1", "--rdzv-timeout", "20"},
                               {"fail-until", "99", "1", "4"});
  ASSERT_EQ(r.size(), 2u);
  for (int node = 0; node < 2; ++node) {
    const std::string& err = r[node].err;
    EXPECT_EQ(r[node].status, 4) << err;
    std::string pattern =
        R"(distrun: attempt 2 failed \(node 1's rank 1 failed with status 4\) and no restart is )"
        R"(left \(--max-restarts 1\); exit status 4\n)";
    for (int attempt = 1; attempt <= 2; ++attempt) {
      pattern += "distrun: attempt " + std::to_string(attempt) + R"( \(DISTRUN_RESTART_COUNT=)" +
                 std::to_string(attempt - 1) +
                 R"(\) ended on every node as node 1's rank 1 failed with status 4; how each )"
                 "rank of node " +
                 std::to_string(node) + R"( ended:\n)" + "distrun:   rank " + std::to_string(node) +
                 R"( \(pid \d+\): )" +
                 (node == 1 ? R"(exited with status 4 \(the first failure\)\n)"
                            : R"(killed by signal SIGTERM; it was still running and distrun )"
                              R"(stopped it with SIGTERM\n)");
    }
    EXPECT_TRUE(std::regex_search(err, std::regex(pattern + "$"))) << "node " << node << "\n"
                                                                   << err;
  }
}

// SIGTERM to node 0's distrun: its rank gets it, and so does node 1's; nothing restarts.
TEST(DistrunNodes, ASignalToOneNodeStopsEveryNodeWithoutARestart) {
  auto sent = std::make_shared<bool>(false);
  const auto r = run_two_nodes(
      {"--max-restarts", "3", "--rdzv-timeout", "20"}, {"trap"},
      [sent](const std::vector<pid_t>& pids, const std::vector<RunResult>& so_far) {
        if (*sent || ready_ranks(so_far[0].out).empty() || ready_ranks(so_far[1].out).empty()) {
          return;
        }
        *sent = true;
        ::kill(pids[0], SIGTERM);
      });
  ASSERT_TRUE(*sent);
  EXPECT_EQ(r[0].status, 128 + SIGTERM) << r[0].err;
  EXPECT_EQ(r[1].status, 128 + SIGTERM) << r[1].err;
  for (int node = 0; node < 2; ++node) {
    const Args lines = lines_by_rank(r[node].out)[node];
    ASSERT_EQ(lines.size(), 2u) << "one attempt only\n" << r[node].out;
    EXPECT_EQ(lines.back(), "got SIGTERM") << r[node].out;
  }
  EXPECT_TRUE(contains(r[0].err,
                       "distrun: got SIGTERM during attempt 1; no restart after a "
                       "signal (the other nodes are told to stop)\n"))
      << r[0].err;
  EXPECT_TRUE(contains(r[1].err,
                       "distrun: node 0's distrun got SIGTERM during attempt 1, so "
                       "every node stops; no restart after a signal\n"))
      << r[1].err;
  for (const auto& node : r) EXPECT_FALSE(contains(node.err, "restarts")) << node.err;
}

// Two jobs of two nodes each, at once (`statuses.size()` jobs): once both ranks of job j run,
// its node 1's distrun is killed (SIGKILL; its rank dies with it), then its node 0's rank is told
// to exit with statuses[j]. Returns the node 0 run of each job. The join timeout leaves room for
// both nodes of a job to join round 0 on a loaded machine.
std::vector<RunResult> run_node0s_after_node1s_are_killed(const std::vector<int>& statuses) {
  std::vector<Args> runs;
  for (int status : statuses) {
    const int port = free_loopback_port();
    for (int node : {0, 1}) {
      runs.push_back(node_args(node, port, {"--max-restarts", "1", "--rdzv-timeout", "8"},
                               {"fail-on", "0", "exit", std::to_string(status), "sleep"}));
    }
  }
  auto done = std::make_shared<std::vector<bool>>(statuses.size(), false);
  const auto r = run_distruns(
      runs, [done](const std::vector<pid_t>& pids, const std::vector<RunResult>& so_far) {
        for (size_t job = 0; job < done->size(); ++job) {
          const auto rank0 = ready_ranks(so_far[2 * job].out);
          if ((*done)[job] || rank0.empty() || ready_ranks(so_far[2 * job + 1].out).empty())
            continue;
          (*done)[job] = true;
          const pid_t node1 = pids[2 * job + 1];
          ::kill(node1, SIGKILL);
          // Dead before rank 0 ends the round (not reaped: run_distruns does that).
          siginfo_t info{};
          ::waitid(P_PID, static_cast<id_t>(node1), &info, WEXITED | WNOWAIT);
          ::kill(rank0.at(0), SIGUSR1);
        }
      });
  std::vector<RunResult> node0s;
  for (size_t job = 0; job < statuses.size(); ++job) {
    EXPECT_TRUE((*done)[job]) << r[2 * job].err << r[2 * job + 1].err;
    EXPECT_EQ(r[2 * job + 1].status, 128 + SIGKILL);
    node0s.push_back(r[2 * job]);
  }
  return node0s;
}

// Node 1's distrun dies mid-run: node 0 names it as lost, not as a node to start, both when its
// rank's failure leads to a round node 1 never joins and when its rank succeeds and it waits for
// node 1's end of the round.
TEST(DistrunNodes, ANodeWhoseDistrunDiedIsNamedAsLost) {
  const std::string lost =
      "its distrun is lost (died or cut off: no sign of life during the wait)\n";
  const std::vector<std::string> messages = {
      "distrun: round 1: waited 8 s (--rdzv-timeout) for the nodes of round 0 to join it; "
      "never arrived: node 1: " +
          lost,
      "distrun: round 0: the ranks of this node (0) ended with status 0, then it waited 8 s "
      "(--rdzv-timeout) for every node to finish or fail; never arrived: node 1: " +
          lost,
  };
  const auto node0s = run_node0s_after_node1s_are_killed({3, 0});
  for (size_t job = 0; job < node0s.size(); ++job) {
    EXPECT_EQ(node0s[job].status, 1) << node0s[job].err;
    EXPECT_TRUE(contains(node0s[job].err, messages[job])) << node0s[job].err;
    EXPECT_FALSE(contains(node0s[job].err, "must be started with the same")) << node0s[job].err;
  }
}

// A node's distrun that could not coordinate with the others: exit status 1, no rank started,
// and `message` on stderr.
void expect_coordination_failure(const RunResult& r, const std::string& message) {
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_EQ(r.out, "") << "no rank may start";
  EXPECT_TRUE(contains(r.err, message)) << "stderr lacks: " << message << "\nstderr:\n" << r.err;
}

// Node 1 is never started: node 0 gives up after the join timeout, naming it, and starts no rank.
TEST(DistrunNodes, ANodeThatNeverJoinsIsNamedAfterTheJoinTimeout) {
  const int port = free_loopback_port();
  const RunResult r =
      run_distrun(node_args(0, port, {"--max-restarts", "1", "--rdzv-timeout", "1"}, {"env"}));
  expect_coordination_failure(r,
                              "distrun: round 0: waited 1 s (--rdzv-timeout) for every node to "
                              "join; never arrived: node 1; every node's distrun must be started "
                              "with the same --nnodes, --master-addr and --master-port\n");

  // Node 1 alone cannot reach node 0's store, and says so.
  const RunResult alone =
      run_distrun(node_args(1, port, {"--max-restarts", "1", "--rdzv-timeout", "1"}, {"env"}));
  expect_coordination_failure(alone,
                              "distrun: node 1 could not reach the launchers' store at "
                              "127.0.0.1:" +
                                  std::to_string(port) +
                                  " (served by node 0's distrun) to join round 0 within "
                                  "1 s (--rdzv-timeout): ");
}

// Node 1 gives another --max-restarts: both nodes refuse to start, naming it.
TEST(DistrunNodes, NodesMustAgreeOnTheirOptions) {
  const int port = free_loopback_port();
  const auto r =
      run_distruns({node_args(0, port, {"--max-restarts", "1", "--rdzv-timeout", "20"}, {"env"}),
                    node_args(1, port, {"--max-restarts", "2", "--rdzv-timeout", "20"}, {"env"})});
  for (const auto& node : r) {
    expect_coordination_failure(node,
                                "distrun: round 0: node 1 has --nnodes 2 --nproc-per-node 1 "
                                "--max-restarts 2, node 0 has --nnodes 2 --nproc-per-node 1 "
                                "--max-restarts 1; every node must give the same\n");
  }
}

TEST(Distrun, RanksDieWhenDistrunIsKilled) {
  std::map<int, pid_t> rank_pids;
  const RunResult r =
      run_distrun({"--nproc-per-node", "2", kChild, "sleep"},
                  when_ready(2, [&](pid_t distrun, const std::map<int, pid_t>& pids) {
                    rank_pids = pids;
                    ::kill(distrun, SIGKILL);
                  }));
  EXPECT_EQ(r.status, 128 + SIGKILL);
  ASSERT_EQ(rank_pids.size(), 2u) << r.out;
  // PR_SET_PDEATHSIG: the kernel kills them; allow it a moment (bounded) to happen.
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  for (const auto& [rank, pid] : rank_pids) {
    while (!process_gone(pid) && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_TRUE(process_gone(pid)) << "rank " << rank << " (pid " << pid << ") outlived distrun";
    if (!process_gone(pid)) ::kill(pid, SIGKILL);
  }
}

TEST(Distrun, AProgramThatCannotBeRunExits127) {
  const RunResult r = run_distrun({"--nproc-per-node", "2", "/nonexistent/program", "x"});
  EXPECT_EQ(r.status, 127);
  Args distrun_lines;
  const auto err = lines_by_rank(r.err, &distrun_lines);
  ASSERT_FALSE(err.empty()) << r.err;
  for (const auto& [rank, lines] : err) {
    EXPECT_EQ(lines,
              Args{"distrun: cannot execute '/nonexistent/program': No such file or directory"})
        << "rank " << rank;
  }
  ASSERT_FALSE(distrun_lines.empty());
  EXPECT_TRUE(contains(distrun_lines.front(), "exited with status 127")) << r.err;
}

// Every usage error is checked in-process (distrun_options_test.cpp); here, that the binary turns
// one of each kind (a bad value, an unknown option, options that conflict, no program) into exit
// status 2 and a message on stderr, before starting any rank.
TEST(Distrun, BadArgumentsExit2NamingTheOption) {
  struct Case {
    Args args;
    Args parts;
  };
  const std::vector<Case> cases = {
      {{"--nproc-per-node", "two", kChild, "env"}, {"--nproc-per-node", "two"}},
      {{"--nproc-per-node", "1", "--bogus", kChild}, {"unknown option --bogus"}},
      {{"--nproc-per-node", "1", "--nnodes", "2", "--master-addr", "h", "--master-port", "1",
        "--restart-policy", "rank", kChild},
       {"--restart-policy rank", "--nnodes 2"}},
      {{"--nproc-per-node", "1"}, {"no PROGRAM"}},
  };
  for (const auto& c : cases) {
    const RunResult r = run_distrun(c.args);
    EXPECT_EQ(r.status, 2) << r.err;
    EXPECT_EQ(r.out, "") << "a usage error must start no rank";
    EXPECT_TRUE(contains(r.err, "distrun: ")) << r.err;
    for (const auto& part : c.parts) EXPECT_TRUE(contains(r.err, part)) << r.err;
  }
}

TEST(Distrun, HelpExitsZero) {
  const RunResult r = run_distrun({"--help"});
  EXPECT_EQ(r.status, 0);
  EXPECT_TRUE(contains(r.out, "--nproc-per-node")) << r.out;
}

// --rdzv-backend etcd: the ranks meet in a real etcd (tests/harness/etcd_server.h), one per
// suite, which no rank serves; each launch meets under a job of its own.
class DistrunEtcd : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { shared_etcd = new distoptim::testing::EtcdServer(); }
  static void TearDownTestSuite() {
    delete shared_etcd;
    shared_etcd = nullptr;
  }

  // distrun's options for `nproc` ranks meeting in the suite's etcd, then `more`.
  static Args etcd_args(int nproc, const Args& more) {
    Args args = {"--nproc-per-node", std::to_string(nproc),  "--rdzv-backend", "etcd",
                 "--rdzv-endpoint",  shared_etcd->endpoint()};
    args.insert(args.end(), more.begin(), more.end());
    return args;
  }

  static distoptim::testing::EtcdServer* shared_etcd;
};

distoptim::testing::EtcdServer* DistrunEtcd::shared_etcd = nullptr;

// The "where ..." line of distrun_rendezvous_child: {MASTER_ADDR, MASTER_PORT,
// DISTOPTIM_RDZV_INIT_METHOD, DISTRUN_RESTART_COUNT}, one per run of `rank`.
std::vector<std::array<std::string, 4>> places_of(const std::string& out, int rank) {
  static const std::regex kWhere(
      R"(^where MASTER_ADDR=(\S+) MASTER_PORT=(\S+) DISTOPTIM_RDZV_INIT_METHOD=(\S+) )"
      R"(DISTRUN_RESTART_COUNT=(\d+)$)");
  std::vector<std::array<std::string, 4>> found;
  const auto by_rank = lines_by_rank(out);
  if (by_rank.count(rank) == 0) return found;
  for (const auto& text : by_rank.at(rank)) {
    std::smatch match;
    if (!std::regex_match(text, match, kWhere)) continue;
    found.push_back({match[1], match[2], match[3], match[4]});
  }
  return found;
}

// Three ranks meet in etcd through env:// (comm::rendezvous), each as the rank distrun gave it,
// and read each other's keys; no rank gets MASTER_ADDR or MASTER_PORT (a value in distrun's own
// environment included), and all meet under one job made for the launch.
TEST_F(DistrunEtcd, ThreeRanksMeetInEtcdThroughEnvInitMethod) {
  const RunResult r = run_distrun(etcd_args(3, {kRendezvousChild, "meet", "-1", "rejoin"}), {},
                                  {"MASTER_ADDR=10.9.9.9", "MASTER_PORT=1"});
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  const std::regex method("etcd://" + shared_etcd->endpoint() + "/distrun-[0-9a-f]{16}");
  std::string job;
  for (int rank = 0; rank < 3; ++rank) {
    const auto places = places_of(r.out, rank);
    ASSERT_EQ(places.size(), 1u) << r.out;
    EXPECT_EQ(places[0][0], "<unset>");
    EXPECT_EQ(places[0][1], "<unset>");
    EXPECT_TRUE(std::regex_match(places[0][2], method)) << places[0][2];
    if (rank == 0) job = places[0][2];
    EXPECT_EQ(places[0][2], job) << "every rank meets under the launch's job";
    EXPECT_TRUE(contains(r.out, "[rank " + std::to_string(rank) +
                                    "] met rank=" + std::to_string(rank) + " world_size=3\n"))
        << r.out;
  }

  // A job named on the command line is the one the ranks meet under.
  const RunResult named = run_distrun(
      etcd_args(2, {"--rdzv-id", "named-job.1", kRendezvousChild, "meet", "-1", "rejoin"}));
  EXPECT_EQ(named.status, 0) << named.out << named.err;
  const auto places = places_of(named.out, 1);
  ASSERT_EQ(places.size(), 1u) << named.out;
  EXPECT_EQ(places[0][2], "etcd://" + shared_etcd->endpoint() + "/named-job.1");
}

// --restart-policy rank in etcd: rank 0, which no longer serves the store, kills itself after
// meeting the others; it is restarted alone (DISTRUN_RESTART_COUNT 1) under the same job, reads
// the keys the ranks wrote before, and the others see it back; the job ends with status 0.
TEST_F(DistrunEtcd, Rank0KilledIsRestartedAloneAndRejoinsInEtcd) {
  const RunResult r = run_distrun(etcd_args(3, {"--restart-policy", "rank", "--max-restarts", "1",
                                                kRendezvousChild, "meet", "0", "rejoin"}));
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  const auto rank0 = places_of(r.out, 0);
  ASSERT_EQ(rank0.size(), 2u) << r.out;
  EXPECT_EQ(rank0[0][3], "0");
  EXPECT_EQ(rank0[1][3], "1");
  EXPECT_EQ(rank0[1][2], rank0[0][2]) << "a rank restarted alone rejoins the launch's job";
  for (int rank : {1, 2}) {
    EXPECT_EQ(places_of(r.out, rank).size(), 1u) << "rank " << rank << " ran once\n" << r.out;
    EXPECT_TRUE(
        contains(r.out, "[rank " + std::to_string(rank) + "] saw rank 0 rejoin (restart 1)\n"))
        << r.out;
  }
  // Rank 0's lines: its first run up to its death, then its second run's.
  const Args rank0_lines = lines_by_rank(r.out)[0];
  ASSERT_EQ(rank0_lines.size(), 5u) << r.out;
  EXPECT_EQ(rank0_lines[1], "met rank=0 world_size=3");
  EXPECT_EQ(rank0_lines[2], "killing myself");
  EXPECT_EQ(rank0_lines[3].rfind("where ", 0), 0u) << rank0_lines[3];
  EXPECT_EQ(rank0_lines[4], "rejoined rank=0");
  EXPECT_TRUE(std::regex_search(
      r.err, std::regex(R"(distrun: rank 0 \(pid \d+\) was killed by signal SIGKILL\n)"
                        R"(distrun: restarting rank 0 alone \(--restart-policy rank\): restart 1 )"
                        R"(of at most 1 for this rank, DISTRUN_RESTART_COUNT=1, )"
                        "DISTOPTIM_RDZV_INIT_METHOD=" +
                        rank0[0][2] + "; the other ranks keep running\n")))
      << r.err;
  EXPECT_TRUE(contains(r.err,
                       "distrun: every rank exited with status 0\n"
                       "distrun: restarted alone (--restart-policy rank): rank 0 1 "
                       "time(s)\n"))
      << r.err;
}

// The same under the static backend: rank 0 serves the store, so its death ends the job as
// before (128 + SIGKILL), and nothing is restarted.
TEST_F(DistrunEtcd, Rank0KilledStillEndsAStaticJob) {
  const RunResult r = run_distrun({"--nproc-per-node", "3", "--restart-policy", "rank",
                                   "--max-restarts", "1", kRendezvousChild, "meet", "0", "rejoin"});
  EXPECT_EQ(r.status, 128 + SIGKILL) << r.out << r.err;
  EXPECT_EQ(places_of(r.out, 0).size(), 1u) << r.out;
  EXPECT_EQ(places_of(r.out, 0)[0][2], "<unset>") << r.out;
  EXPECT_FALSE(contains(r.err, "restarting")) << r.err;
  EXPECT_TRUE(contains(r.err,
                       "distrun: rank 0 failed; under --restart-policy rank it is never restarted "
                       "(it serves the rendezvous store the other ranks meet in), so the job "
                       "ends; exit status 137\n"))
      << r.err;
}

// --restart-policy all in etcd: after rank 1 kills itself, every rank starts again and meets
// anew, under the launch's job with ".restart-1" (the first attempt's keys would count against
// a new rendezvous under the same job).
TEST_F(DistrunEtcd, ARestartOfAllRanksMeetsUnderAJobOfItsOwn) {
  const RunResult r =
      run_distrun(etcd_args(2, {"--max-restarts", "1", kRendezvousChild, "meet", "1", "anew"}));
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  for (int rank : {0, 1}) {
    const auto places = places_of(r.out, rank);
    ASSERT_EQ(places.size(), 2u) << r.out;
    EXPECT_EQ(places[1][2], places[0][2] + ".restart-1");
    EXPECT_EQ(places[1][3], "1");
  }
  EXPECT_TRUE(contains(r.err, "DISTRUN_RESTART_COUNT=1, DISTOPTIM_RDZV_INIT_METHOD=" +
                                  places_of(r.out, 0)[1][2] + "\n"))
      << r.err;
}

}  // namespace
