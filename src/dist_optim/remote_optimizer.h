#pragma once

// The part of a DistributedOptimizer that lives on a parameters' owner: a functional optimizer
// over the owner's own tensors. Created by remote() under a reserved class name.

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include <distoptim/optim/functional_optimizer.h>
#include <distoptim/rpc/detail/reassigned_rows.h>
#include <distoptim/rpc/id_embedding_bag.h>
#include <distoptim/rpc/rref.h>

#include "snapshot_files.h"
#include "snapshot_writes.h"
#include "step_mirror.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

constexpr const char* kRemoteOptimizerClass = "__distoptim.dist_optim.RemoteOptimizer";

class RemoteOptimizer {
 public:
  /// `groups`: this worker's parameters of each group of the DistributedOptimizer (possibly
  /// none), as references to this worker's values; `options` is an OptionBag's to_ivalue(),
  /// `overrides` one per group. Throws what the registry or the optimizer throws for a bad name
  /// or option.
  RemoteOptimizer(std::string optimizer, std::vector<std::vector<rpc::RRef<at::Tensor>>> groups,
                  c10::IValue options, std::vector<c10::IValue> overrides);

  /// A step with the gradients of this worker's copy of context `context_id`, under this
  /// optimizer's mutex and one rpc::InPlaceRowUpdateGuard on what it writes: the rows its sparse
  /// gradients name where their update is row-local (FunctionalOptimizer::
  /// updates_only_gradient_rows), every other parameter with a gradient whole. Other optimizers
  /// (another trainer's over the same table and layers) step other rows and parameters meanwhile.
  /// `changes`: None, or one OptionBag (to_ivalue()) per group, set on that group
  /// (set_group_options) before the step. All or nothing: the gradients are read first, under the
  /// mutex; a released context (its trainer was lost) throws c10::ValueError with nothing changed,
  /// options included.
  void step(int64_t context_id, c10::IValue changes);
  /// From the next step on, each step sends what it changed (its parameters' rows or whole
  /// parameters, and this optimizer's state of them) to worker `backup`'s copies before it
  /// returns (replicas.h). `param_keys`: the key of each parameter's copy, in this optimizer's
  /// order; `state_owner`: the trainer whose optimizer this is. c10::ValueError, changing nothing,
  /// for a count of keys other than of parameters, an empty key, or `backup` naming this worker.
  /// Every parameter, and the state it has, is sent whole at once (what the backup cannot take
  /// fails the call, leaving no replication), and again before the next step whenever the backup is
  /// a new incarnation or a send failed. `restored_from_it`: this optimizer's parameters and state
  /// were just loaded from the backup's copies (stage_from_backup), which every step since went to:
  /// they are taken as sent whole, and nothing is sent.
  /// `continue_without_backup` (ReplicaOptions::continue_without_backup): while the backup is
  /// lost (no member of its name, or a send to it failed as lost), steps go on here, not copied;
  /// its next incarnation gets everything whole before the next step.
  void set_backup(std::string backup, std::vector<std::string> param_keys, std::string state_owner,
                  bool restored_from_it, bool continue_without_backup);
  /// Reads parameter `index` and trainer `state_owner`'s state of it from worker `backup`'s
  /// copies of worker `primary`'s (empty: this worker's; under `param_key`, replicas.h), for
  /// commit_staged (`with_value`) or commit_staged_state (the state alone is read then). `backup`
  /// may be this worker (it takes over a lost
  /// primary's parameters). c10::ValueError naming the key when the backup holds no copy of
  /// the parameter or one of another shape; what the calls to the backup throw.
  void stage_from_backup(int64_t index, std::string backup, std::string primary,
                         std::string param_key, std::string state_owner, bool with_value);
  /// Takes the state of parameters `from_indices` of `from` (an optimizer on this worker, which
  /// steps no more: DistributedOptimizer::rebind merged its parameters into this one) as the
  /// state of this optimizer's parameters `to_indices`. c10::ValueError for another worker's
  /// optimizer or an index out of range, changing nothing.
  void take_state(rpc::RRef<RemoteOptimizer> from, std::vector<int64_t> from_indices,
                  std::vector<int64_t> to_indices);
  /// OptimizerStateDict::to_ivalue() of the optimizer, and its inverse.
  c10::IValue state_dict();
  void load_state_dict(c10::IValue state);

  // The owner's side of a snapshot (snapshot.h). A copy is taken under this optimizer's mutex
  // and an rpc::InPlaceUpdateGuard, so that no optimizer's step is half in it (the parameters
  // at one point between steps), and written to files holding no lock, so steps go on while
  // they are written. Each save_* call answers once its copy is taken, with a ticket; the write
  // goes on (snapshot_writes.h), and snapshot_written(ticket) answers once it is done, with what
  // the manifest says of it. A load reads and checks its files first, changing nothing, and keeps
  // what it read for commit_staged. Errors: c10::ValueError naming a parameter index this
  // optimizer does not have; what snapshot_files.h's functions throw, naming the file (from
  // snapshot_written when a write fails).

  /// The index of the parameter `param` (a reference owned here) among this optimizer's, or -1.
  int64_t index_of(rpc::RRef<at::Tensor> param);
  /// Maps the memory a snapshot copies the parameters `indices` and their state into, and keeps
  /// it for the first snapshot (SnapshotSchedule, before any is due), so that the first copies
  /// and writes as fast as the later ones; at low priority. Returns the bytes kept for these
  /// parameters. c10::ValueError naming an index this optimizer does not have, changing nothing.
  int64_t reserve_copies(std::vector<int64_t> indices);
  /// Writes parameter `index`, shard `shard` of `shards` of a table whose first row is the
  /// table's `first_row`, and its state, as blocks of at most `rows_per_file` rows named after
  /// `prefix`. Its write's result: a dict: has_state, step, buffers (names) and blocks (each
  /// block's first row, then the shard's end). Every save_* writes keeping the disk busy at most
  /// `disk_share` of the time (SnapshotOptions::disk_share; SnapshotWrites::check_disk_share's
  /// error, before anything is copied).
  int64_t save_table_rows(std::string prefix, int64_t index, int64_t shard, int64_t shards,
                          int64_t first_row, int64_t rows_per_file, double disk_share);
  /// Writes the parameters `indices` (named in the file by `dense_indices`) and their state to
  /// the file `path`, copied at one point. Its write's result: one dict per parameter:
  /// has_state, step and buffers.
  int64_t save_params(std::string path, std::vector<int64_t> indices,
                      std::vector<int64_t> dense_indices, double disk_share);
  /// The future of the write that a save_* call answered `ticket` for: its result once its files
  /// are written (async: no request thread waits for it). SnapshotWrites::claim's errors.
  c10::intrusive_ptr<c10::ivalue::Future> snapshot_written(int64_t ticket);
  /// Reads parameter `index`'s rows (the table's rows from `first_row` on, as many as the
  /// parameter has) and their state from `blocks`, a list of [path, shard, first_row, end_row]
  /// in row order, each block holding the state `state` (a dict: has_state, step, buffers) says.
  void stage_table_rows(int64_t index, int64_t first_row, c10::IValue blocks, c10::IValue state);
  /// Reads parameter `index` from the entry of dense index `dense_index` of the file `path`,
  /// holding `state`.
  void stage_param(int64_t index, std::string path, int64_t dense_index, c10::IValue state);
  /// Loads what was staged for `index` into the parameter (under the same locks as a dense step)
  /// and its state; c10::ValueError when nothing is staged for it.
  void commit_staged(int64_t index);
  /// The same for the optimizer's state alone: the parameter keeps its value (a trainer's own
  /// state loaded over a parameter another trainer's snapshot restored).
  void commit_staged_state(int64_t index);
  /// The same for the value alone: the optimizer's state there stays (a snapshot another
  /// trainer's optimizer wrote, whose state is not this one's).
  void commit_staged_value(int64_t index);
  /// Forgets what was staged for `index`, if anything.
  void drop_staged(int64_t index);

  // Collisionless tables (rpc::IdEmbeddingShard) in snapshots: remote_optimizer_id_tables.cpp.
  // `table` is the shard (held here) whose weight is parameter `index`; c10::ValueError when it
  // is another worker's or its weight is not that parameter.

  /// Writes the shard's live rows with their ids and their rows of the optimizer's state, copied
  /// while no id gains or loses a row and no step runs, as blocks of at most `rows_per_file` rows
  /// named after `prefix` (shard `shard` of `shards`). Rows handed to new ids since the last step
  /// are saved with a new parameter's state, as the next step would start them. Returns a dict:
  /// has_state, step, buffers (names) and blocks (each block's rows), as its write's result.
  int64_t save_id_rows(std::string prefix, int64_t index, rpc::RRef<rpc::IdEmbeddingShard> table,
                       int64_t shard, int64_t shards, int64_t rows_per_file, double disk_share);
  /// Reads from the blocks `paths` the rows of the ids that shard `shard` of `shards` holds
  /// (ShardedIdEmbeddingBag::shard_of), with the state `state` (has_state, step, buffers) says,
  /// for commit_staged. c10::ValueError when they are more than the shard's capacity.
  void stage_id_rows(int64_t index, rpc::RRef<rpc::IdEmbeddingShard> table, int64_t shard,
                     int64_t shards, std::vector<std::string> paths, c10::IValue state);

 private:
  /// Parameter `index`, checked to be one of this optimizer (and 2-D when `table`).
  const at::Tensor& param(int64_t index, const char* caller, bool table) const;
  /// Memory for copies of the parameters `indices` and their state buffers, shaped as they are
  /// now and written once, so that the copy under the locks moves bytes only: the last snapshot's
  /// (kept_copies_) where it still fits, else new, made at low priority. Takes mutex_.
  std::vector<ParamCopy> copy_targets(const std::vector<int64_t>& indices);
  /// Keeps the memory of `copies` (of the parameters `indices`) for the next snapshot's
  /// copy_targets. Takes mutex_.
  void keep_copies(const std::vector<int64_t>& indices, std::vector<ParamCopy> copies);
  /// Copies parameter `index` and its state into `into` (into copy_targets' memory where it
  /// fits); under mutex_ and an InPlaceUpdateGuard. With `piece_rows`, `into.value` must already
  /// be shaped as the parameter (a writer reads it meanwhile): the rows are copied `piece_rows` at
  /// a time, value and buffers, `copied` (when given) advanced after each piece with the CRC-32s
  /// taken of it (after the whole copy without `piece_rows`).
  void copy_param(int64_t index, ParamCopy& into, int64_t piece_rows = 0,
                  RowsCopied* copied = nullptr) const;
  /// Keeps `copy` for commit_staged(index).
  void stage(int64_t index, ParamCopy copy);
  /// The shard `table` refers to, checked to be here with parameter `index` as its weight.
  std::shared_ptr<rpc::IdEmbeddingShard> id_table(int64_t index,
                                                  const rpc::RRef<rpc::IdEmbeddingShard>& table,
                                                  const char* caller);
  /// Commits staged rows of a collisionless table (`copy.ids`) into parameter `index`: the
  /// shard's rows replaced by the ids', their values and state rows loaded. Under mutex_.
  void commit_id_rows(int64_t index, ParamCopy& copy);
  /// Commits the staged state rows of a collisionless table alone into parameter `index`'s
  /// state: each id's state rows where the id holds a row now, every other row's state anew (the
  /// rows themselves unchanged). Under mutex_.
  void commit_id_state(int64_t index, const ParamCopy& copy);
  /// Parameter `index`'s state as a new parameter's at every row, with `copy`'s step count (none
  /// when `copy` holds no state). Under mutex_.
  void load_id_state_anew(int64_t index, const ParamCopy& copy);
  /// Writes `copy`'s state rows (those at positions `of`, all when undefined) at `rows` of
  /// parameter `index`'s state; nothing when `copy` holds no state. Under mutex_.
  void write_id_state_rows(int64_t index, const ParamCopy& copy, const at::Tensor& rows,
                           const at::Tensor& of);
  /// Resets parameter `index`'s state at the rows handed to new ids since this optimizer last
  /// looked (rpc/detail/reassigned_rows.h). Under mutex_.
  void reset_reassigned_rows(int64_t index);
  /// commit_staged (both), commit_staged_state (`with_state` alone) or commit_staged_value
  /// (`with_value` alone).
  void commit(int64_t index, bool with_value, bool with_state = true);
  /// Before a step: whether it is copied to `link`'s backup. Sends everything whole first when
  /// the backup is not in sync; with continue_without_backup, false while the backup is lost
  /// (then the step goes on, not copied). Under mutex_.
  bool backup_ready(MirrorLink& link);
  /// Sends every parameter and its state whole to `link`'s backup, under an
  /// rpc::InPlaceUpdateGuard; under mutex_. Its failure changes nothing here.
  void send_everything_whole(MirrorLink& link);
  /// Every copy `link` keeps of this optimizer (each parameter, each state buffer it has, each
  /// step count), whole: with their values (copies), or the keys alone. Under mutex_.
  std::vector<MirrorUpdate> everything_whole(const MirrorLink& link, bool with_values) const;
  /// Sends what the step with `gradients` changed: the rows `rows[i]` of parameter i (and of its
  /// state), or, where `rows[i]` is undefined, the whole parameter and state. Under mutex_ and the
  /// step's guard, so that the copies take each row's updates in the order the parameters did. A
  /// failed send throws (the step stays applied here) and makes the next step send everything
  /// whole.
  void send_to_backup(const std::vector<at::Tensor>& gradients,
                      const std::vector<at::Tensor>& rows);
  /// The rows a step with `gradients` changes of each parameter whose gradient is sparse and
  /// whose update is row-local on its own (FunctionalOptimizer::updates_only_gradient_rows of
  /// that gradient alone): its gradient's row indices; undefined for the others. A table shard
  /// stepped with a dense MLP on the same owner still changes only its gradient's rows.
  std::vector<at::Tensor> row_local_rows(const std::vector<at::Tensor>& gradients) const;

  // Guards optimizer_ (options, state, step counts): its calls must not overlap.
  std::mutex mutex_;
  std::unique_ptr<optim::FunctionalOptimizer> optimizer_;
  // What stage_table_rows and stage_param read, by parameter index, until committed or dropped.
  // Guarded by mutex_.
  std::map<int64_t, ParamCopy> staged_;
  // The collisionless tables whose rows were staged, by parameter index. Guarded by mutex_.
  std::map<int64_t, std::shared_ptr<rpc::IdEmbeddingShard>> staged_id_tables_;
  // The memory of the last snapshot's copies, by parameter index: taken by the next snapshot (a
  // snapshot running meanwhile maps its own). Mapping fresh pages costs far more than writing
  // them on some machines (a virtual machine here mapped 0.13 GB/s), so an owner that snapshots
  // keeps its parameters' size again, which every snapshot needs at its peak anyway. Guarded by
  // mutex_.
  std::map<int64_t, ParamCopy> kept_copies_;
  // Per parameter, the rows of it a collisionless table handed to new ids since this optimizer
  // last reset them (rpc/detail/reassigned_rows.h). Guarded by mutex_.
  std::vector<std::unique_ptr<rpc::detail::ReassignedRowsReader>> reassigned_;
  // Where steps send their changes (set_backup); null: nowhere. Guarded by mutex_.
  std::unique_ptr<MirrorLink> mirror_;
  // Snapshot writes going on after their copies: last, so that they end before the members they
  // use (keep_copies) are destroyed.
  SnapshotWrites snapshot_writes_;
};

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
