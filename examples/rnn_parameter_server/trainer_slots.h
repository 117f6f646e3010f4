#pragma once

// examples/rnn_parameter_server --elastic: trainers that die, are restarted and rejoin.
//
// The server starts a dynamic RPC group and holds one model that every trainer trains, LSTM
// weights included (RNNModel::create_shared), so the model outlives any trainer. A trainer slot
// is a trainer's rank under distrun; the worker filling it joins under a name of its own
// ("trainer2", then "trainer2-restart1" once distrun's --restart-policy rank has restarted it: a
// dead member's rank stays used, and its name frees only once the server has dropped it). The
// server keeps each slot's progress, so a worker joining a slot continues where the slot stood: its
// step count, its place in its share of the corpus and its time budget. It logs every join, step,
// announced kill and finish to <out-dir>/loss.csv, and stops once every slot has finished.
//
// The server's side (one record per process, guarded by one mutex, shared by the RPC handlers and
// the server's main thread) and the trainers' side (calls to the server "ps").

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>

#include "rnn_model.h"

namespace rnn_ps {

/// A slot's progress as a joining worker gets it.
struct SlotStart {
  RNNModel::Shared model;
  int64_t steps = 0;
  int64_t tokens = 0;
  double seconds = 0;            // since the slot's first join: the time budget counts the gaps too
  double held_out_before = NAN;  // the first reporter's held-out loss before any step
};

// --- On the server -----------------------------------------------------------------------------

/// Opens the record of `trainers` slots (ranks 1..trainers) and its log `csv`; before init_rpc.
void open_trainer_slots(const std::filesystem::path& csv, int trainers, double timeout_seconds);
/// The shared model the trainers get (RNNModel::create_shared's result).
void set_shared_model(const RNNModel::Shared& model);
/// Returns once every slot has finished; throws naming a slot that has shown no sign of life (a
/// join or a step) for `timeout_seconds`: its trainer died and was not restarted, or hangs.
void wait_for_trainers();
/// The gnuplot commands that draw every worker's losses, one curve each, in order of joins.
std::string trainer_slots_plot_commands();

// --- On a trainer ------------------------------------------------------------------------------

/// Waits (within 2 minutes) for the server to be listed and to have the shared model, then joins
/// slot `rank` as worker `name`: the model and where the slot stands.
SlotStart join_slot(int rank, const std::string& name);
/// Tells the server of a step, of the kill --kill-trainer-at injects, of the slot's end, of the
/// held-out loss before training. Each blocks for the server's answer.
void report_step(int rank, const std::string& name, int64_t step, int64_t tokens, double loss);
void report_kill(int rank, const std::string& name, int64_t step);
void report_finish(int rank, const std::string& name);
void report_held_out_before(double value);

}  // namespace rnn_ps
