#pragma once

// Environment variables set for a scope and put back as they were after (set again, or unset);
// and the whole environment saved for a scope and put back after.

#include <unistd.h>

#include <cstdlib>
#include <initializer_list>
#include <map>
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

/// Saves every variable of the environment; the destructor puts them back and unsets any set
/// since. Not for scopes in which other threads read the environment.
class SavedEnvironment {
 public:
  SavedEnvironment() : saved_(current()) {}
  ~SavedEnvironment() {
    for (const auto& [name, value] : current()) {
      if (saved_.count(name) == 0) ::unsetenv(name.c_str());
    }
    for (const auto& [name, value] : saved_) ::setenv(name.c_str(), value.c_str(), 1);
  }
  SavedEnvironment(const SavedEnvironment&) = delete;
  SavedEnvironment& operator=(const SavedEnvironment&) = delete;

 private:
  static std::map<std::string, std::string> current() {
    std::map<std::string, std::string> variables;
    for (char** entry = environ; *entry != nullptr; ++entry) {
      const std::string assignment = *entry;
      const size_t equals = assignment.find('=');
      if (equals != std::string::npos) {
        variables[assignment.substr(0, equals)] = assignment.substr(equals + 1);
      }
    }
    return variables;
  }

  const std::map<std::string, std::string> saved_;
};

}  // namespace testing
}  // namespace distoptim
