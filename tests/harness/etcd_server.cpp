#include "harness/etcd_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#include "harness/multiprocess.h"

namespace distoptim {
namespace testing {

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kStartAttempts = 3;
constexpr auto kStopGrace = std::chrono::seconds(10);

// Waits for `pid` to exit, at most `limit`; true when it did (and was reaped).
bool reap_within(pid_t pid, std::chrono::milliseconds limit) {
  const auto until = Clock::now() + limit;
  while (true) {
    int status = 0;
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid || (done < 0 && errno == ECHILD)) return true;
    if (Clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace

EtcdServer::EtcdServer(std::chrono::milliseconds limit) {
  char dir_template[] = "/tmp/distoptim-etcd-XXXXXX";
  if (::mkdtemp(dir_template) == nullptr) throw std::runtime_error("EtcdServer: mkdtemp failed");
  dir_ = dir_template;
  const auto until = Clock::now() + limit;
  std::string why;
  for (int attempt = 0; attempt < kStartAttempts; ++attempt) {
    if (start_once(until, why)) return;
    if (Clock::now() >= until) break;
  }
  const std::string log = log_tail();
  std::filesystem::remove_all(dir_);
  throw std::runtime_error("EtcdServer: " + why + "; etcd's log ends:\n" + log);
}

EtcdServer::~EtcdServer() {
  stop();
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
}

std::string EtcdServer::endpoint() const { return "127.0.0.1:" + std::to_string(client_port_); }

bool EtcdServer::start_once(Clock::time_point until, std::string& why) {
  client_port_ = free_port();
  peer_port_ = free_port();
  if (client_port_ <= 0 || peer_port_ <= 0 || client_port_ == peer_port_) {
    why = "no free ports on 127.0.0.1";
    return false;
  }
  const std::string client = "http://127.0.0.1:" + std::to_string(client_port_);
  const std::string peer = "http://127.0.0.1:" + std::to_string(peer_port_);
  std::error_code ignored;
  std::filesystem::remove_all(dir_ + "/data", ignored);
  std::vector<std::string> args = {kBinary,
                                   "--name=test",
                                   "--data-dir=" + dir_ + "/data",
                                   "--listen-client-urls=" + client,
                                   "--advertise-client-urls=" + client,
                                   "--listen-peer-urls=" + peer,
                                   "--initial-advertise-peer-urls=" + peer,
                                   "--initial-cluster=test=" + peer,
                                   "--log-outputs=stderr"};
  std::vector<char*> argv;
  for (auto& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  const std::string log_path = dir_ + "/etcd.log";
  const int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log < 0) {
    why = "cannot open " + log_path;
    return false;
  }
  const pid_t parent = ::getpid();
  // Between fork and exec the child calls only async-signal-safe functions, so forking from a
  // test process with threads is sound.
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::dup2(log, STDOUT_FILENO);
    ::dup2(log, STDERR_FILENO);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(log);
  if (pid < 0) {
    why = "fork failed";
    return false;
  }
  pid_ = pid;
  while (Clock::now() < until) {
    if (http_get("/health").find("\"health\":\"true\"") != std::string::npos) return true;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      why = "etcd exited at start (status " + std::to_string(status) + ")";
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  why = "etcd did not report itself healthy at " + endpoint();
  stop();
  return false;
}

void EtcdServer::kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  reap_within(pid_, std::chrono::hours(1));
  pid_ = -1;
}

void EtcdServer::stop() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGTERM);
  if (!reap_within(pid_, kStopGrace)) kill();
  pid_ = -1;
}

std::string EtcdServer::http_get(const std::string& path) const {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  timeval bound{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof bound);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &bound, sizeof bound);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(client_port_));
  std::string answer;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    const std::string request = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
        static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      ssize_t n = 0;
      while (answer.size() < (size_t{16} << 20) && (n = ::recv(fd, buffer, sizeof buffer, 0)) > 0) {
        answer.append(buffer, static_cast<size_t>(n));
      }
    }
  }
  ::close(fd);
  const size_t body = answer.find("\r\n\r\n");
  if (answer.rfind("HTTP/1.", 0) != 0 || answer.find(" 200 ") == std::string::npos ||
      body == std::string::npos) {
    return "";
  }
  return answer.substr(body + 4);
}

std::string EtcdServer::log_tail() const {
  std::ifstream log(dir_ + "/etcd.log");
  std::stringstream text;
  text << log.rdbuf();
  const std::string all = text.str();
  return all.size() > 4000 ? all.substr(all.size() - 4000) : all;
}

}  // namespace testing
}  // namespace distoptim
