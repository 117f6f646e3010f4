#pragma once

// How the comm layer's error messages write durations, key lists and untrusted bytes.

#include <algorithm>
#include <cctype>
#include <chrono>
#include <string>
#include <vector>

#include <c10/util/StringUtil.h>

namespace distoptim {
namespace comm {
namespace detail {

/// "1.5 s".
inline std::string seconds_text(std::chrono::milliseconds ms) {
  return c10::str(static_cast<double>(ms.count()) / 1000.0, " s");
}

/// The first few keys, then how many there are: "a, b, c, d, ... (10 keys)".
inline std::string keys_text(const std::vector<std::string>& keys) {
  const size_t shown = std::min<size_t>(keys.size(), 4);
  std::string text = c10::Join(", ", std::vector<std::string>(keys.begin(), keys.begin() + shown));
  if (shown < keys.size()) text += c10::str(", ... (", keys.size(), " keys)");
  return text;
}

/// The start of untrusted bytes, safe to print: at most `limit` of them, anything but printable
/// ASCII as '?', "..." when cut.
inline std::string printable(const std::string& text, size_t limit) {
  std::string out = text.substr(0, limit);
  for (char& c : out) {
    if (std::isprint(static_cast<unsigned char>(c)) == 0) c = '?';
  }
  if (text.size() > limit) out += "...";
  return out;
}

}  // namespace detail
}  // namespace comm
}  // namespace distoptim
