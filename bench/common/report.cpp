#include "report.h"

#include <dlfcn.h>
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <c10/util/Exception.h>

#include "child_process.h"

namespace distoptim {
namespace bench {

double median(std::vector<double> values) {
  TORCH_CHECK(!values.empty(), "median of nothing");
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

Spread spread_of(const std::vector<double>& values) {
  const double middle = median(values);  // checks that there are values
  return {*std::min_element(values.begin(), values.end()), middle,
          *std::max_element(values.begin(), values.end())};
}

nlohmann::json comparison_row(const std::string& name, const Spread& ours, const Spread& pytorch,
                              size_t rounds, const std::string& unit, bool lower_is_better) {
  return {{"case", name},
          {"ours", ours.median},
          {"pytorch", pytorch.median},
          {"ours_min", ours.min},
          {"ours_max", ours.max},
          {"pytorch_min", pytorch.min},
          {"pytorch_max", pytorch.max},
          {"rounds", rounds},
          {"unit", unit},
          {"better", lower_is_better ? "lower" : "higher"}};
}

nlohmann::json spread_row(const std::string& name, const std::vector<double>& values,
                          const std::string& unit, const std::string& better) {
  const Spread s = spread_of(values);
  return {{"case", name},    {"min", s.min}, {"median", s.median},
          {"max", s.max},    {"unit", unit}, {"samples", values.size()},
          {"better", better}};
}

double ms_between(std::chrono::steady_clock::time_point from,
                  std::chrono::steady_clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

std::string rows_label(int64_t rows) {
  const double exponent = std::log10(static_cast<double>(rows));
  if (rows > 0 && std::abs(exponent - std::round(exponent)) < 1e-9) {
    return "1e" + std::to_string(static_cast<int>(std::round(exponent)));
  }
  return std::to_string(rows);
}

void parse_step_counts(const std::string& flag, const std::string& text, StepCounts& counts) {
  const auto comma = text.find(',');
  StepCounts parsed;
  bool ok = comma != std::string::npos;
  if (ok) {
    try {
      parsed.warmup = std::stoi(text.substr(0, comma));
      parsed.timed = std::stoi(text.substr(comma + 1));
    } catch (const std::logic_error&) {  // std::stoi's invalid_argument and out_of_range
      ok = false;
    }
  }
  TORCH_CHECK_VALUE(ok && parsed.warmup >= 0 && parsed.timed > 0, flag,
                    ": W,T (W >= 0, T > 0), got '", text, "'");
  counts = parsed;
}

double percentile(std::vector<double> values, double p) {
  TORCH_CHECK(!values.empty(), "percentile of nothing");
  std::sort(values.begin(), values.end());
  const auto rank = static_cast<size_t>(std::ceil(p / 100.0 * values.size()));
  return values[std::clamp<size_t>(rank, 1, values.size()) - 1];
}

int64_t process_context_switches() {
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  return usage.ru_nvcsw + usage.ru_nivcsw;
}

double process_cpu_seconds() {
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

int blas_threads() {
  auto get = reinterpret_cast<int (*)()>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return get != nullptr ? get() : -1;
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

std::pair<std::vector<nlohmann::json>, std::vector<nlohmann::json>> alternate_rounds(
    const std::string& program, const std::string& label, int rounds,
    const std::function<nlohmann::json()>& ours, const std::function<nlohmann::json()>& pytorch) {
  std::pair<std::vector<nlohmann::json>, std::vector<nlohmann::json>> results;
  for (int round = 1; round <= rounds; ++round) {
    std::fprintf(stderr, "%s: %s, round %d of %d: ours...", program.c_str(), label.c_str(), round,
                 rounds);
    results.first.push_back(ours());
    std::fprintf(stderr, " pytorch...");
    results.second.push_back(pytorch());
    std::fprintf(stderr, " done\n");
  }
  return results;
}

double load_average() {
  std::ifstream file("/proc/loadavg");
  double one_minute = -1;
  file >> one_minute;
  return file ? one_minute : -1;
}

std::string machine_load_line(double at_start, double at_end) {
  const unsigned cores = std::thread::hardware_concurrency();
  std::ostringstream line;
  line << std::fixed << std::setprecision(2) << "machine: " << cores
       << " cores, 1-minute load average " << at_start << " at the start and " << at_end
       << " at the end";
  if (std::max(at_start, at_end) > cores) {
    line << " (ABOVE the core count: others' work competed with these measurements)";
  }
  return line.str();
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

void print_result(const nlohmann::json& result) {
  std::fputs((std::string(kResultPrefix) + result.dump() + "\n").c_str(), stdout);
  std::fflush(stdout);
}

std::vector<nlohmann::json> run_side(const std::string& what, std::vector<std::string> argv,
                                     int deadline_seconds) {
  argv.insert(argv.begin(),
              {"/usr/bin/timeout", "--kill-after=10", std::to_string(deadline_seconds)});
  const ChildResult child = run_child(argv, "");
  // timeout(1) exits with 124 when it sent its signal; 137 when the child needed the SIGKILL.
  TORCH_CHECK(child.exit_code != 124 && child.exit_code != 128 + 9, what,
              " did not finish within its deadline of ", deadline_seconds,
              " s and was killed; its output:\n", child.stdout_text);
  TORCH_CHECK(child.exit_code == 0, what, " exited with ", child.exit_code, "; its output:\n",
              child.stdout_text);
  std::vector<nlohmann::json> results = result_lines(child.stdout_text);
  TORCH_CHECK(!results.empty(), what, " printed no RESULT line; its output:\n", child.stdout_text);
  return results;
}

ResultsFile::ResultsFile(const std::string& path, const std::string& program)
    : path_(path), program_(program), load_at_start_(load_average()) {
  TORCH_CHECK(!path.empty(), program, ": --json PATH is required");
  const std::filesystem::path fs_path(path);
  if (fs_path.has_parent_path()) std::filesystem::create_directories(fs_path.parent_path());
  file_.open(path);
  TORCH_CHECK(file_.good(), program, ": cannot open --json file '", path, "' for writing");
}

void ResultsFile::write(const nlohmann::json& results) {
  const nlohmann::json file{{"cases", results},
                            {"load_average", {load_at_start_, load_average()}},
                            {"cores", std::thread::hardware_concurrency()}};
  file_ << file.dump(2) << "\n";
  file_.close();
  TORCH_CHECK(file_.good(), program_, ": writing '", path_, "' failed");
}

void ResultsFile::discard() {
  file_.close();
  std::filesystem::remove(path_);
}

int ResultsFile::write_unless(const nlohmann::json& results,
                              const std::vector<std::string>& problems) {
  if (!problems.empty()) {
    discard();
    for (const auto& p : problems) std::fprintf(stderr, "%s: %s\n", program_.c_str(), p.c_str());
    std::fprintf(stderr, "%s: no results written\n", program_.c_str());
    return 1;
  }
  write(results);
  std::printf("results written to %s\n", path_.c_str());
  return 0;
}

int run_main(const char* program, int (*run)(int, char**), int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
  }
  return 1;
}

int finish_ours_alone(ResultsFile& results, const std::string& program, nlohmann::json cases,
                      const std::string& settings, const std::string& note, int rounds,
                      double load_at_start) {
  const double load_at_end = load_average();
  size_t width = 4;
  for (const nlohmann::json& row : cases) {
    width = std::max(width, row["case"].get<std::string>().size());
  }
  std::printf("%s: %s; %d round(s)\n%s\n", program.c_str(), settings.c_str(), rounds, note.c_str());
  std::printf("%-*s %10s %10s %10s  %s\n", static_cast<int>(width), "case", "min", "median", "max",
              "unit");
  // Whole numbers from 1000 up, four significant digits below.
  const auto figure = [](double value) {
    char text[32];
    std::snprintf(text, sizeof text, std::abs(value) >= 1000 ? "%.0f" : "%.4g", value);
    return std::string(text);
  };
  for (const nlohmann::json& row : cases) {
    std::printf("%-*s %10s %10s %10s  %s\n", static_cast<int>(width),
                row["case"].get<std::string>().c_str(), figure(row["min"].get<double>()).c_str(),
                figure(row["median"].get<double>()).c_str(),
                figure(row["max"].get<double>()).c_str(), row["unit"].get<std::string>().c_str());
  }
  std::printf("%s\n", machine_load_line(load_at_start, load_at_end).c_str());
  std::fflush(stdout);
  cases.push_back(nlohmann::json{{"case", "settings"}, {"settings", settings}, {"note", note}});
  return results.write_unless(cases, {});
}

}  // namespace bench
}  // namespace distoptim
