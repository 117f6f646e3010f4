#pragma once

// The parameter-server examples' --elastic mode: trainers that die, are restarted and rejoin.
//
// The server (rank 0) starts a dynamic RPC group and holds the model, so the model outlives any
// trainer. A trainer slot is a trainer's rank under distrun; the worker filling it joins under a
// name of its own ("trainer2", then "trainer2-restart1" once distrun's --restart-policy rank has
// restarted it: a dead member's rank stays used, and its name frees only once the server has
// dropped it). The server keeps each slot's progress, so a worker joining a slot continues where
// the slot stood: its step count, its samples and its time budget. It logs every join, step,
// announced kill and finish to a CSV (seconds,event,slot,worker,step,global_step,loss,samples),
// and stops once every slot has finished. The log is the record: a server started again (under
// distrun --restart-policy rank, its membership in etcd) reads it back and goes on, and the
// trainers' calls to it wait for it while it is lost.
//
// The server's side (one record per process, guarded by one mutex, shared by the RPC handlers and
// the server's main thread) and the trainers' side (calls to the server, by name).

#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <distoptim/rpc.h>

namespace CLI {  // NOLINT(readability-identifier-naming): CLI11's own name
class App;
}  // namespace CLI

namespace examples {

/// A slot's progress as a joining worker gets it.
struct SlotStart {
  int64_t steps = 0;
  int64_t samples = 0;           // tokens, samples: what the example counts
  double seconds = 0;            // since the slot's first join: the time budget counts the gaps too
  double held_out_before = NAN;  // the first reporter's held-out loss before any step
  std::string previous_worker;   // the worker this one replaces in the slot ("" for the first)
};

/// What the server's messages and plot say.
struct SlotLog {
  std::string server;      // the server's worker name, which prefixes its messages
  std::string title;       // the plot's title
  std::string loss_label;  // the plot's y axis
};

// --- On the server -----------------------------------------------------------------------------

/// Opens the record of `trainers` slots (ranks first_rank .. first_rank + trainers - 1) and its
/// log `csv`; before init_rpc. A server started again (restart_count() > 0) reads the record back
/// from `csv` and appends to it.
void open_trainer_slots(const std::filesystem::path& csv, int first_rank, int trainers,
                        double timeout_seconds, SlotLog log);
/// The fault --kill-server-at injects on this server: it raises SIGKILL in the step that brings
/// every slot to `steps` steps (the trainers' pace may differ: a total could be reached while one
/// slot has not yet taken a snapshot).
void kill_when_every_slot_reaches(int64_t steps);
/// Returns once every slot has finished; throws naming a slot that has shown no sign of life (a
/// join or a step) for `timeout_seconds`: its trainer died and was not restarted, or hangs.
void wait_for_trainers();
/// The gnuplot commands that draw every worker's losses, one curve each, in order of joins.
std::string trainer_slots_plot_commands();

// --- On any other worker -----------------------------------------------------------------------

/// Waits (within 2 minutes) for worker `server` to be listed in the group.
void wait_until_listed(const std::string& server);
/// Waits (within 2 minutes) until none of `workers` is listed in the group: a server that the
/// others ask whether the slots have finished leaves after them (over etcd nobody else waits).
void wait_until_gone(const std::vector<std::string>& workers);
/// A value a server publishes once (the model it creates, as references) for the others to fetch
/// with fetch_when_ready, through an RPC function that is published<T>:
///   DISTOPTIM_RPC_FUNCTION("example.shared_model", examples::published<Model::References>);
/// One per type and process, never destroyed (handlers may run while the process ends).
template <typename T>
struct Published {
  std::mutex mutex;
  std::optional<T> value;  // guarded by mutex
  static Published& instance() {
    static auto* published = new Published;
    return *published;
  }
};
template <typename T>
void publish(T value) {
  Published<T>& published = Published<T>::instance();
  std::lock_guard<std::mutex> lock(published.mutex);
  published.value = std::move(value);
}
/// Whether every RRef in `value` (through tuples and lists) is owned by the process that now
/// holds its owner's name: false while a server that died is not back and restored.
bool owners_current(const c10::IValue& value);
/// The published value; none while some reference in it names a server's process that died (the
/// trainer that restores the server publishes the value again).
template <typename T>
std::optional<T> published() {
  Published<T>& published = Published<T>::instance();
  std::optional<T> value;
  {
    std::lock_guard<std::mutex> lock(published.mutex);
    value = published.value;
  }
  if (value && !owners_current(distoptim::rpc::to_value(*value))) return std::nullopt;
  return value;
}

/// Waits (within 2 minutes) for `server`'s `function` (no arguments, returning std::optional<T>)
/// to have a value, e.g. the model the server creates once it is up (published<T>: and whose
/// servers are all up); `what` names it in the error.
template <typename T>
T fetch_when_ready(const std::string& server, const std::string& function, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(2);
  for (;;) {
    std::optional<T> value;
    try {
      wait_until_listed(server);
      value = distoptim::rpc::rpc_sync<std::optional<T>>(server, function, std::tuple{});
    } catch (const distoptim::PeerLostError&) {  // lost: asked again once it is back
    } catch (const c10::ValueError&) {           // dropped since it was listed
    }
    if (value) return std::move(*value);
    if (std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error("the server '" + server + "' has not handed out " + what +
                               " within 2 minutes (not created, or a server it lives on not "
                               "back)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}
/// Joins slot `rank` of `server` as worker `name` (once the server is listed): where the slot
/// stands.
SlotStart join_slot(const std::string& server, int rank, const std::string& name);
/// Tells the server of a step, of the kill --kill-trainer-at injects, of the slot's end, of the
/// held-out loss before training. Each blocks for the server's answer; these and the calls below
/// wait (within 2 minutes) for a server that is lost to be back under its name.
void report_step(const std::string& server, int rank, const std::string& name, int64_t step,
                 int64_t samples, double loss);
void report_kill(const std::string& server, int rank, const std::string& name, int64_t step);
void report_finish(const std::string& server, int rank, const std::string& name);
void report_held_out_before(const std::string& server, double value);
/// The steps of every worker the server has recorded so far.
int64_t recorded_steps(const std::string& server);
/// The steps of the slot that has taken fewest.
int64_t fewest_slot_steps(const std::string& server);
/// Waits (within 2 minutes) for the held-out loss before training, which the first trainer
/// measures and reports before the others may step (else "before" would include their steps).
double wait_for_held_out_before(const std::string& server);
/// Whether every slot of the server has finished (for workers that serve until then).
bool trainer_slots_finished(const std::string& server);
/// Waits until every slot of `server` but slot `rank` has finished (a final evaluation of the
/// model all trained, say); throws once no step has been recorded there for `timeout_seconds`.
void wait_for_other_slots(const std::string& server, int rank, double timeout_seconds);

/// The options --elastic (described by `elastic_help`), --kill-trainer-at and --trainer-timeout
/// (both need --elastic) and --kill-trainer (needs --kill-trainer-at: which trainer it kills,
/// counted from 0; -1, the default: the last), into `elastic`, `kill_trainer_at`, `kill_trainer`,
/// `trainer_timeout`.
void add_elastic_options(CLI::App& app, const std::string& elastic_help, bool& elastic,
                         int64_t& kill_trainer_at, int& kill_trainer, double& trainer_timeout);

/// DISTRUN_RESTART_COUNT: how many times distrun has restarted this rank (0 if not set).
int restart_count();

}  // namespace examples
