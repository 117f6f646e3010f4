#pragma once

// What every benchmark does around its measurements: small statistics, reading this process's
// memory and CPU counters, collecting the "RESULT {json}" lines its worker processes print, and
// writing its JSON results file.

#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace distoptim {
namespace bench {

/// The marker before the JSON a benchmark's worker process prints as its result.
constexpr std::string_view kResultPrefix = "RESULT ";

/// The median of `values` (the mean of the middle two for an even count). Throws c10::Error
/// for an empty list.
double median(std::vector<double> values);

/// The nearest-rank `p`-th percentile of `values` (0 < p <= 100), as the Python sides compute it.
/// Throws c10::Error for an empty list.
double percentile(std::vector<double> values, double p);

/// The smallest, median and largest of one side's figure over the rounds of a benchmark in which
/// ours and PyTorch's runs alternate (ours, PyTorch's, ours, ...), so that drift in the machine's
/// load reaches both sides alike.
struct Spread {
  double min = 0;
  double median = 0;
  double max = 0;
};

/// The Spread of `values`. Throws c10::Error for an empty list.
Spread spread_of(const std::vector<double>& values);

/// One case of a results file comparing ours with PyTorch's over rounds: {case, ours, pytorch
/// (the medians), ours_min, ours_max, pytorch_min, pytorch_max, rounds, unit, better ("lower"
/// or "higher")}.
nlohmann::json comparison_row(const std::string& name, const Spread& ours, const Spread& pytorch,
                              size_t rounds, const std::string& unit, bool lower_is_better);

/// One case of a results file for a figure of ours alone over rounds (a benchmark with no
/// PyTorch side): {case, min, median, max (of `values`), unit, samples, better ("lower" or
/// "higher")}. Throws c10::Error for an empty list.
nlohmann::json spread_row(const std::string& name, const std::vector<double>& values,
                          const std::string& unit, const std::string& better);

/// Milliseconds from `from` to `to`.
double ms_between(std::chrono::steady_clock::time_point from,
                  std::chrono::steady_clock::time_point to);

/// A table's row count as a benchmark names it: "1e7" for a power of ten, else its digits.
std::string rows_label(int64_t rows);

/// Warm-up and timed iterations, as a benchmark's --steps W,T gives them.
struct StepCounts {
  int warmup = 0;
  int timed = 0;
};

/// Parses "W,T" (W >= 0, T > 0) into `counts`. Throws c10::ValueError naming `flag` and `text`
/// otherwise, changing nothing.
void parse_step_counts(const std::string& flag, const std::string& text, StepCounts& counts);

/// Runs `ours` and `pytorch` alternately, `rounds` times each (ours first), printing progress
/// on standard error behind "`program`: `label`", and returns each side's results in round order.
std::pair<std::vector<nlohmann::json>, std::vector<nlohmann::json>> alternate_rounds(
    const std::string& program, const std::string& label, int rounds,
    const std::function<nlohmann::json()>& ours, const std::function<nlohmann::json()>& pytorch);

/// CPU time this process has used so far, every thread, user plus system (getrusage), seconds.
double process_cpu_seconds();

/// The threads of the OpenBLAS this process loaded (LibTorch calls the system BLAS, and
/// at::set_num_threads does not reach it), or -1 where the BLAS is another.
int blas_threads();

/// Context switches this process's threads have made so far, voluntary and involuntary
/// (getrusage: every thread, ended ones included).
int64_t process_context_switches();

/// A "kB" field of /proc/self/status (VmRSS, VmHWM, RssAnon, ...), or -1 if it is missing.
long proc_status_kb(const std::string& field);

/// The machine's 1-minute load average (/proc/loadavg), or -1 if it cannot be read.
double load_average();

/// The machine's core count and its load average at the start and end of a run, as one line
/// every benchmark prints, flagging a run whose load exceeded the core count (others' work then
/// competed with the measurements).
std::string machine_load_line(double at_start, double at_end);

/// The JSON after kResultPrefix on every line of `output` that has it, in order; the marker
/// may follow a prefix (distrun's "[rank R] "). Throws nlohmann::json's parse_error on bad JSON.
std::vector<nlohmann::json> result_lines(const std::string& output);

/// Prints `result` as one RESULT line on standard output and flushes it, so the line reaches
/// the benchmark before the worker goes on (or dies).
void print_result(const nlohmann::json& result);

/// Runs one side of a comparison, `argv` (a job of worker processes: distrun's ranks, or a
/// Python script that spawns its own), under timeout(1), and returns every RESULT it printed,
/// at least one. timeout(1) leads a process group of its own and signals all of it past
/// `deadline_seconds`, so grandchildren go too; SIGKILL follows 10 s later. Throws c10::Error
/// naming `what`, with the side's output, if it ran out of time, exited non-zero or printed no
/// RESULT.
std::vector<nlohmann::json> run_side(const std::string& what, std::vector<std::string> argv,
                                     int deadline_seconds);

/// A benchmark's main(): returns `run(argc, argv)`, or 1 after printing an exception it threw on
/// standard error behind "`program`: ".
int run_main(const char* program, int (*run)(int, char**), int argc, char** argv);

/// The file a benchmark writes its results to (--json PATH). Opened, with its folder created,
/// at construction, so a bad path fails before minutes of measuring rather than after. It holds
/// {"cases": <the benchmark's results>, "load_average": [at construction, at write], "cores": N},
/// what scripts/benchmarks_doc.py renders into docs/benchmarks.md.
class ResultsFile {
 public:
  /// `program` names the benchmark in error messages. Throws c10::Error if the file cannot be
  /// opened.
  ResultsFile(const std::string& path, const std::string& program);
  /// Writes `results` (indented, as "cases") and the load averages, and closes the file; throws
  /// c10::Error if writing failed.
  void write(const nlohmann::json& results);
  /// Closes and removes the file, for a run whose results must not be used.
  void discard();
  /// The end of a run: with no `problems`, writes `results`, says where on standard output and
  /// returns 0; otherwise discards the file, prints each problem and that nothing was written
  /// on standard error, and returns 1 (the benchmark's exit status).
  int write_unless(const nlohmann::json& results, const std::vector<std::string>& problems);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::string program_;
  std::ofstream file_;
  double load_at_start_;
};

/// The end of a benchmark with no PyTorch side whose cases are spread_rows: prints "`program`:
/// `settings`; R round(s)", `note`, the cases as a table (min, median, max, unit) and the load
/// line (from `load_at_start` to now); adds the case {"case": "settings", "settings", "note"}
/// and writes the results (write_unless, without problems). Returns the exit status.
int finish_ours_alone(ResultsFile& results, const std::string& program, nlohmann::json cases,
                      const std::string& settings, const std::string& note, int rounds,
                      double load_at_start);

}  // namespace bench
}  // namespace distoptim
