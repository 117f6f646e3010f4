#pragma once

// Checkpoints of an embedding table split over parameter servers (rpc::ShardedEmbeddingBag) and of
// the DistributedOptimizer that trains it, written by the shards' owners, that load into the table
// split over another number of shards (TorchRec's resharding on load):
//
//   save_sharded_table("ckpt/step-1000", table, optimizer);   // 3 shards
//   ...
//   rpc::ShardedEmbeddingBag table(options.workers({"ps0", "ps1"}));
//   DistributedOptimizer optimizer("adagrad", table.remote_parameters(), options);
//   load_sharded_table("ckpt/step-1000", table, optimizer);   // 2 shards, same trajectory
//
// Each shard's owner writes and reads its own rows, all owners at once: no process holds more
// than its own shard (the caller holds only the manifest), so the tables the sharding exists for,
// larger than any one process, can be checkpointed.
//
// Layout: DIR/manifest.pt (the table's size, dtype and optimizer, each shard's row range, and of
// each shard its optimizer state's step count and buffer names and its blocks) and, per shard,
// DIR/shard-S-of-N.block-B.pt: blocks of at most `rows_per_file` rows (by default 64 MiB of
// them), each with its rows and the optimizer's state buffers for those rows. Zip archives as
// LibTorch's serialization writes them (torch::pickle_save of a dict; Python's torch.load reads
// them), each written atomically and checked on load as every checkpoint file of the library is
// (headers, every record's CRC-32). The manifest is removed first and written last: a directory
// without one is no checkpoint, so save each checkpoint into a directory of its own to keep the
// last one while the next is written. DIR must be one path that every owner reaches (the same
// host, or a shared file system); a relative one is made absolute in the calling process.
//
// Loading into another split, each owner reads only the blocks that overlap the rows it will own
// (its rows and at most a block beyond each end), one block at a time.
//
// What reshards: the rows and every state buffer that has a row per table row (Adagrad's sum,
// SparseAdam's and Adam's moments, SGD's momentum). A step count is per shard: a checkpoint whose
// shards counted different numbers of steps, or of which some shards have optimizer state and
// others none (a shard that got no gradient some step) does not load into another number of
// shards, since their rows would then share one count (Adagrad's lr_decay and SparseAdam's bias
// correction read it); it still loads into the same number of shards.
//
// What one save is: each shard's rows and state as they were at one point between steps on its
// owner (copied under the owner's update lock, a copy at memory speed; the files are written
// after it, while steps go on). Every step of `optimizer` that returned before the save began is
// in it, on every shard. Steps of other trainers' optimizers over the same table that run during
// the save may be in one shard's copy and not in another's (a cut per shard, as Monolith's
// per-server snapshots).
//
// Options and param groups are the optimizer's own: the loading one keeps its.
//
// Thread safety: neither may overlap a step of `optimizer` or another save or load of the table.

#include <cstdint>
#include <string>

#include <distoptim/dist_optim/distributed_optimizer.h>
#include <distoptim/rpc/sharded_embedding_bag.h>

namespace distoptim {
namespace dist_optim {

/// Writes `table`'s rows and `optimizer`'s state of them to `directory` (created if needed),
/// each shard by its owner, in blocks of at most `rows_per_file` rows (0: 64 MiB of rows).
/// `optimizer` must be one built over `table.remote_parameters()` (in any param groups, nothing
/// else). Errors: c10::ValueError naming the mismatch for another optimizer or a negative
/// rows_per_file, before anything is written; c10::Error naming a directory that cannot be
/// made; an owner's failure (a file it could not write) as RemoteError naming the owner and the
/// file, and PeerLostError naming a lost owner, after every owner has answered (files already
/// written stay, the manifest is not written).
void save_sharded_table(const std::string& directory, const rpc::ShardedEmbeddingBag& table,
                        DistributedOptimizer& optimizer, int64_t rows_per_file = 0);

/// Loads the checkpoint in `directory` into `table` and `optimizer` (built as for save), whatever
/// the number of shards of either. Every file is read and checked, each by the owner that needs
/// it, before anything changes: c10::Error (the manifest, read here) or RemoteError naming the
/// owner (a block, read there) naming the file, for a missing, damaged or foreign one, and naming
/// the file and the field for a table of another size, dim or dtype, another optimizer, a block
/// whose rows, buffers or step do not match the manifest, or step counts that differ between
/// shards when resharding. Then every owner loads its rows and their state; a failure of an owner
/// then (RemoteError or PeerLostError naming it) may leave some shards loaded.
void load_sharded_table(const std::string& directory, rpc::ShardedEmbeddingBag& table,
                        DistributedOptimizer& optimizer);

}  // namespace dist_optim
}  // namespace distoptim
