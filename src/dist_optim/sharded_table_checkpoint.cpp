// save_sharded_table / load_sharded_table (sharded_table_checkpoint.h): a ShardedEmbeddingBag's
// checkpoint, written as a snapshot of the optimizer's table parameters alone.

#include <distoptim/dist_optim/sharded_table_checkpoint.h>

#include <cstddef>
#include <vector>

#include <c10/util/Exception.h>

#include <distoptim/dist_optim/snapshot.h>

#include "owner_calls.h"

namespace distoptim {
namespace dist_optim {

namespace {

using detail::OwnerOptimizer;

constexpr const char* kSaveTable = "save_sharded_table";
constexpr const char* kLoadTable = "load_sharded_table";

// The optimizer must be built over table.remote_parameters() alone (positions 0 to shards - 1,
// in shard order, each on its shard's worker).
void check_optimizer(const std::vector<OwnerOptimizer>& owners,
                     const rpc::ShardedEmbeddingBag& table, const char* caller) {
  const size_t shards = table.num_shards();
  size_t params = 0;
  for (const OwnerOptimizer& owner : owners) params += owner.positions.size();
  TORCH_CHECK_VALUE(params == shards, caller, ": the optimizer has ", params,
                    " parameters, the table ", shards,
                    " shards (build it over table.remote_parameters() alone)");
  for (size_t k = 0; k < owners.size(); ++k) {
    for (size_t i = 0; i < owners[k].positions.size(); ++i) {
      const int64_t position = owners[k].positions[i];
      TORCH_CHECK_VALUE(position >= 0 && static_cast<size_t>(position) < shards &&
                            owners[k].worker == table.shard_owner(position),
                        caller, ": the optimizer's parameter ", position, " is on worker '",
                        owners[k].worker, "', which holds no shard ", position,
                        " of the table (build the optimizer over table.remote_parameters())");
    }
  }
}

}  // namespace

void save_sharded_table(const std::string& directory, const rpc::ShardedEmbeddingBag& table,
                        DistributedOptimizer& optimizer, int64_t rows_per_file) {
  check_optimizer(detail::OwnerAccess::owners(optimizer), table, kSaveTable);
  save_snapshot(directory, optimizer, {&table}, rows_per_file);
}

void load_sharded_table(const std::string& directory, rpc::ShardedEmbeddingBag& table,
                        DistributedOptimizer& optimizer) {
  check_optimizer(detail::OwnerAccess::owners(optimizer), table, kLoadTable);
  load_snapshot(directory, optimizer, {&table});
}

}  // namespace dist_optim
}  // namespace distoptim
