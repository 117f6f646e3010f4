#include "trainer_slots.h"

#include "example_main.h"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <distoptim/rpc.h>

namespace examples {

namespace {

namespace fs = std::filesystem;
namespace rpc = distoptim::rpc;
using Clock = std::chrono::steady_clock;

// The server's record of the slots. One mutex guards every field; RPC handlers and the server's
// main thread share it. Never destroyed (handlers may run while the process ends).
class ServerRecord {
 public:
  void open(const fs::path& csv, int first_rank, int trainers, double timeout_seconds,
            SlotLog names) {
    std::lock_guard<std::mutex> lock(mutex_);
    first_rank_ = first_rank;
    names_ = std::move(names);
    slots_.assign(static_cast<size_t>(trainers), Slot{});
    for (Slot& slot : slots_) slot.last_seen = start_;
    timeout_seconds_ = timeout_seconds;
    // A server started again (distrun --restart-policy rank) reads its predecessor's record back
    // from the log and goes on appending to it.
    const bool resume = restart_count() > 0 && fs::exists(csv);
    if (resume) replay(csv);
    csv_.open(csv, resume ? std::ios::app : std::ios::trunc);
    TORCH_CHECK(csv_, names_.server, ": cannot write ", csv.string());
    if (!resume) csv_ << kHeader << "\n";
    csv_.flush();
  }

  // Raises SIGKILL in the step that brings every slot to `steps` steps (0: never).
  void kill_when_every_slot_reaches(int64_t steps) {
    std::lock_guard<std::mutex> lock(mutex_);
    kill_at_ = steps;
  }

  std::tuple<int64_t, int64_t, double, double, std::string> join(int64_t slot_rank,
                                                                 const std::string& worker) {
    std::lock_guard<std::mutex> lock(mutex_);
    Slot& slot = checked(slot_rank, worker);
    const auto now = Clock::now();
    // A report sent again (its answer lost with a server that died, see ask_server) that the
    // record already holds changes nothing: here, and for steps and finishes below.
    if (slot.workers > 0 && slot.worker == worker) {
      slot.last_seen = now;
      return {slot.steps, slot.samples, seconds(slot.first_join, now), held_out_before_,
              slot.previous};
    }
    if (slot.workers == 0) {
      slot.first_join = now;
      fmt::print("{}: {} joined slot {}\n", names_.server, worker, slot_rank);
    } else {
      fmt::print(
          "{}: {} joined slot {} in place of {}, {:.1f} s after its last sign of life; it "
          "continues from step {}\n",
          names_.server, worker, slot_rank, slot.worker, seconds(slot.last_seen, now), slot.steps);
    }
    std::fflush(stdout);
    ++slot.workers;
    slot.previous = slot.worker;
    slot.worker = worker;
    joined_.push_back(worker);
    slot.last_seen = now;
    log(now, "join", slot_rank, worker, slot.steps, NAN);
    return {slot.steps, slot.samples, seconds(slot.first_join, now), held_out_before_,
            slot.previous};
  }

  void step(int64_t slot_rank, const std::string& worker, int64_t step, int64_t samples,
            double loss) {
    std::lock_guard<std::mutex> lock(mutex_);
    Slot& slot = checked(slot_rank, worker);
    if (slot.worker == worker && step <= slot.steps) return;
    slot.steps = step;
    slot.samples = samples;
    slot.last_seen = Clock::now();
    ++global_steps_;
    log(slot.last_seen, "step", slot_rank, worker, step, loss, samples);
    curves_[worker].emplace_back(seconds(start_, slot.last_seen), loss);
    if (kill_at_ > 0 && fewest_steps_locked() >= kill_at_) {
      fmt::print(
          "{}: SIGKILLs itself once every trainer slot has taken {} steps (--kill-server-at)\n",
          names_.server, kill_at_);
      std::fflush(stdout);
      ::raise(SIGKILL);
    }
  }

  void kill(int64_t slot_rank, const std::string& worker, int64_t step) {
    std::lock_guard<std::mutex> lock(mutex_);
    checked(slot_rank, worker);
    fmt::print("{}: {} kills itself in step {} (--kill-trainer-at)\n", names_.server, worker, step);
    std::fflush(stdout);
    log(Clock::now(), "kill", slot_rank, worker, step, NAN);
  }

  void finish(int64_t slot_rank, const std::string& worker) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      Slot& slot = checked(slot_rank, worker);
      if (slot.finished) return;
      slot.finished = true;
      log(Clock::now(), "finish", slot_rank, worker, slot.steps, NAN);
    }
    finished_.notify_all();
  }

  void set_held_out_before(double value) {
    std::lock_guard<std::mutex> lock(mutex_);
    held_out_before_ = value;
    log(Clock::now(), "held_out_before", -1, "", 0, value);
  }

  int64_t global_steps() {
    std::lock_guard<std::mutex> lock(mutex_);
    return global_steps_;
  }
  int64_t fewest_steps() {
    std::lock_guard<std::mutex> lock(mutex_);
    return fewest_steps_locked();
  }
  std::optional<double> held_out_before() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (std::isnan(held_out_before_)) return std::nullopt;
    return held_out_before_;
  }
  bool all_finished() {
    std::lock_guard<std::mutex> lock(mutex_);
    return !slots_.empty() && std::all_of(slots_.begin(), slots_.end(),
                                          [](const Slot& slot) { return slot.finished; });
  }
  // Whether every slot but the one of rank `rank` has finished.
  bool others_finished(int64_t rank) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (static_cast<int64_t>(i) + first_rank_ != rank && !slots_[i].finished) return false;
    }
    return true;
  }

  // Returns once every slot has finished; throws naming a slot that has shown no sign of life
  // (a join or a step) for timeout_seconds_: its trainer died and was not restarted, or hangs.
  void wait_for_trainers() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      bool all = true;
      for (size_t i = 0; i < slots_.size(); ++i) {
        const Slot& slot = slots_[i];
        if (slot.finished) continue;
        all = false;
        const double quiet = seconds(slot.last_seen, Clock::now());
        if (quiet > timeout_seconds_) {
          throw std::runtime_error(fmt::format(
              "trainer slot {} (rank {}; {}) has shown no sign of life for {:.0f} s "
              "(--trainer-timeout {}): its trainer died and was not restarted (run under distrun "
              "--restart-policy rank --max-restarts K), or hangs",
              i + static_cast<size_t>(first_rank_), i + static_cast<size_t>(first_rank_),
              slot.workers == 0
                  ? std::string("no worker ever joined it")
                  : fmt::format("last worker '{}', at step {}", slot.worker, slot.steps),
              quiet, timeout_seconds_));
        }
      }
      if (all) break;
      finished_.wait_for(lock, std::chrono::milliseconds(200));
    }
    csv_.close();
    int64_t workers = 0;
    for (const Slot& slot : slots_) workers += slot.workers;
    fmt::print("{}: every trainer slot finished: {} steps in all by {} workers in {} slots\n",
               names_.server, global_steps_, workers, slots_.size());
    std::fflush(stdout);
  }

  // The gnuplot commands that draw the log's losses with one curve per worker, in order of joins
  // (each an inline data block): a killed trainer's curve stops, its replacement's starts after
  // the gap.
  std::string plot_commands() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string blocks, curves;
    for (size_t i = 0; i < joined_.size(); ++i) {
      blocks += fmt::format("$worker{} << EOD\n", i);
      for (const auto& [t, loss] : curves_[joined_[i]]) blocks += fmt::format("{} {}\n", t, loss);
      blocks += "EOD\n";
      curves += fmt::format("{}$worker{} using 1:2 with linespoints lw 2 pt 7 ps 0.4 title '{}'",
                            curves.empty() ? "plot " : ", ", i, joined_[i]);
    }
    return fmt::format(
        "{}"
        "set xlabel 'seconds since the server started'\n"
        "set ylabel '{}'\n"
        "set title '{}'\n"
        "set grid\n"
        "{}\n",
        blocks, names_.loss_label, names_.title, curves);
  }

 private:
  struct Slot {
    std::string worker;    // the latest to join
    std::string previous;  // the one it replaced ("" for the first)
    int64_t workers = 0;
    int64_t steps = 0;
    int64_t samples = 0;
    bool finished = false;
    Clock::time_point first_join;
    Clock::time_point last_seen;
  };

  int64_t fewest_steps_locked() const {
    int64_t fewest = slots_.empty() ? 0 : slots_.front().steps;
    for (const Slot& slot : slots_) fewest = std::min(fewest, slot.steps);
    return fewest;
  }

  static double seconds(Clock::time_point from, Clock::time_point to) {
    return std::chrono::duration<double>(to - from).count();
  }

  Slot& checked(int64_t slot_rank, const std::string& worker) {
    const auto last = first_rank_ + static_cast<int64_t>(slots_.size()) - 1;
    TORCH_CHECK_VALUE(slot_rank >= first_rank_ && slot_rank <= last, names_.server, ": worker '",
                      worker, "' names trainer slot ", slot_rank, "; the server has slots ",
                      first_rank_, " to ", last);
    return slots_[static_cast<size_t>(slot_rank - first_rank_)];
  }

  void log(Clock::time_point when, const char* event, int64_t slot, const std::string& worker,
           int64_t step, double loss, int64_t samples = 0) {
    csv_ << fmt::format("{:.3f},{},{},{},{},{},{},{}\n", seconds(start_, when), event, slot, worker,
                        step, global_steps_, std::isnan(loss) ? "" : fmt::format("{:.6f}", loss),
                        samples);
    csv_.flush();
  }

  // The record as the log `csv` left it, its clock going on from the log's last time; every
  // unfinished slot counts as seen now (its trainer could not report while no server ran).
  void replay(const fs::path& csv) {
    std::ifstream in(csv);
    std::string line;
    std::getline(in, line);
    TORCH_CHECK(line == kHeader, names_.server, ": '", csv.string(),
                "' is not a trainer slots log");
    double last_seconds = 0;
    std::vector<std::pair<Slot*, double>> first_joins;  // seconds into the log
    while (std::getline(in, line)) {
      std::vector<std::string> fields;
      std::stringstream row(line);
      for (std::string field; std::getline(row, field, ',');) fields.push_back(field);
      if (fields.size() == 7) fields.emplace_back();  // no samples: an empty last field
      TORCH_CHECK(fields.size() == 8, names_.server, ": '", csv.string(), "': malformed row '",
                  line, "'");
      last_seconds = std::stod(fields[0]);
      const std::string& event = fields[1];
      if (event == "held_out_before") {
        held_out_before_ = std::stod(fields[6]);
        continue;
      }
      Slot& slot = checked(std::stoll(fields[2]), fields[3]);
      if (event == "join") {
        if (slot.workers++ == 0) first_joins.emplace_back(&slot, last_seconds);
        slot.previous = slot.worker;
        slot.worker = fields[3];
        joined_.push_back(fields[3]);
      } else if (event == "step") {
        slot.steps = std::stoll(fields[4]);
        slot.samples = fields[7].empty() ? 0 : std::stoll(fields[7]);
        ++global_steps_;
        curves_[fields[3]].emplace_back(last_seconds, std::stod(fields[6]));
      } else if (event == "finish") {
        slot.finished = true;
      }
    }
    start_ = Clock::now() - std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(last_seconds));
    for (auto& [slot, at] : first_joins) {
      slot->first_join =
          start_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(at));
    }
    for (Slot& slot : slots_) slot.last_seen = Clock::now();
    fmt::print("{}: started again; the trainer slots resume from its log {}: {} steps recorded\n",
               names_.server, csv.string(), global_steps_);
    std::fflush(stdout);
  }

  static constexpr const char* kHeader = "seconds,event,slot,worker,step,global_step,loss,samples";

  std::mutex mutex_;
  std::condition_variable finished_;
  Clock::time_point start_ = Clock::now();
  std::ofstream csv_;
  std::vector<Slot> slots_;
  std::vector<std::string> joined_;  // every worker that joined, in order
  std::map<std::string, std::vector<std::pair<double, double>>> curves_;  // (seconds, loss)
  double timeout_seconds_ = 0;
  int64_t global_steps_ = 0;
  double held_out_before_ = NAN;
  int64_t kill_at_ = 0;
  int64_t first_rank_ = 1;
  SlotLog names_;
};

ServerRecord& server_record() {
  static auto* record = new ServerRecord;
  return *record;
}

std::tuple<int64_t, int64_t, double, double, std::string> join(int64_t slot, std::string worker) {
  return server_record().join(slot, worker);
}
bool record_step(int64_t slot, std::string worker, int64_t step, int64_t samples, double loss) {
  server_record().step(slot, worker, step, samples, loss);
  return true;
}
bool record_kill(int64_t slot, std::string worker, int64_t step) {
  server_record().kill(slot, worker, step);
  return true;
}
bool record_finish(int64_t slot, std::string worker) {
  server_record().finish(slot, worker);
  return true;
}
bool record_held_out_before(double value) {
  server_record().set_held_out_before(value);
  return true;
}
int64_t recorded_steps_here() { return server_record().global_steps(); }
int64_t fewest_steps_here() { return server_record().fewest_steps(); }
std::optional<double> held_out_before_here() { return server_record().held_out_before(); }
bool all_finished_here() { return server_record().all_finished(); }
bool others_finished_here(int64_t rank) { return server_record().others_finished(rank); }

}  // namespace

DISTOPTIM_RPC_FUNCTION("examples.slots.join", join);
DISTOPTIM_RPC_FUNCTION("examples.slots.step", record_step);
DISTOPTIM_RPC_FUNCTION("examples.slots.kill", record_kill);
DISTOPTIM_RPC_FUNCTION("examples.slots.finish", record_finish);
DISTOPTIM_RPC_FUNCTION("examples.slots.held_out_before", record_held_out_before);
DISTOPTIM_RPC_FUNCTION("examples.slots.steps", recorded_steps_here);
DISTOPTIM_RPC_FUNCTION("examples.slots.fewest_steps", fewest_steps_here);
DISTOPTIM_RPC_FUNCTION("examples.slots.measured_before", held_out_before_here);
DISTOPTIM_RPC_FUNCTION("examples.slots.finished", all_finished_here);
DISTOPTIM_RPC_FUNCTION("examples.slots.others_finished", others_finished_here);

void open_trainer_slots(const fs::path& csv, int first_rank, int trainers, double timeout_seconds,
                        SlotLog log) {
  server_record().open(csv, first_rank, trainers, timeout_seconds, std::move(log));
}
void wait_for_trainers() { server_record().wait_for_trainers(); }
void kill_when_every_slot_reaches(int64_t steps) {
  server_record().kill_when_every_slot_reaches(steps);
}
std::string trainer_slots_plot_commands() { return server_record().plot_commands(); }

// A trainer started with the server may find the group's store up before the server has entered
// the group itself; the server, entering, tells it, so it waits to see it listed.
bool owners_current(const c10::IValue& value) {
  if (value.isTuple()) {
    for (const c10::IValue& item : value.toTupleRef().elements()) {
      if (!owners_current(item)) return false;
    }
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) {
      if (!owners_current(item)) return false;
    }
  } else if (value.isRRef()) {
    const distoptim::rpc::WorkerInfo owner =
        distoptim::rpc::RRef<c10::IValue>(value.toRRef()).owner();
    try {
      return distoptim::rpc::get_worker_info(owner.name).id == owner.id;
    } catch (const c10::ValueError&) {
      return false;  // no member of that name: not back yet
    }
  }
  return true;
}

void wait_until_listed(const std::string& server) {
  const auto deadline = Clock::now() + std::chrono::minutes(2);
  auto listed = [&] {
    const auto workers = rpc::get_worker_infos();
    return std::any_of(workers.begin(), workers.end(),
                       [&](const rpc::WorkerInfo& worker) { return worker.name == server; });
  };
  while (!listed()) {
    if (Clock::now() > deadline) {
      throw std::runtime_error("the server '" + server +
                               "' has not entered the group within 2 minutes");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void wait_until_gone(const std::vector<std::string>& workers) {
  const auto deadline = Clock::now() + std::chrono::minutes(2);
  auto staying = [&] {
    std::string names;
    for (const rpc::WorkerInfo& worker : rpc::get_worker_infos()) {
      if (std::find(workers.begin(), workers.end(), worker.name) == workers.end()) continue;
      names += (names.empty() ? "'" : ", '") + worker.name + "'";
    }
    return names;
  };
  for (std::string names = staying(); !names.empty(); names = staying()) {
    if (Clock::now() > deadline) {
      throw std::runtime_error("these workers have not left the group within 2 minutes: " + names);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

namespace {

// `function` of the server: a server that is lost (killed, and being started again under its
// name) is waited for, within 2 minutes, and asked again.
template <typename R, typename... Args>
R ask_server(const std::string& server, const char* function, std::tuple<Args...> args) {
  const auto deadline = Clock::now() + std::chrono::minutes(2);
  for (;;) {
    wait_until_listed(server);
    try {
      return rpc::rpc_sync<R>(server, function, args);
    } catch (const distoptim::PeerLostError&) {
      if (Clock::now() > deadline) throw;
    } catch (const c10::ValueError&) {  // dropped since it was listed
      if (Clock::now() > deadline) throw;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace

SlotStart join_slot(const std::string& server, int rank, const std::string& name) {
  SlotStart start;
  std::tie(start.steps, start.samples, start.seconds, start.held_out_before,
           start.previous_worker) =
      ask_server<std::tuple<int64_t, int64_t, double, double, std::string>>(
          server, "examples.slots.join", std::tuple{static_cast<int64_t>(rank), name});
  return start;
}

void report_step(const std::string& server, int rank, const std::string& name, int64_t step,
                 int64_t samples, double loss) {
  ask_server<bool>(server, "examples.slots.step",
                   std::tuple{static_cast<int64_t>(rank), name, step, samples, loss});
}
void report_kill(const std::string& server, int rank, const std::string& name, int64_t step) {
  ask_server<bool>(server, "examples.slots.kill",
                   std::tuple{static_cast<int64_t>(rank), name, step});
}
void report_finish(const std::string& server, int rank, const std::string& name) {
  ask_server<bool>(server, "examples.slots.finish", std::tuple{static_cast<int64_t>(rank), name});
}
void report_held_out_before(const std::string& server, double value) {
  ask_server<bool>(server, "examples.slots.held_out_before", std::tuple{value});
}
int64_t recorded_steps(const std::string& server) {
  return ask_server<int64_t>(server, "examples.slots.steps", std::tuple{});
}
int64_t fewest_slot_steps(const std::string& server) {
  return ask_server<int64_t>(server, "examples.slots.fewest_steps", std::tuple{});
}
double wait_for_held_out_before(const std::string& server) {
  return fetch_when_ready<double>(server, "examples.slots.measured_before",
                                  "the held-out loss before training (the first trainer measures "
                                  "it before any trainer steps)");
}
bool trainer_slots_finished(const std::string& server) {
  return ask_server<bool>(server, "examples.slots.finished", std::tuple{});
}
void wait_for_other_slots(const std::string& server, int rank, double timeout_seconds) {
  int64_t steps = recorded_steps(server);
  auto progressed = Clock::now();
  while (!ask_server<bool>(server, "examples.slots.others_finished",
                           std::tuple{static_cast<int64_t>(rank)})) {
    const int64_t now = recorded_steps(server);
    if (now != steps) {
      steps = now;
      progressed = Clock::now();
    }
    if (std::chrono::duration<double>(Clock::now() - progressed).count() > timeout_seconds) {
      throw std::runtime_error(fmt::format(
          "slot {}: the other trainer slots of '{}' have not finished, and no step was recorded "
          "there for {} s",
          rank, server, timeout_seconds));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

void add_elastic_options(CLI::App& app, const std::string& elastic_help, bool& elastic,
                         int64_t& kill_trainer_at, int& kill_trainer, double& trainer_timeout) {
  CLI::Option* flag = app.add_flag("--elastic", elastic, elastic_help);
  CLI::Option* at = app.add_option("--kill-trainer-at", kill_trainer_at,
                                   "a trainer (--kill-trainer) SIGKILLs itself in this step, once, "
                                   "after its backward pass and before its optimizer step (a "
                                   "fault to see the restart; 0: never)")
                        ->check(at_least(0))
                        ->needs(flag);
  app.add_option("--kill-trainer", kill_trainer,
                 "which trainer --kill-trainer-at kills, counted from 0 (-1: the last)")
      ->check(at_least(-1))
      ->needs(at);
  app.add_option("--trainer-timeout", trainer_timeout,
                 "with --elastic, the server fails when a trainer slot has shown no sign of "
                 "life (a join or a step) for this many seconds")
      ->check(above(0))
      ->needs(flag);
}

int restart_count() {
  const char* value = std::getenv("DISTRUN_RESTART_COUNT");
  return value == nullptr ? 0 : std::atoi(value);
}

}  // namespace examples
