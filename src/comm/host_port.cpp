#include "host_port.h"

#include <cctype>
#include <cstdlib>

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

}  // namespace

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
