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
#include <distoptim/rpc/rref.h>

#include "table_shard_files.h"

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
  /// optimizer's mutex and, when the step writes only the rows its sparse gradients name
  /// (FunctionalOptimizer::updates_only_gradient_rows), an rpc::InPlaceRowUpdateGuard on those
  /// rows; otherwise an rpc::InPlaceUpdateGuard. Other optimizers (another trainer's over the
  /// same table) step other rows meanwhile. `changes`: None, or one OptionBag (to_ivalue()) per
  /// group, set on that group (set_group_options) before the step. All or nothing: the gradients
  /// are read first, under the mutex; a released context (its trainer was lost) throws
  /// c10::ValueError with nothing changed, options included.
  void step(int64_t context_id, c10::IValue changes);
  /// OptimizerStateDict::to_ivalue() of the optimizer, and its inverse.
  c10::IValue state_dict();
  void load_state_dict(c10::IValue state);

  /// The owner's side of save_sharded_table for parameter `index` (a 2-D shard of a table, shard
  /// `shard` of `shards`, whose first row is the table's `first_row`): copies its rows and their
  /// state under this optimizer's mutex and an rpc::InPlaceUpdateGuard (so no optimizer's step
  /// is half in the copy: the shard at one point between steps), then writes the copy as blocks
  /// of at most `rows_per_file` rows into `directory` holding no lock, so steps go on while the
  /// files are written. Returns a dict: has_state, step, buffers (their names) and blocks (each
  /// block's first row, then the shard's end). Errors: c10::ValueError for an index that is not
  /// a 2-D parameter of this optimizer; c10::Error naming a file that could not be written.
  c10::IValue save_table_rows(std::string directory, int64_t index, int64_t shard, int64_t shards,
                              int64_t first_row, int64_t rows_per_file);
  /// The owner's side of load_sharded_table, first half: reads the rows of parameter `index` (the
  /// table's rows from `first_row` on, as many as the parameter has) and their state (`has_state`,
  /// `step`, the buffers `buffer_names`) from `blocks`, a list of [path, shard, first_row,
  /// end_row] in row order, and keeps them for commit_table_rows. Changes nothing else; a second
  /// stage of the same index replaces the first. Errors: what read_block_rows throws, naming the
  /// file; c10::ValueError for an index that is not a 2-D parameter of this optimizer.
  void stage_table_rows(int64_t index, int64_t first_row, c10::IValue blocks, bool has_state,
                        int64_t step, std::vector<std::string> buffer_names);
  /// The second half: loads what was staged for `index` into the parameter (under the same
  /// locks as a dense step) and its state; c10::ValueError when nothing is staged for it.
  void commit_table_rows(int64_t index);
  /// Forgets what was staged for `index`, if anything.
  void drop_table_rows(int64_t index);

 private:
  /// Parameter `index`, checked to be a 2-D one of this optimizer; `caller` names the method.
  const at::Tensor& table_param(int64_t index, const char* caller) const;

  // Guards optimizer_ (options, state, step counts): its calls must not overlap.
  std::mutex mutex_;
  std::unique_ptr<optim::FunctionalOptimizer> optimizer_;
  // Rows read by stage_table_rows, by parameter index, until committed or dropped. Guarded by
  // mutex_.
  std::map<int64_t, TableRows> staged_;
};

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
