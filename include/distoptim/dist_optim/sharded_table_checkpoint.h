#pragma once

// Checkpoints of an embedding table split over parameter servers (rpc::ShardedEmbeddingBag) and of
// the DistributedOptimizer that trains it, one file per shard, that load into the same table split
// over another number of shards (TorchRec's resharding on load):
//
//   save_sharded_table("ckpt/step-1000", table, optimizer);   // 3 shards
//   ...
//   rpc::ShardedEmbeddingBag table(options.workers({"ps0", "ps1"}));
//   DistributedOptimizer optimizer("adagrad", table.remote_parameters(), options);
//   load_sharded_table("ckpt/step-1000", table, optimizer);   // 2 shards, same trajectory
//
// Layout: DIR/manifest.pt (the table's size, dtype and optimizer, and each shard's row range and
// file) and DIR/shard-S-of-N.pt per shard: its rows, the optimizer's state buffers for those rows
// and its step count. Zip archives as LibTorch's serialization writes them (torch::pickle_save of
// a dict; Python's torch.load reads them), each written atomically and checked on load as every
// checkpoint file of the library is (optim::load_state_dict_file: headers, every record's CRC-32).
// The manifest is written last: a directory without one is no checkpoint.
//
// What reshards: the rows and every state buffer that has a row per table row (Adagrad's sum,
// SparseAdam's and Adam's moments, SGD's momentum). A step count is per shard: a checkpoint whose
// shards counted different numbers of steps (a shard that got no gradient some step) does not load
// into another number of shards, since their rows would then share one count (Adagrad's lr_decay
// and SparseAdam's bias correction read it); it still loads into the same number of shards.
//
// The rows pass through the calling process (gathered to save, split to load): a table must fit
// in its memory. Options and param groups are the optimizer's own: the loading one keeps its.
//
// Thread safety: neither may overlap a step of `optimizer` or another load into the table; other
// trainers' steps during a save may or may not be in it (each shard is copied between steps).

#include <string>

#include <distoptim/dist_optim/distributed_optimizer.h>
#include <distoptim/rpc/sharded_embedding_bag.h>

namespace distoptim {
namespace dist_optim {

/// Writes `table`'s rows and `optimizer`'s state of them to `directory` (created if needed).
/// `optimizer` must be one built over `table.remote_parameters()` (in any param groups, nothing
/// else). Errors: c10::ValueError naming the mismatch for another optimizer, before anything is
/// written; c10::Error naming the file that could not be written (files already written stay,
/// the manifest is not written); a shard's failure as RemoteError naming its owner.
void save_sharded_table(const std::string& directory, const rpc::ShardedEmbeddingBag& table,
                        DistributedOptimizer& optimizer);

/// Loads the checkpoint in `directory` into `table` and `optimizer` (built as for save), whatever
/// the number of shards of either. Every file is read and checked before anything changes:
/// c10::Error naming the file for a missing, damaged or foreign one, and naming the file and the
/// field for a table of another size, dim or dtype, another optimizer, a shard whose rows or
/// buffers do not match its range, or step counts that differ between shards when resharding.
/// Then the rows, then the optimizer's state are loaded; a failure of an owner then (RemoteError
/// naming it) may leave some shards loaded.
void load_sharded_table(const std::string& directory, rpc::ShardedEmbeddingBag& table,
                        DistributedOptimizer& optimizer);

}  // namespace dist_optim
}  // namespace distoptim
