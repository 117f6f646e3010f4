#pragma once

// Snapshots of what trainers update on parameter servers, written and read by the servers
// themselves: every parameter of a DistributedOptimizer (a ShardedEmbeddingBag's shards, a
// RemoteModule's parameters, any RRef-held tensor) and the optimizer's state of each, each
// owner writing its own parameters and all owners at once, so that no process ever holds more
// than its own parameters. PyTorch has no equivalent (its DistributedOptimizer has no state dict).
//
//   dist_optim::DistributedOptimizer optimizer(
//       "adagrad", {{table.remote_parameters(), ...}, {mlp->remote_parameters(), ...}});
//   dist_optim::SnapshotSchedule snapshots(
//       dist_optim::SnapshotOptions("ckpt/job").every_steps(500), optimizer, {&table});
//   for (...) {
//     ...  // forward, dist_autograd::backward, optimizer.step(context)
//     snapshots.step();   // begins one every 500 steps; trainers go on while it is written
//   }
//   snapshots.flush();
//   ...
//   // Another run, on any number of servers for the table:
//   std::optional<int64_t> step = dist_optim::load_latest_snapshot("ckpt/job", optimizer,
//   {&table});
//
// Layout of one snapshot directory: manifest.pt (the optimizer's name; the worker whose
// optimizer wrote it, whose state it holds: a recovery by another trainer takes the values alone,
// recovery.h; per table its size, dtype, row ranges, and per shard its optimizer state's step
// count, buffer names and blocks; per other parameter its state's summary and its file), per
// table shard
// table-T.shard-S-of-N.block-B.pt files of at most `rows_per_file` rows (64 MiB of rows by
// default), and per owner of other parameters params-K.pt. All are LibTorch pickles of dicts
// (Python's torch.load reads them), written atomically and checked on load as every checkpoint
// file of the library is (headers, every record's CRC-32); the manifest is removed first and
// written last: a directory without one is no snapshot. A SnapshotSchedule writes each snapshot
// into DIR/step-N (N zero-padded to 12 digits) and removes the oldest beyond keep_last;
// latest_snapshot is the newest of them with a manifest. The directory must be one path that every
// owner reaches (one host, or a shared file system); a relative path is made absolute in the
// calling process.
//
// What one snapshot is: each owner copies its parameters and their state under its update lock (no
// step of any optimizer is half in the copy; a copy at memory speed, the only time steps wait for a
// snapshot; it takes each file record's CRC-32 on the way, from the cache) and writes the copy
// holding no lock, while steps go on: streamed from the copy's memory to the files, by one thread
// per call of low CPU priority (nice 10) kept to one CPU, 4 MiB at a time with one write in
// flight, as a dd probe of the disk writes, so that the writing yields to the steps the owner
// serves (the CPU, and the memory bus the disk's DMA shares with them); SnapshotOptions::disk_share
// slows it further. An owner keeps the copy's memory for its next snapshot (its
// parameters' and state's size again, which every snapshot needs at its peak). A SnapshotSchedule
// has every owner map that memory when it is made (at the same low priority; a save_snapshot with
// none made before maps it itself, before its copy), so that the first snapshot writes as fast as
// the later ones: fresh memory costs a kernel far more than a copy, and on some virtual machines as
// much as the write. A collisionless table's copy is of its live rows, made at each snapshot. Every
// step of `optimizer` that returned before the snapshot began is in it, on every server, and none
// that began after: a consistent cut of this trainer's steps. Beginning a snapshot first waits for
// the optimizer's outstanding steps (max_staleness > 0), then for every owner's copy (each owner
// answers once its copy is taken and writes on; the trainer's next step comes after that), not
// for the files. Steps of other trainers' optimizers over the same parameters that run meanwhile
// may be in one server's copy and not another's (a cut per server, as Monolith's per-server
// snapshots); their optimizers' own state is in their own snapshots.
//
// Loading: every owner reads and checks what it will hold (a table shard reads only the blocks
// that overlap its rows, one at a time; another parameter reads its old owner's file), and keeps
// it; only when every owner has, does each load it: a failure before that changes nothing. A
// table loads into any number of shards; its shards' step counts must then agree (their rows
// would share one count, which Adagrad's lr_decay and SparseAdam's bias correction read). Other
// parameters are matched by their order among the optimizer's parameters that are not a
// table's, so they may move to other owners. Options and param groups are the loading
// optimizer's own.
//
// Collisionless tables (rpc::ShardedIdEmbeddingBag), given as `id_tables`: each shard's owner
// writes its live rows with their ids, their rows of the optimizer's state and its step count as
// idtable-T.shard-S-of-N.block-B.pt blocks (format, version, shard, ids, rows and the state's
// fields as a table block's), copied while no id gains or loses a row; a row handed to a new id
// since the last step is saved with a new parameter's state, as that step would start it. A load
// drops every row of the loading shards and gives each saved id a row on the shard that holds it
// there (ShardedIdEmbeddingBag::shard_of), with its value and state rows: onto as many shards each
// reads its own blocks, onto another number every block (one at a time), keeping its ids; a shard
// that would receive more ids than its capacity refuses (nothing changes). Not saved: ids counted
// towards admission, rows' last lookups (a loaded row counts as looked up at the load), counters.
// A collisionless table's shards given as other parameters would be saved without their ids.
//
// Thread safety: a save, a load and a schedule's calls must not overlap a step of `optimizer`
// or another load of the same parameters.

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/arg.h>

#include <distoptim/dist_optim/distributed_optimizer.h>
#include <distoptim/rpc/id_embedding_bag.h>
#include <distoptim/rpc/sharded_embedding_bag.h>

namespace distoptim {
namespace dist_optim {

/// Writes a snapshot of `optimizer`'s parameters and state into `directory` (created if
/// needed), each parameter by its owner. `tables`: the ShardedEmbeddingBags whose shards are
/// among the parameters (saved in blocks, reshardable); every other parameter is saved whole.
/// `rows_per_file`: a table block's rows (0: 64 MiB of them). `id_tables`: the collisionless
/// tables whose shards are among the parameters (saved by id, see above). Errors:
/// c10::ValueError for a table whose shard is not a parameter of `optimizer`, a table given
/// twice, or a negative rows_per_file, before anything is written; c10::Error naming a directory
/// that cannot be made; an owner's failure (a file it could not write) as RemoteError naming the
/// owner and the file, PeerLostError naming a lost owner, after every owner has answered (no
/// manifest then).
void save_snapshot(const std::string& directory, DistributedOptimizer& optimizer,
                   const std::vector<const rpc::ShardedEmbeddingBag*>& tables = {},
                   int64_t rows_per_file = 0,
                   const std::vector<const rpc::ShardedIdEmbeddingBag*>& id_tables = {});

/// Loads the snapshot in `directory` into `optimizer`'s parameters and state. `tables` and
/// `id_tables` as for save_snapshot, as many and in the same order as when it was saved (each of
/// the same size (a fixed table), dim and dtype, on any number of shards). Errors, before anything
/// changes: c10::Error / c10::ValueError naming the manifest and the field for a missing, damaged
/// or foreign manifest, another optimizer, other tables, another number of other parameters, or
/// shards with different step counts loaded into another split; RemoteError naming the owner and
/// the file for a block or parameter file that is missing, damaged, or does not hold what the
/// manifest says (a parameter of another shape included). Then every owner loads what it read; a
/// failure then (RemoteError or PeerLostError naming the owner) may leave some parameters loaded.
void load_snapshot(const std::string& directory, DistributedOptimizer& optimizer,
                   const std::vector<rpc::ShardedEmbeddingBag*>& tables = {},
                   const std::vector<const rpc::ShardedIdEmbeddingBag*>& id_tables = {});

struct SnapshotOptions {
  /* implicit */ SnapshotOptions(std::string directory) : directory_(std::move(directory)) {}
  /// Where the snapshots go: DIR/step-N per snapshot.
  TORCH_ARG(std::string, directory);
  /// A snapshot every this many steps (0: none by count).
  TORCH_ARG(int64_t, every_steps) = 0;
  /// A snapshot when this long has passed since the last one began (0: none by time).
  TORCH_ARG(std::chrono::milliseconds, every) = std::chrono::milliseconds(0);
  /// Complete snapshots kept; older ones are removed once a newer one is complete (at least 1).
  TORCH_ARG(int64_t, keep_last) = 2;
  /// A table block's rows (0: 64 MiB of them).
  TORCH_ARG(int64_t, rows_per_file) = 0;
  /// The share of the time each owner's writer keeps its disk busy (more than 0, at most 1): below
  /// 1, every write is followed by a rest of (1 / disk_share - 1) times its duration. The steps an
  /// owner serves while it writes slow with its write rate (the disk's DMA and a virtual disk's
  /// host share the memory bus with them): on a 2-core virtual machine, 0.5 took about twice as
  /// long to write a snapshot and left the steps' p99 while it wrote at 1.07-1.28x the steps'
  /// without one, against 1.22-1.60x at 1 (docs/benchmarks.md, snapshot).
  TORCH_ARG(double, disk_share) = 1;
};

/// Takes snapshots of one trainer's DistributedOptimizer on a schedule, in the background: a
/// snapshot is begun by step() when due and finished (its manifest written, old ones removed) by
/// the first step() after every owner has written its files, so the trainer waits for the owners'
/// copies (the step() that begins a snapshot returns once every owner has copied), not for the
/// writing. A snapshot due while another is being written is begun once
/// that one is finished. Steps are counted from `step` (the step a resumed run starts at:
/// load_latest_snapshot's). Not thread-safe: one trainer's loop calls it. The optimizer and
/// tables must outlive it.
class SnapshotSchedule {
 public:
  /// Throws c10::ValueError naming the option for a negative every_steps, every or rows_per_file,
  /// keep_last below 1 or disk_share outside (0, 1], and what save_snapshot throws for the
  /// tables. Then has every owner map and keep the memory its snapshots copy into (the parameters'
  /// and their state's size; a collisionless table's apart) and waits for it, at the owners' low
  /// priority: seconds for gigabytes. An owner that cannot (lost, out of memory) is logged, not
  /// thrown: its first snapshot maps the memory itself, and fails as it would have.
  SnapshotSchedule(SnapshotOptions options, DistributedOptimizer& optimizer,
                   std::vector<const rpc::ShardedEmbeddingBag*> tables = {}, int64_t step = 0,
                   std::vector<const rpc::ShardedIdEmbeddingBag*> id_tables = {});
  /// Waits for a snapshot being written and finishes it; errors are logged, not thrown.
  ~SnapshotSchedule();
  SnapshotSchedule(const SnapshotSchedule&) = delete;
  SnapshotSchedule& operator=(const SnapshotSchedule&) = delete;

  /// Counts one step of the optimizer (call it after each step): finishes the snapshot being
  /// written if its owners are done, and begins one if due. Returns the step of the snapshot it
  /// finished, if any. Errors of a snapshot (as save_snapshot's) are thrown by the step() that
  /// finishes it, or by the one that begins it when an owner fails to copy (the optimizer's
  /// outstanding steps' failures too, as its flush() throws them); that snapshot is then abandoned
  /// (no manifest: never the latest) and the next one is begun when due.
  std::optional<int64_t> step();
  /// Waits for the snapshot being written, if any, and finishes it; returns its step.
  std::optional<int64_t> flush();
  /// Takes a snapshot of the current step now and waits for it (after flush()); returns its step.
  int64_t save_now();
  /// Steps counted so far.
  int64_t steps() const { return step_; }
  /// The step of the snapshot being written (begun, not yet finished), if any.
  std::optional<int64_t> writing() const;
  /// The bytes each owner (by worker name) kept for the snapshots' copies when the schedule was
  /// made; an owner that failed to is missing.
  const std::map<std::string, int64_t>& reserved_bytes() const { return reserved_bytes_; }

 private:
  struct Pending;
  void begin();
  std::optional<int64_t> finish();

  SnapshotOptions options_;
  DistributedOptimizer& optimizer_;
  std::vector<const rpc::ShardedEmbeddingBag*> tables_;
  std::vector<const rpc::ShardedIdEmbeddingBag*> id_tables_;
  int64_t step_;
  int64_t last_begun_step_;
  std::chrono::steady_clock::time_point last_begun_;
  std::unique_ptr<Pending> pending_;
  std::map<std::string, int64_t> reserved_bytes_;
};

/// The newest complete snapshot (one with its manifest) a SnapshotSchedule wrote into
/// `directory`: its step and path, or nullopt when there is none (or no such directory). Its
/// files are checked when it is loaded.
struct SnapshotInfo {
  int64_t step = 0;
  std::string path;
};
std::optional<SnapshotInfo> latest_snapshot(const std::string& directory);

/// load_snapshot of latest_snapshot(directory); returns its step, or nullopt (changing nothing)
/// when there is none.
std::optional<int64_t> load_latest_snapshot(
    const std::string& directory, DistributedOptimizer& optimizer,
    const std::vector<rpc::ShardedEmbeddingBag*>& tables = {},
    const std::vector<const rpc::ShardedIdEmbeddingBag*>& id_tables = {});

}  // namespace dist_optim
}  // namespace distoptim
