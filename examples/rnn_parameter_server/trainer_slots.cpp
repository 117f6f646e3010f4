#include "trainer_slots.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include <distoptim/rpc.h>

namespace rnn_ps {

namespace {

namespace fs = std::filesystem;
namespace rpc = distoptim::rpc;
using Clock = std::chrono::steady_clock;

// The server's record of the slots. One mutex guards every field; RPC handlers and the server's
// main thread share it. Never destroyed (handlers may run while the process ends).
class ServerRecord {
 public:
  void open(const fs::path& csv, int trainers, double timeout_seconds) {
    std::lock_guard<std::mutex> lock(mutex_);
    csv_.open(csv);
    csv_ << "seconds,event,slot,worker,step,global_step,loss\n";
    slots_.assign(static_cast<size_t>(trainers), Slot{});
    for (Slot& slot : slots_) slot.last_seen = start_;
    timeout_seconds_ = timeout_seconds;
  }

  void set_model(RNNModel::Shared model) {
    std::lock_guard<std::mutex> lock(mutex_);
    model_ = std::move(model);
  }
  std::optional<RNNModel::Shared> model() {
    std::lock_guard<std::mutex> lock(mutex_);
    return model_;
  }

  std::tuple<int64_t, int64_t, double, double> join(int64_t slot_rank, const std::string& worker) {
    std::lock_guard<std::mutex> lock(mutex_);
    Slot& slot = checked(slot_rank, worker);
    const auto now = Clock::now();
    if (slot.workers == 0) {
      slot.first_join = now;
      fmt::print("ps: {} joined slot {}\n", worker, slot_rank);
    } else {
      fmt::print(
          "ps: {} joined slot {} in place of {}, {:.1f} s after its last sign of life; it "
          "continues from step {}\n",
          worker, slot_rank, slot.worker, seconds(slot.last_seen, now), slot.steps);
    }
    std::fflush(stdout);
    ++slot.workers;
    slot.worker = worker;
    joined_.push_back(worker);
    slot.last_seen = now;
    log(now, "join", slot_rank, worker, slot.steps, NAN);
    return {slot.steps, slot.tokens, seconds(slot.first_join, now), held_out_before_};
  }

  void step(int64_t slot_rank, const std::string& worker, int64_t step, int64_t tokens,
            double loss) {
    std::lock_guard<std::mutex> lock(mutex_);
    Slot& slot = checked(slot_rank, worker);
    slot.steps = step;
    slot.tokens = tokens;
    slot.last_seen = Clock::now();
    ++global_steps_;
    log(slot.last_seen, "step", slot_rank, worker, step, loss);
    curves_[worker].emplace_back(seconds(start_, slot.last_seen), loss);
  }

  void kill(int64_t slot_rank, const std::string& worker, int64_t step) {
    std::lock_guard<std::mutex> lock(mutex_);
    checked(slot_rank, worker);
    fmt::print("ps: {} kills itself in step {} (--kill-trainer-at)\n", worker, step);
    std::fflush(stdout);
    log(Clock::now(), "kill", slot_rank, worker, step, NAN);
  }

  void finish(int64_t slot_rank, const std::string& worker) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      Slot& slot = checked(slot_rank, worker);
      slot.finished = true;
      log(Clock::now(), "finish", slot_rank, worker, slot.steps, NAN);
    }
    finished_.notify_all();
  }

  void set_held_out_before(double value) {
    std::lock_guard<std::mutex> lock(mutex_);
    held_out_before_ = value;
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
              i + 1, i + 1,
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
    fmt::print("ps: every trainer slot finished: {} steps in all by {} workers in {} slots\n",
               global_steps_, workers, slots_.size());
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
        "set ylabel 'cross-entropy loss'\n"
        "set title 'RNN language model, trainers killed and restarted (--elastic)'\n"
        "set grid\n"
        "{}\n",
        blocks, curves);
  }

 private:
  struct Slot {
    std::string worker;  // the latest to join
    int64_t workers = 0;
    int64_t steps = 0;
    int64_t tokens = 0;
    bool finished = false;
    Clock::time_point first_join;
    Clock::time_point last_seen;
  };

  static double seconds(Clock::time_point from, Clock::time_point to) {
    return std::chrono::duration<double>(to - from).count();
  }

  Slot& checked(int64_t slot_rank, const std::string& worker) {
    TORCH_CHECK_VALUE(slot_rank >= 1 && slot_rank <= static_cast<int64_t>(slots_.size()),
                      "rnn_parameter_server: worker '", worker, "' names trainer slot ", slot_rank,
                      "; the server has slots 1 to ", slots_.size());
    return slots_[static_cast<size_t>(slot_rank - 1)];
  }

  void log(Clock::time_point when, const char* event, int64_t slot, const std::string& worker,
           int64_t step, double loss) {
    csv_ << fmt::format("{:.3f},{},{},{},{},{},{}\n", seconds(start_, when), event, slot, worker,
                        step, global_steps_, std::isnan(loss) ? "" : fmt::format("{:.6f}", loss));
    csv_.flush();
  }

  std::mutex mutex_;
  std::condition_variable finished_;
  const Clock::time_point start_ = Clock::now();
  std::ofstream csv_;
  std::vector<Slot> slots_;
  std::vector<std::string> joined_;  // every worker that joined, in order
  std::map<std::string, std::vector<std::pair<double, double>>> curves_;  // (seconds, loss)
  double timeout_seconds_ = 0;
  int64_t global_steps_ = 0;
  double held_out_before_ = NAN;
  std::optional<RNNModel::Shared> model_;
};

ServerRecord& server_record() {
  static auto* record = new ServerRecord;
  return *record;
}

std::optional<RNNModel::Shared> shared_model() { return server_record().model(); }
std::tuple<int64_t, int64_t, double, double> join(int64_t slot, std::string worker) {
  return server_record().join(slot, worker);
}
bool record_step(int64_t slot, std::string worker, int64_t step, int64_t tokens, double loss) {
  server_record().step(slot, worker, step, tokens, loss);
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

}  // namespace

DISTOPTIM_RPC_FUNCTION("rnn_ps.shared_model", shared_model);
DISTOPTIM_RPC_FUNCTION("rnn_ps.join", join);
DISTOPTIM_RPC_FUNCTION("rnn_ps.step", record_step);
DISTOPTIM_RPC_FUNCTION("rnn_ps.kill", record_kill);
DISTOPTIM_RPC_FUNCTION("rnn_ps.finish", record_finish);
DISTOPTIM_RPC_FUNCTION("rnn_ps.held_out_before", record_held_out_before);

void open_trainer_slots(const fs::path& csv, int trainers, double timeout_seconds) {
  server_record().open(csv, trainers, timeout_seconds);
}
void set_shared_model(const RNNModel::Shared& model) { server_record().set_model(model); }
void wait_for_trainers() { server_record().wait_for_trainers(); }
std::string trainer_slots_plot_commands() { return server_record().plot_commands(); }

// On a trainer: the server's shared model (waiting, within a bound, for the server to have
// created it) and where the slot `rank` stands.
SlotStart join_slot(int rank, const std::string& name) {
  SlotStart start;
  const auto deadline = Clock::now() + std::chrono::minutes(2);
  // A trainer started with the server may find the group's store up before the server has
  // entered the group itself; the server, entering, tells it, so it waits to see it listed.
  auto server_listed = [] {
    const auto workers = rpc::get_worker_infos();
    return std::any_of(workers.begin(), workers.end(),
                       [](const rpc::WorkerInfo& worker) { return worker.name == "ps"; });
  };
  while (!server_listed()) {
    if (Clock::now() > deadline) {
      throw std::runtime_error("the server 'ps' has not entered the group within 2 minutes");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (;;) {
    auto model =
        rpc::rpc_sync<std::optional<RNNModel::Shared>>("ps", "rnn_ps.shared_model", std::tuple{});
    if (model) {
      start.model = std::move(*model);
      break;
    }
    if (Clock::now() > deadline) {
      throw std::runtime_error("the server 'ps' has not created the shared model within 2 minutes");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::tie(start.steps, start.tokens, start.seconds, start.held_out_before) =
      rpc::rpc_sync<std::tuple<int64_t, int64_t, double, double>>(
          "ps", "rnn_ps.join", std::tuple{static_cast<int64_t>(rank), name});
  return start;
}

void report_step(int rank, const std::string& name, int64_t step, int64_t tokens, double loss) {
  rpc::rpc_sync<bool>("ps", "rnn_ps.step",
                      std::tuple{static_cast<int64_t>(rank), name, step, tokens, loss});
}
void report_kill(int rank, const std::string& name, int64_t step) {
  rpc::rpc_sync<bool>("ps", "rnn_ps.kill", std::tuple{static_cast<int64_t>(rank), name, step});
}
void report_finish(int rank, const std::string& name) {
  rpc::rpc_sync<bool>("ps", "rnn_ps.finish", std::tuple{static_cast<int64_t>(rank), name});
}
void report_held_out_before(double value) {
  rpc::rpc_sync<bool>("ps", "rnn_ps.held_out_before", std::tuple{value});
}

}  // namespace rnn_ps
