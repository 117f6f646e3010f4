#include "distrun/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <optional>
#include <system_error>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

extern char** environ;

namespace distoptim {
namespace launcher {
namespace {

// ---------------------------------------------------------------------------------------------
// Options

constexpr double kMaxGraceSeconds = 86400.0;
constexpr const char* kDefaultMasterAddr = "127.0.0.1";
constexpr const char* kUsageLine = "distrun --nproc-per-node N [OPTIONS] [--] PROGRAM [ARGS...]";

// CLI11's help, with distrun's usage line (CLI11's own would leave out PROGRAM).
class HelpFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string) const override {
    return fmt::format("Usage: {}\n", kUsageLine);
  }
};

// Registers distrun's options on `app`, storing into `options`. The underscore spellings are
// torchrun's, accepted so its command lines port unchanged.
void add_options(CLI::App& app, LaunchOptions& options) {
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
  app.footer(
      "Each rank's environment gets RANK (R * N + local rank), WORLD_SIZE (M * N), LOCAL_RANK,\n"
      "LOCAL_WORLD_SIZE (N), GROUP_RANK (R), MASTER_ADDR and MASTER_PORT.\n"
      "Every line a rank writes is printed as \"[rank RANK] line\" on distrun's stdout or stderr.\n"
      "When a rank exits non-zero or is killed by a signal, the others get SIGTERM, then SIGKILL\n"
      "after the grace period.\n"
      "Exit status: 0 if every rank exited 0; 128 + signal if distrun got SIGINT or SIGTERM; else\n"
      "the first failing rank's status (128 + signal if it was killed); 2 for a bad command line.");
}

std::string single_quoted(const std::string& s) { return fmt::format("'{}'", s); }

}  // namespace

LaunchOptions parse_command_line(const std::vector<std::string>& args) {
  LaunchOptions options;
  CLI::App app("", "distrun");
  add_options(app, options);
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
  if (app.count("--master-addr") > 0 && options.master_addr.empty()) {
    throw UsageError("--master-addr '': must not be empty");
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
    throw UsageError(fmt::format("--nproc-per-node {}: must be at least 1", options.nproc_per_node));
  }
  if (options.nnodes < 1) {
    throw UsageError(fmt::format("--nnodes {}: must be at least 1", options.nnodes));
  }
  if (static_cast<int64_t>(options.nnodes) * options.nproc_per_node > INT_MAX) {
    throw UsageError(fmt::format("--nnodes {} --nproc-per-node {}: the world size must be at most {}",
                                 options.nnodes, options.nproc_per_node, INT_MAX));
  }
  if (options.node_rank < 0 || options.node_rank >= options.nnodes) {
    throw UsageError(fmt::format("--node-rank {}: must be in [0, {}) (--nnodes {})",
                                 options.node_rank, options.nnodes, options.nnodes));
  }
  if (options.master_port < 0 || options.master_port > 65535) {
    throw UsageError(fmt::format("--master-port {}: must be in 1..65535", options.master_port));
  }
  if (options.nnodes > 1 && (options.master_addr.empty() || options.master_port == 0)) {
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
  if (options.command.empty()) {
    throw UsageError(fmt::format("no PROGRAM given; usage: {}", kUsageLine));
  }
  if (options.command.front().empty()) {
    throw UsageError(fmt::format("PROGRAM {}: must not be empty", single_quoted(options.command.front())));
  }
}

std::string help_text() {
  LaunchOptions options;
  CLI::App app("", "distrun");
  add_options(app, options);
  return app.help();
}

namespace {

// ---------------------------------------------------------------------------------------------
// File descriptors, output, signals

std::system_error errno_error(int err, const std::string& what) {
  return std::system_error(err, std::generic_category(), what);
}

// Owns a file descriptor; closes it on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

struct Pipe {
  Fd read;
  Fd write;
};

// Both ends close on exec (a rank gets its own write end as stdout or stderr through dup2, which
// clears the flag); the read end is non-blocking, for the poll loop.
Pipe make_pipe() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw errno_error(errno, "pipe2");
  Pipe pipe{Fd(fds[0]), Fd(fds[1])};
  if (::fcntl(pipe.read.get(), F_SETFL, ::fcntl(pipe.read.get(), F_GETFL) | O_NONBLOCK) != 0) {
    throw errno_error(errno, "fcntl(O_NONBLOCK)");
  }
  return pipe;
}

// Writes all of [data, data + size) to `fd`, waiting while a non-blocking `fd` is full. Gives up
// quietly when the reader is gone (EPIPE): the ranks are supervised all the same.
void write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n >= 0) {
      data += n;
      size -= static_cast<size_t>(n);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, -1);
    } else if (errno != EINTR) {
      return;
    }
  }
}

void write_all(int fd, const std::string& s) { write_all(fd, s.data(), s.size()); }

// A child's setup must not depend on distrun's descriptors 0-2 being open: a closed one would be
// reused by pipe2 and then clobbered by dup2.
void ensure_standard_fds_open() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) < 0 && errno == EBADF) {
      const int null_fd = ::open("/dev/null", O_RDWR);  // the lowest free descriptor: `fd`
      if (null_fd >= 0 && null_fd != fd) ::close(null_fd);
    }
  }
}

std::string signal_name(int signo) {
  const char* abbrev = ::sigabbrev_np(signo);
  return abbrev != nullptr ? fmt::format("SIG{}", abbrev) : std::to_string(signo);
}

constexpr int kHandledSignals[] = {SIGINT, SIGTERM, SIGCHLD};

// The self-pipe's write end, for the signal handler; set while a SignalPipe exists.
int signal_pipe_write_fd = -1;

extern "C" void write_signal_to_pipe(int signo) {
  // Async-signal-safe only: one write. A full pipe drops the byte, which is harmless: the loop
  // already has a byte to wake up for, and SIGCHLD is handled by polling every child anyway.
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(signo);
  if (::write(signal_pipe_write_fd, &byte, 1) < 0) {
  }
  errno = saved_errno;
}

// The self-pipe that turns SIGINT, SIGTERM and SIGCHLD into readable bytes for the poll loop.
// Installs the handlers (and ignores SIGPIPE, so a closed stdout cannot kill distrun while it
// supervises ranks) for its lifetime and restores the previous dispositions on destruction.
// One instance at a time (the handler reads a global).
class SignalPipe {
 public:
  SignalPipe() {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) throw errno_error(errno, "pipe2");
    read_ = Fd(fds[0]);
    write_ = Fd(fds[1]);
    signal_pipe_write_fd = write_.get();
    struct sigaction action {};
    action.sa_handler = write_signal_to_pipe;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    for (size_t i = 0; i < std::size(kHandledSignals); ++i) {
      ::sigaction(kHandledSignals[i], &action, &previous_[i]);
    }
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    ::sigaction(SIGPIPE, &ignore, &previous_sigpipe_);
  }
  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;
  ~SignalPipe() {
    for (size_t i = 0; i < std::size(kHandledSignals); ++i) {
      ::sigaction(kHandledSignals[i], &previous_[i], nullptr);
    }
    ::sigaction(SIGPIPE, &previous_sigpipe_, nullptr);
    signal_pipe_write_fd = -1;
  }

  int read_fd() const { return read_.get(); }

  // The signals received since the last call, in order.
  std::vector<int> take() {
    std::vector<int> signals;
    unsigned char bytes[64];
    ssize_t n;
    while ((n = ::read(read_.get(), bytes, sizeof bytes)) > 0 || (n < 0 && errno == EINTR)) {
      for (ssize_t i = 0; i < n; ++i) signals.push_back(bytes[i]);
    }
    return signals;
  }

 private:
  Fd read_;
  Fd write_;
  struct sigaction previous_[std::size(kHandledSignals)] {};
  struct sigaction previous_sigpipe_ {};
};

// Resets in a forked child, before it execs, the dispositions distrun changed: a handled signal
// arriving before exec must not run distrun's handler (it would write to distrun's self-pipe),
// and an ignored SIGPIPE would survive exec.
void restore_default_signals() {
  struct sigaction action {};
  action.sa_handler = SIG_DFL;
  sigemptyset(&action.sa_mask);
  for (int signo : kHandledSignals) ::sigaction(signo, &action, nullptr);
  ::sigaction(SIGPIPE, &action, nullptr);
}

// ---------------------------------------------------------------------------------------------
// Relaying a rank's output

constexpr size_t kMaxLineBytes = 64 * 1024;
constexpr size_t kReadBytes = 64 * 1024;

// One output stream of one rank: reads its pipe and writes each line to `out_fd` as
// `prefix + line + "\n"`. All the lines of one read go out in one write_all, and distrun is
// single-threaded, so a line of one rank is never split by another's. A line longer than
// kMaxLineBytes goes out in pieces of that size (each a line of its own), which bounds the
// buffer; a partial line at end of file goes out with a newline added.
class OutputRelay {
 public:
  OutputRelay(Fd pipe, std::string prefix, int out_fd)
      : pipe_(std::move(pipe)), prefix_(std::move(prefix)), out_fd_(out_fd) {}

  int fd() const { return pipe_.get(); }
  bool open() const { return pipe_.valid(); }

  // Reads at most `max_reads` times, stopping early when the pipe is empty, and writes out the
  // complete lines. Closes the pipe at end of file (or on a read error).
  void read_available(int max_reads) {
    bool at_eof = false;
    for (int i = 0; i < max_reads && !at_eof; ++i) {
      const size_t old_size = pending_.size();
      pending_.resize(old_size + kReadBytes);
      const ssize_t n = ::read(pipe_.get(), &pending_[old_size], kReadBytes);
      pending_.resize(old_size + static_cast<size_t>(std::max<ssize_t>(n, 0)));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      at_eof = n <= 0;
    }
    flush(at_eof);
    if (at_eof) pipe_.reset();
  }

  // Writes out everything buffered, a partial line too, and closes the pipe.
  void close() {
    flush(/*at_eof=*/true);
    pipe_.reset();
  }

 private:
  void flush(bool at_eof) {
    std::string batch;
    size_t start = 0;
    while (start < pending_.size()) {
      const size_t available = pending_.size() - start;
      const void* newline =
          std::memchr(&pending_[start], '\n', std::min(available, kMaxLineBytes + 1));
      size_t length;
      size_t consumed;
      if (newline != nullptr) {
        length = static_cast<size_t>(static_cast<const char*>(newline) - &pending_[start]);
        consumed = length + 1;
      } else if (available > kMaxLineBytes) {
        length = consumed = kMaxLineBytes;
      } else if (at_eof) {
        length = consumed = available;
      } else {
        break;
      }
      batch += prefix_;
      batch.append(pending_, start, length);
      batch += '\n';
      start += consumed;
    }
    pending_.erase(0, start);
    write_all(out_fd_, batch);
  }

  Fd pipe_;
  std::string prefix_;
  int out_fd_;
  std::string pending_;
};

// ---------------------------------------------------------------------------------------------
// Supervising the ranks

using Clock = std::chrono::steady_clock;

// At a rank's exit, read what is left in its pipes before reporting it, so a failure report
// follows the rank's last words; bounded, as its own children may still be writing.
constexpr int kMaxReadsAtExit = 16;
// Once every rank has exited, how long output held open by their children is still read.
constexpr auto kDrainTimeout = std::chrono::seconds(1);
constexpr int kExecFailedStatus = 127;

struct RankProcess {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  std::vector<OutputRelay> outputs;  // stdout, stderr
};

// What a forked child needs to exec, all prepared before fork.
struct ChildSetup {
  pid_t parent = -1;
  int stdout_fd = -1;
  int stderr_fd = -1;
  sigset_t mask{};
  char* const* argv = nullptr;
  char* const* envp = nullptr;
  std::string exec_error;
};

[[noreturn]] void exec_child(const ChildSetup& setup) {
  restore_default_signals();
  // Die with distrun. If distrun died before this took effect, the child has been reparented.
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != setup.parent) ::_exit(1);
  if (::dup2(setup.stdout_fd, STDOUT_FILENO) < 0 || ::dup2(setup.stderr_fd, STDERR_FILENO) < 0) {
    ::_exit(kExecFailedStatus);
  }
  ::sigprocmask(SIG_SETMASK, &setup.mask, nullptr);
  ::execvpe(setup.argv[0], setup.argv, setup.envp);
  const std::string message = setup.exec_error + std::strerror(errno) + "\n";
  write_all(STDERR_FILENO, message);
  ::_exit(kExecFailedStatus);
}

// distrun's environment without the variables distrun sets, then those, as NAME=value.
std::vector<std::string> child_environment(
    const std::vector<std::pair<std::string, std::string>>& variables) {
  std::vector<std::string> env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string item = *entry;
    const bool overridden =
        std::any_of(variables.begin(), variables.end(), [&](const auto& variable) {
          return item.compare(0, variable.first.size() + 1, variable.first + "=") == 0;
        });
    if (!overridden) env.push_back(item);
  }
  for (const auto& [name, value] : variables) env.push_back(name + "=" + value);
  return env;
}

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  for (auto& s : strings) pointers.push_back(s.data());
  pointers.push_back(nullptr);
  return pointers;
}

// Runs the ranks of one node. See run() in launcher.h for the behaviour. Single-threaded: one
// poll loop waits on the self-pipe and every rank's stdout and stderr pipe, with a timeout only
// while a deadline (SIGKILL after the grace period, end of draining) is pending; everything else
// is driven by the ranks' output and exits.
class Supervisor {
 public:
  explicit Supervisor(LaunchOptions options) : options_(std::move(options)) {}
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  // Only on an error path are ranks still running here: kill and reap them.
  ~Supervisor() {
    signal_running(SIGKILL);
    for (auto& rank : ranks_) {
      if (rank.running) ::waitpid(rank.pid, nullptr, 0);
    }
  }

  int run() {
    ensure_standard_fds_open();
    start_all();
    while (any_running() || any_output_open()) {
      poll_once();
      for (int signo : signals_.take()) {
        if (signo == SIGINT || signo == SIGTERM) on_signal_received(signo);
      }
      reap();
      enforce_deadlines();
    }
    if (received_signal_ != 0) return 128 + received_signal_;
    return first_failure_status_;
  }

 private:
  void start_all() {
    for (int local_rank = 0; local_rank < options_.nproc_per_node; ++local_rank) {
      const int rank = options_.node_rank * options_.nproc_per_node + local_rank;
      try {
        start_rank(local_rank, rank);
      } catch (const std::exception& e) {
        write_all(STDERR_FILENO, fmt::format("distrun: cannot start rank {}: {}\n", rank, e.what()));
        on_failure(1);
        return;
      }
    }
  }

  void start_rank(int local_rank, int rank) {
    std::vector<std::string> args = options_.command;
    std::vector<std::string> env = child_environment(rank_environment(options_, local_rank));
    const std::vector<char*> argv = c_strings(args);
    const std::vector<char*> envp = c_strings(env);
    Pipe out = make_pipe();
    Pipe err = make_pipe();

    ChildSetup setup;
    setup.parent = ::getpid();
    setup.stdout_fd = out.write.get();
    setup.stderr_fd = err.write.get();
    setup.argv = argv.data();
    setup.envp = envp.data();
    setup.exec_error = fmt::format("distrun: cannot execute {}: ", single_quoted(args.front()));

    // Signals stay blocked across fork until the child has reset distrun's handlers.
    sigset_t all;
    sigfillset(&all);
    ::sigprocmask(SIG_SETMASK, &all, &setup.mask);
    const pid_t pid = ::fork();
    if (pid == 0) exec_child(setup);
    const int fork_errno = errno;
    ::sigprocmask(SIG_SETMASK, &setup.mask, nullptr);
    if (pid < 0) throw errno_error(fork_errno, "fork");

    RankProcess process;
    process.rank = rank;
    process.pid = pid;
    process.running = true;
    const std::string prefix = fmt::format("[rank {}] ", rank);
    process.outputs.emplace_back(std::move(out.read), prefix, STDOUT_FILENO);
    process.outputs.emplace_back(std::move(err.read), prefix, STDERR_FILENO);
    ranks_.push_back(std::move(process));
  }

  bool any_running() const {
    return std::any_of(ranks_.begin(), ranks_.end(), [](const auto& r) { return r.running; });
  }

  bool any_output_open() const {
    return std::any_of(ranks_.begin(), ranks_.end(), [](const auto& r) {
      return std::any_of(r.outputs.begin(), r.outputs.end(),
                         [](const auto& o) { return o.open(); });
    });
  }

  // Waits for output, a signal or the next deadline, and relays what output there is.
  void poll_once() {
    std::vector<pollfd> fds{{signals_.read_fd(), POLLIN, 0}};
    std::vector<OutputRelay*> relays{nullptr};
    for (auto& rank : ranks_) {
      for (auto& output : rank.outputs) {
        if (!output.open()) continue;
        fds.push_back({output.fd(), POLLIN, 0});
        relays.push_back(&output);
      }
    }
    if (::poll(fds.data(), fds.size(), poll_timeout_ms()) < 0) {
      if (errno == EINTR) return;
      throw errno_error(errno, "poll");
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents != 0) relays[i]->read_available(1);
    }
  }

  std::optional<Clock::time_point> next_deadline() const {
    if (drain_deadline_) return drain_deadline_;
    if (grace_deadline_ && !killed_) return grace_deadline_;
    return std::nullopt;
  }

  int poll_timeout_ms() const {
    const auto deadline = next_deadline();
    if (!deadline) return -1;
    const auto left = *deadline - Clock::now();
    if (left <= Clock::duration::zero()) return 0;
    // Rounded up, so the loop does not spin through the last fraction of a millisecond.
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
    return static_cast<int>(std::min<int64_t>(ms, INT_MAX));
  }

  void reap() {
    for (auto& rank : ranks_) {
      if (!rank.running) continue;
      int status = 0;
      pid_t pid;
      do {
        pid = ::waitpid(rank.pid, &status, WNOHANG);
      } while (pid < 0 && errno == EINTR);
      if (pid == 0) continue;
      const int wait_errno = errno;
      rank.running = false;
      for (auto& output : rank.outputs) {
        if (output.open()) output.read_available(kMaxReadsAtExit);
      }
      if (pid < 0) {
        write_all(STDERR_FILENO, fmt::format("distrun: rank {} (pid {}) cannot be waited for: {}\n",
                                             rank.rank, rank.pid, std::strerror(wait_errno)));
        on_failure(1);
      } else if (WIFSIGNALED(status)) {
        write_all(STDERR_FILENO, fmt::format("distrun: rank {} (pid {}) was killed by signal {}\n",
                                             rank.rank, rank.pid, signal_name(WTERMSIG(status))));
        on_failure(128 + WTERMSIG(status));
      } else if (WEXITSTATUS(status) != 0) {
        write_all(STDERR_FILENO, fmt::format("distrun: rank {} (pid {}) exited with status {}\n",
                                             rank.rank, rank.pid, WEXITSTATUS(status)));
        on_failure(WEXITSTATUS(status));
      }
    }
  }

  // A rank failed (or could not be started): the first failure sets the exit status and stops
  // the other ranks.
  void on_failure(int status) {
    if (first_failure_status_ == 0) first_failure_status_ = status;
    if (!grace_deadline_) {
      start_grace_period();
      signal_running(SIGTERM);
    }
  }

  // distrun got SIGINT or SIGTERM: every one is passed on; the first starts the grace period.
  void on_signal_received(int signo) {
    if (received_signal_ == 0) received_signal_ = signo;
    signal_running(signo);
    if (!grace_deadline_) start_grace_period();
  }

  void start_grace_period() {
    grace_deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                         std::chrono::duration<double>(options_.grace_seconds));
  }

  void enforce_deadlines() {
    const auto now = Clock::now();
    if (grace_deadline_ && !killed_ && now >= *grace_deadline_) {
      killed_ = true;
      std::string running;
      for (const auto& rank : ranks_) {
        if (rank.running) running += fmt::format(" {}", rank.rank);
      }
      if (!running.empty()) {
        write_all(STDERR_FILENO,
                  fmt::format("distrun: grace period of {} s over; sending SIGKILL to rank(s){}\n",
                              options_.grace_seconds, running));
        signal_running(SIGKILL);
      }
    }
    if (!drain_deadline_ && !any_running()) drain_deadline_ = now + kDrainTimeout;
    if (drain_deadline_ && now >= *drain_deadline_) {
      for (auto& rank : ranks_) {
        for (auto& output : rank.outputs) {
          if (output.open()) output.close();
        }
      }
    }
  }

  // A rank that has exited but is not reaped yet is a zombie: its pid cannot have been reused.
  void signal_running(int signo) {
    for (const auto& rank : ranks_) {
      if (rank.running) ::kill(rank.pid, signo);
    }
  }

  LaunchOptions options_;
  SignalPipe signals_;
  std::vector<RankProcess> ranks_;
  std::optional<Clock::time_point> grace_deadline_;
  bool killed_ = false;
  std::optional<Clock::time_point> drain_deadline_;
  int received_signal_ = 0;
  int first_failure_status_ = 0;
};

int find_free_port() {
  const Fd sock(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!sock.valid()) throw errno_error(errno, "socket");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = 0;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(sock.get(), reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    throw errno_error(errno, "finding a free port: bind to 127.0.0.1 port 0");
  }
  socklen_t length = sizeof address;
  if (::getsockname(sock.get(), reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    throw errno_error(errno, "finding a free port: getsockname");
  }
  return ntohs(address.sin_port);
}

}  // namespace

LaunchOptions resolve_master(LaunchOptions options) {
  if (options.master_addr.empty()) options.master_addr = kDefaultMasterAddr;
  if (options.master_port == 0) options.master_port = find_free_port();
  return options;
}

std::vector<std::pair<std::string, std::string>> rank_environment(const LaunchOptions& options,
                                                                  int local_rank) {
  const int rank = options.node_rank * options.nproc_per_node + local_rank;
  return {
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(options.nnodes * options.nproc_per_node)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(options.nproc_per_node)},
      {"GROUP_RANK", std::to_string(options.node_rank)},
      {"MASTER_ADDR", options.master_addr},
      {"MASTER_PORT", std::to_string(options.master_port)},
  };
}

int run(const LaunchOptions& options) {
  validate(options);
  Supervisor supervisor(resolve_master(options));
  return supervisor.run();
}

}  // namespace launcher
}  // namespace distoptim
