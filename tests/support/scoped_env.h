#pragma once

// Environment variables set for a scope and put back as they were after (set again, or unset).

#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace distoptim {
namespace testing {

class ScopedEnv {
 public:
  /// (name, value) pairs; a null value unsets the variable.
  ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const auto& [name, value] : vars) {
      set(name, value == nullptr ? std::nullopt : std::optional<std::string>(value));
    }
  }
  /// "NAME=value" entries.
  explicit ScopedEnv(const std::vector<std::string>& assignments) {
    for (const std::string& assignment : assignments) {
      const size_t equals = assignment.find('=');
      set(assignment.substr(0, equals), assignment.substr(equals + 1));
    }
  }
  ~ScopedEnv() {
    for (const auto& [name, before] : saved_) {
      if (before) {
        ::setenv(name.c_str(), before->c_str(), 1);
      } else {
        ::unsetenv(name.c_str());
      }
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  void set(const std::string& name, const std::optional<std::string>& value) {
    const char* before = std::getenv(name.c_str());
    saved_.emplace_back(name,
                        before == nullptr ? std::nullopt : std::optional<std::string>(before));
    if (value) {
      ::setenv(name.c_str(), value->c_str(), 1);
    } else {
      ::unsetenv(name.c_str());
    }
  }

  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

}  // namespace testing
}  // namespace distoptim
