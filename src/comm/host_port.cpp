#include "host_port.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <thread>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace distoptim {
namespace comm {
namespace detail {

namespace {

bool is_host_text(const std::string& host, bool bracketed) {
  if (host.empty()) return false;
  for (const char c : host) {
    const bool ok = std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '.' || c == '-' ||
                    c == '_' || (bracketed && (c == ':' || c == '%'));
    if (!ok) return false;
  }
  return true;
}

enum class Knock { kAccepted, kRefused, kNoAnswer };

// One non-blocking connect to `address`, waiting at most `limit` for its outcome.
Knock knock(const addrinfo& address, std::chrono::milliseconds limit) {
  const int fd = ::socket(address.ai_family, address.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                          address.ai_protocol);
  if (fd < 0) return Knock::kNoAnswer;
  int error = 0;
  if (::connect(fd, address.ai_addr, address.ai_addrlen) != 0) {
    error = errno;
    if (error == EINPROGRESS) {
      pollfd waiting{fd, POLLOUT, 0};
      if (::poll(&waiting, 1, static_cast<int>(limit.count())) == 1) {
        socklen_t size = sizeof error;
        if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &size) != 0) error = errno;
      } else {
        error = ETIMEDOUT;
      }
    }
  }
  ::close(fd);
  if (error == 0) return Knock::kAccepted;
  return error == ECONNREFUSED ? Knock::kRefused : Knock::kNoAnswer;
}

}  // namespace

bool wait_until_listening(const std::string& host, int port,
                          std::chrono::steady_clock::time_point deadline) {
  using Clock = std::chrono::steady_clock;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return false;
  const addrinfo address = *found;
  bool accepted = false;
  while (Clock::now() < deadline) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    const Knock outcome = knock(
        address, std::clamp(left, std::chrono::milliseconds(1), std::chrono::milliseconds(1000)));
    if (outcome != Knock::kRefused) {
      accepted = outcome == Knock::kAccepted;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::freeaddrinfo(found);
  return accepted;
}

std::pair<std::string, int> parse_host_port(const std::string& text, const std::string& subject,
                                            const std::string& form) {
  std::string host;
  std::string port_text;
  bool bracketed = false;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find(']');
    TORCH_CHECK_VALUE(
        close != std::string::npos && close + 1 < text.size() && text[close + 1] == ':', subject,
        " is not ", form);
    host = text.substr(1, close - 1);
    port_text = text.substr(close + 2);
    bracketed = true;
  } else {
    const size_t colon = text.rfind(':');
    TORCH_CHECK_VALUE(colon != std::string::npos && colon > 0, subject, " is not ", form);
    host = text.substr(0, colon);
    port_text = text.substr(colon + 1);
  }
  TORCH_CHECK_VALUE(is_host_text(host, bracketed), subject, " has host '", host, "'; expected ",
                    form);
  char* end = nullptr;
  const long port = std::strtol(port_text.c_str(), &end, 10);
  TORCH_CHECK_VALUE(!port_text.empty() && std::isdigit(static_cast<unsigned char>(port_text[0])) &&
                        *end == '\0' && port >= 1 && port <= 65535,
                    subject, " has port '", port_text, "'; expected 1..65535");
  return {host, static_cast<int>(port)};
}

std::string host_port_text(const std::string& host, int port) {
  return c10::str(host.find(':') == std::string::npos ? host : "[" + host + "]", ":", port);
}

}  // namespace detail
}  // namespace comm
}  // namespace distoptim
