#pragma once

// A snapshot (snapshot.h) as the calls to the owners that make it: begun (every owner asked to
// copy and write its parameters) and finished (every owner's answer in, the manifest written),
// so that a SnapshotSchedule lets its trainer step in between; and the load.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <distoptim/dist_optim/distributed_optimizer.h>
#include <distoptim/rpc/id_embedding_bag.h>
#include <distoptim/rpc/sharded_embedding_bag.h>

namespace distoptim {
namespace dist_optim {
namespace detail {

class PendingSnapshot {
 public:
  struct Calls;
  explicit PendingSnapshot(std::unique_ptr<Calls> calls);
  PendingSnapshot(PendingSnapshot&&) noexcept;
  PendingSnapshot& operator=(PendingSnapshot&&) noexcept;
  ~PendingSnapshot();

  /// Every owner has answered (written its files, or failed).
  bool written() const;
  /// Waits for every owner's answer, then writes the manifest (with `step`, -1 for none).
  /// Errors: save_snapshot's, naming every owner that failed; no manifest then.
  void finish(std::optional<int64_t> step);

 private:
  std::unique_ptr<Calls> calls_;
};

/// Asks every owner of `optimizer`'s parameters to copy them and write them into `directory`
/// (save_snapshot's arguments). `waited_only`: false when the snapshot's calls are polled
/// (written()) rather than waited for at once. `disk_share`: SnapshotOptions::disk_share (each
/// owner checks it). Errors before any owner is asked: save_snapshot's.
PendingSnapshot begin_snapshot(const std::string& directory, DistributedOptimizer& optimizer,
                               const std::vector<const rpc::ShardedEmbeddingBag*>& tables,
                               const std::vector<const rpc::ShardedIdEmbeddingBag*>& id_tables,
                               int64_t rows_per_file, bool waited_only, double disk_share);

/// Throws what save_snapshot throws for `tables` that are not the optimizer's; then has every
/// owner map and keep the memory its snapshots copy into (RemoteOptimizer::reserve_copies): the
/// fixed-size tables' shards and every parameter no table holds (a collisionless table's copy
/// takes its live rows, which each snapshot counts anew). Returns the bytes kept by each owner
/// (worker name); an owner that failed is logged and missing.
std::map<std::string, int64_t> reserve_snapshot_copies(
    DistributedOptimizer& optimizer, const std::vector<const rpc::ShardedEmbeddingBag*>& tables,
    const std::vector<const rpc::ShardedIdEmbeddingBag*>& id_tables);

/// What of a snapshot a load takes: everything, the optimizer's state alone (the parameters
/// keep their values), or the parameters' values alone (the optimizer's state there stays).
enum class SnapshotPart { kEverything, kState, kValues };

/// load_snapshot; with `only_worker`, only what that owner holds is read and loaded (a restarted
/// owner's parameters, recovery.h); `part`: what is loaded of it (everything, for collisionless
/// tables' rows).
void load_snapshot_into(const std::string& directory, DistributedOptimizer& optimizer,
                        const std::vector<rpc::ShardedEmbeddingBag*>& tables,
                        const std::string& only_worker = {},
                        SnapshotPart part = SnapshotPart::kEverything,
                        const std::vector<const rpc::ShardedIdEmbeddingBag*>& id_tables = {});

/// The worker whose optimizer wrote the snapshot in `directory` (its manifest's "trainer"), or
/// empty for a snapshot that does not say (written before it did). Errors: load_snapshot's for a
/// missing, damaged or foreign manifest.
std::string snapshot_trainer(const std::string& directory);

/// The directory a SnapshotSchedule writing into `directory` gives its snapshot of `step`.
std::string scheduled_snapshot_path(const std::string& directory, int64_t step);

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
