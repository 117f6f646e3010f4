#pragma once

// Checkpoints of data-parallel training, to resume after a crash (say under
// `distrun --max-restarts`): the model's parameters and buffers, a ZeroRedundancyOptimizer's
// state, a model averager's step and where the data stands.
//
// Layout: a checkpoint is a directory `DIR/epoch-E-step-S/` holding one file per rank of the
// group, `rank-R-of-W.pt` (R its rank in the group, W the group's size). Each file is a zip
// archive as LibTorch's serialization writes it (torch::pickle_save of a dict; Python's
// torch.load reads it) with that rank's parameters and buffers, averager step and position,
// and, in rank 0's file only, the ZeroRedundancyOptimizer's state consolidated from every
// rank. A checkpoint is complete when all W files are there and each passes the checks of
// optim::load_state_dict_file (every record's CRC-32); latest_checkpoint picks the newest
// complete one, prune_checkpoints removes the old ones. DIR must be the same directory for every
// rank (on several hosts: a shared file system), as every rank reads rank 0's file when it loads.
//
// Atomicity: each file is written to a temporary file beside it, fsynced and renamed over its
// name, so a crash while saving leaves either no file of that name or a whole one; a checkpoint
// with a file missing is incomplete and never picked.

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include <torch/nn/module.h>

#include <distoptim/comm/process_group.h>
#include <distoptim/data_parallel/model_averaging.h>
#include <distoptim/data_parallel/power_sgd_hook.h>
#include <distoptim/data_parallel/zero_redundancy_optimizer.h>

namespace distoptim {
namespace data_parallel {

/// Where training stands, saved by each rank and returned to it by load_checkpoint.
struct TrainingPosition {
  /// Checkpoints are ordered by (epoch, step): `step` may count the steps of the epoch or of
  /// the whole run. Both must be non-negative.
  int64_t epoch = 0;
  int64_t step = 0;
  /// Values of the user's, by name (a data loader's offset, a seed, ...); each rank its own.
  std::map<std::string, int64_t> values;
};

/// What a checkpoint holds besides the position. Each may be null (not saved; loading a
/// checkpoint that holds it then ignores it).
struct CheckpointItems {
  /// Its parameters and buffers, by their names (recursively). For a DistributedDataParallel,
  /// its module().
  torch::nn::Module* module = nullptr;
  /// Its whole state (it must use one of distoptim's optimizers), consolidated on rank 0 of the
  /// group; every rank loads it back. Its process group must be the checkpoint's group.
  ZeroRedundancyOptimizer* zero = nullptr;
  /// Its step (for a PostLocalSGDOptimizer: &optimizer.averager()).
  ModelAverager* averager = nullptr;
  /// The PowerSGD hooks' state (PowerSGDState::state_dict: iteration, random generator, error
  /// feedback and warm-start factors), each rank's own, so that compressed training resumes as if
  /// never stopped. Its options must be the saved ones.
  PowerSGDState* power_sgd = nullptr;
};

/// The directory of the checkpoint at `position` in `directory`: `directory/epoch-E-step-S`.
std::string checkpoint_path(const std::string& directory, const TrainingPosition& position);

/// Saves `items` and `position` as the checkpoint checkpoint_path(directory, position) and
/// returns its path. Collective over `group` (every rank calls it with the same epoch and step):
/// consolidates the ZeroRedundancyOptimizer's state on rank 0, then each rank writes its file
/// atomically (creating the directories as needed), then the ranks exchange whether their write
/// succeeded and on the epoch and step. When it returns on any rank, the checkpoint is complete.
/// Errors: a negative epoch or step throws c10::ValueError naming it before anything is done; a
/// rank whose write failed makes every rank throw the same c10::ValueError `save_checkpoint:
/// rank R cannot write its file: save_checkpoint: cannot save 'PATH': ...; the checkpoint is
/// incomplete (latest_checkpoint skips it)`, and ranks passing different epochs or steps the
/// same with `ranks disagree on the epoch and step: rank 1 differs from rank 0 ...`; a rank
/// that never calls it makes the others throw distoptim::DistributedError after the group's
/// timeout.
std::string save_checkpoint(const std::string& directory, const TrainingPosition& position,
                            const CheckpointItems& items, const comm::Group& group);

/// The newest complete checkpoint in `directory` (by epoch, then step), or nullopt when there
/// is none (or no such directory). Local (not collective); reads every file of the checkpoints
/// it looks at, newest first, until one is complete: incomplete ones (a file missing, damaged or
/// left half-written by a crash) are skipped.
std::optional<std::string> latest_checkpoint(const std::string& directory);

/// Removes the checkpoints in `directory` older than its `keep` newest complete ones (complete
/// or not; newer incomplete ones stay, as a save may be under way) and returns how many it
/// removed. Local: call it on one rank (say rank 0, after save_checkpoint returned), on a
/// directory no load is reading. c10::ValueError for keep < 1; std::filesystem's error when a
/// checkpoint cannot be removed.
int prune_checkpoints(const std::string& directory, int keep);

/// Loads the checkpoint at `path` (a directory that save_checkpoint wrote) into `items` and
/// returns this rank's position. Collective over `group`: each rank reads and checks its own
/// file and rank 0's (format, its rank and the group's size, the module's parameter and buffer
/// names, shapes and dtypes, the items asked for), then the ranks exchange their results, and
/// only when every rank's checks passed and all read the same rank 0 file (SHA-256) does any
/// rank change anything. Otherwise every rank throws the same c10::ValueError, naming each
/// rank that failed with its reason and the file, e.g.
///   load_checkpoint: rank 1 cannot load the checkpoint: 'DIR/epoch-0-step-8/rank-1-of-2.pt'
///   is corrupted: ...; nothing was loaded on any rank
/// and nothing changes on any rank. The ZeroRedundancyOptimizer's state is loaded first (as
/// its load_state_dict, collective), then the parameters, buffers and averager step.
TrainingPosition load_checkpoint(const std::string& path, const CheckpointItems& items,
                                 const comm::Group& group);

}  // namespace data_parallel
}  // namespace distoptim
