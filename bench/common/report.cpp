#include "report.h"

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <sstream>

#include <c10/util/Exception.h>

namespace distoptim {
namespace bench {

double median(std::vector<double> values) {
  TORCH_CHECK(!values.empty(), "median of nothing");
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

double percentile(std::vector<double> values, double p) {
  TORCH_CHECK(!values.empty(), "percentile of nothing");
  std::sort(values.begin(), values.end());
  const auto rank = static_cast<size_t>(std::ceil(p / 100.0 * values.size()));
  return values[std::clamp<size_t>(rank, 1, values.size()) - 1];
}

double process_cpu_seconds() {
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

long proc_status_kb(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.compare(0, field.size() + 1, field + ":") == 0) {
      return std::stol(line.substr(field.size() + 1));
    }
  }
  return -1;
}

std::vector<nlohmann::json> result_lines(const std::string& output) {
  std::vector<nlohmann::json> results;
  std::istringstream lines(output);
  std::string line;
  while (std::getline(lines, line)) {
    const auto at = line.find(kResultPrefix);
    if (at != std::string::npos) {
      results.push_back(nlohmann::json::parse(line.substr(at + kResultPrefix.size())));
    }
  }
  return results;
}

ResultsFile::ResultsFile(const std::string& path, const std::string& program)
    : path_(path), program_(program) {
  TORCH_CHECK(!path.empty(), program, ": --json PATH is required");
  const std::filesystem::path fs_path(path);
  if (fs_path.has_parent_path()) std::filesystem::create_directories(fs_path.parent_path());
  file_.open(path);
  TORCH_CHECK(file_.good(), program, ": cannot open --json file '", path, "' for writing");
}

void ResultsFile::write(const nlohmann::json& results) {
  file_ << results.dump(2) << "\n";
  file_.close();
  TORCH_CHECK(file_.good(), program_, ": writing '", path_, "' failed");
}

void ResultsFile::discard() {
  file_.close();
  std::filesystem::remove(path_);
}

}  // namespace bench
}  // namespace distoptim
