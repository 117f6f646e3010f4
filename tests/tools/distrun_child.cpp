// The program the distrun tests launch. Its first argument picks what it does:
//
//   env                     print one line: RANK=.. WORLD_SIZE=.. LOCAL_RANK=.. LOCAL_WORLD_SIZE=..
//                           GROUP_RANK=.. MASTER_ADDR=.. MASTER_PORT=..
//   args ARG...             print "arg=ARG" for each argument
//   lines COUNT             print COUNT lines on stdout ("line R-i PAYLOAD") and on stderr
//                           ("err R-i"), each written in several pieces, then a partial last line
//                           on each ("tail R", "errtail R") and exit 0
//   long BYTES              print one line of BYTES letters (a, b, ..., z, a, ...)
//   fail-on R exit|signal N sleep|ignore-term
//                           every rank prints "ready pid=P"; rank R then waits for SIGUSR1 and
//                           exits with status N or raises signal N; the others (ignoring SIGTERM
//                           with ignore-term) sleep 60 s and print "done"
//   trap                    print "ready pid=P", wait up to 60 s for SIGTERM or SIGINT, print
//                           "got SIGTERM" / "got SIGINT" (or "done" if none came) and exit 0
//   sleep                   print "ready pid=P", sleep 60 s, print "done"
//   secret                  print one line about the file DISTOPTIM_RPC_SECRET_FILE names:
//                           "secret path=P file-mode=M dir-mode=M bytes=N hex=yes|no" (modes in
//                           octal, "missing" where stat fails), or "secret none" (then
//                           " insecure=V" with DISTOPTIM_RPC_INSECURE=V)
//   parent-maps NAME        print "parent maps NAME: yes" or "...: no": whether a file whose name
//                           contains NAME is mapped into the parent's (distrun's) memory
//   fail-until C R N        print "attempt DISTRUN_RESTART_COUNT=.. DISTRUN_MAX_RESTARTS=..
//                           MASTER_PORT=.."; while DISTRUN_RESTART_COUNT < C, rank R exits with
//                           status N and the others sleep 60 s; from restart C on, exit 0
//   rank-fail-until C R N   print "attempt DISTRUN_RESTART_COUNT=.. DISTRUN_MAX_RESTARTS=..
//                           MASTER_PORT=.. pid=P"; rank R exits with status N while
//                           DISTRUN_RESTART_COUNT < C, then 0; the others print "ready pid=P",
//                           wait up to 60 s for SIGUSR1 and exit 0 (91 if none came)
//   fail-saying R N LINE    rank R writes LINE to stderr and exits with status N; the others
//                           print "ready pid=P" and sleep 60 s
//
// R is the RANK the launcher set. Output goes through write(2), so every piece reaches the pipe
// when it is written.

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <iterator>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <thread>

namespace {

constexpr auto kLongSleep = std::chrono::seconds(60);

void write_fd(int fd, const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = ::write(fd, s.data() + done, s.size() - done);
    if (n < 0) std::exit(90);
    done += static_cast<size_t>(n);
  }
}

void say(const std::string& s) { write_fd(STDOUT_FILENO, s); }

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : "<unset>";
}

int rank() { return std::atoi(env("RANK").c_str()); }

void print_ready() { say("ready pid=" + std::to_string(::getpid()) + "\n"); }

void sleep_then_done() {
  std::this_thread::sleep_for(kLongSleep);  // resumes after an interrupting signal
  say("done\n");
}

int print_env() {
  std::string line;
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                           "MASTER_ADDR", "MASTER_PORT"}) {
    if (!line.empty()) line += ' ';
    line += std::string(name) + "=" + env(name);
  }
  say(line + "\n");
  return 0;
}

int print_lines(int count) {
  const std::string r = std::to_string(rank());
  for (int i = 0; i < count; ++i) {
    const std::string id = r + "-" + std::to_string(i);
    const std::string payload(80, static_cast<char>('a' + (rank() + i) % 26));
    write_fd(STDOUT_FILENO, "line ");
    write_fd(STDOUT_FILENO, id + " ");
    if (i % 7 == 0) std::this_thread::yield();  // lets another rank write mid-line
    write_fd(STDOUT_FILENO, payload);
    write_fd(STDOUT_FILENO, "\n");
    write_fd(STDERR_FILENO, "err " + r + "-");
    write_fd(STDERR_FILENO, std::to_string(i) + "\n");
  }
  write_fd(STDOUT_FILENO, "tail " + r);
  write_fd(STDERR_FILENO, "errtail " + r);
  return 0;
}

int print_long(size_t bytes) {
  std::string line(bytes, ' ');
  for (size_t i = 0; i < bytes; ++i) line[i] = static_cast<char>('a' + i % 26);
  for (size_t at = 0; at < bytes; at += 10000) say(line.substr(at, 10000));
  say("\n");
  return 0;
}

// Blocks `signals` and waits up to kLongSleep for one of them; returns it, or 0.
int wait_for(std::initializer_list<int> signals) {
  sigset_t set;
  sigemptyset(&set);
  for (int s : signals) sigaddset(&set, s);
  ::sigprocmask(SIG_BLOCK, &set, nullptr);
  print_ready();
  const timespec timeout{std::chrono::seconds(kLongSleep).count(), 0};
  int got;
  do {
    got = ::sigtimedwait(&set, nullptr, &timeout);
  } while (got < 0 && errno == EINTR);
  return got < 0 ? 0 : got;
}

int fail_on(int failing_rank, const std::string& how, int n, const std::string& others) {
  if (rank() == failing_rank) {
    if (wait_for({SIGUSR1}) == 0) return 91;
    if (how == "signal") {
      ::signal(n, SIG_DFL);
      ::raise(n);
    }
    return n;
  }
  if (others == "ignore-term") ::signal(SIGTERM, SIG_IGN);
  print_ready();
  sleep_then_done();
  return 0;
}

int fail_until(int count, int failing_rank, int status) {
  say("attempt DISTRUN_RESTART_COUNT=" + env("DISTRUN_RESTART_COUNT") + " DISTRUN_MAX_RESTARTS=" +
      env("DISTRUN_MAX_RESTARTS") + " MASTER_PORT=" + env("MASTER_PORT") + "\n");
  if (std::atoi(env("DISTRUN_RESTART_COUNT").c_str()) >= count) return 0;
  if (rank() == failing_rank) return status;
  sleep_then_done();
  return 0;
}

int rank_fail_until(int count, int failing_rank, int status) {
  say("attempt DISTRUN_RESTART_COUNT=" + env("DISTRUN_RESTART_COUNT") +
      " DISTRUN_MAX_RESTARTS=" + env("DISTRUN_MAX_RESTARTS") +
      " MASTER_PORT=" + env("MASTER_PORT") + " pid=" + std::to_string(::getpid()) + "\n");
  if (rank() == failing_rank) {
    return std::atoi(env("DISTRUN_RESTART_COUNT").c_str()) < count ? status : 0;
  }
  return wait_for({SIGUSR1}) == 0 ? 91 : 0;
}

int fail_saying(int failing_rank, int status, const std::string& line) {
  if (rank() == failing_rank) {
    write_fd(STDERR_FILENO, line + "\n");
    return status;
  }
  print_ready();
  sleep_then_done();
  return 0;
}

int print_secret() {
  const char* path = std::getenv("DISTOPTIM_RPC_SECRET_FILE");
  if (path == nullptr) {
    const char* insecure = std::getenv("DISTOPTIM_RPC_INSECURE");
    say(std::string("secret none") + (insecure ? std::string(" insecure=") + insecure : "") + "\n");
    return 0;
  }
  const std::string file = path;
  const std::string dir = file.substr(0, file.rfind('/'));
  auto mode = [](const std::string& p) -> std::string {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) return "missing";
    char octal[16];
    std::snprintf(octal, sizeof octal, "%o", static_cast<unsigned>(st.st_mode & 07777));
    return octal;
  };
  std::ifstream in(file, std::ios::binary);
  const std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const bool hex = !content.empty() && std::all_of(content.begin(), content.end(), [](char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
  });
  say("secret path=" + file + " file-mode=" + mode(file) + " dir-mode=" + mode(dir) +
      " bytes=" + std::to_string(content.size()) + " hex=" + (hex ? "yes" : "no") + "\n");
  return 0;
}

int print_parent_maps(const std::string& name) {
  std::ifstream maps("/proc/" + std::to_string(::getppid()) + "/maps");
  bool mapped = false;
  for (std::string line; std::getline(maps, line);)
    mapped = mapped || line.find(name) != std::string::npos;
  say("parent maps " + name + ": " + (mapped ? "yes" : "no") + "\n");
  return 0;
}

int trap() {
  const int got = wait_for({SIGTERM, SIGINT});
  say(got == 0 ? "done\n" : std::string("got SIG") + ::sigabbrev_np(got) + "\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "env") return print_env();
  if (mode == "args") {
    for (int i = 2; i < argc; ++i) say(std::string("arg=") + argv[i] + "\n");
    return 0;
  }
  if (mode == "lines" && argc == 3) return print_lines(std::atoi(argv[2]));
  if (mode == "long" && argc == 3) return print_long(std::strtoul(argv[2], nullptr, 10));
  if (mode == "fail-on" && argc == 6) {
    return fail_on(std::atoi(argv[2]), argv[3], std::atoi(argv[4]), argv[5]);
  }
  if (mode == "fail-until" && argc == 5) {
    return fail_until(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]));
  }
  if (mode == "rank-fail-until" && argc == 5) {
    return rank_fail_until(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]));
  }
  if (mode == "fail-saying" && argc == 5) {
    return fail_saying(std::atoi(argv[2]), std::atoi(argv[3]), argv[4]);
  }
  if (mode == "trap") return trap();
  if (mode == "secret") return print_secret();
  if (mode == "parent-maps" && argc == 3) return print_parent_maps(argv[2]);
  if (mode == "sleep") {
    print_ready();
    sleep_then_done();
    return 0;
  }
  std::fprintf(stderr, "distrun_child: bad arguments (mode '%s')\n", mode.c_str());
  return 99;
}
