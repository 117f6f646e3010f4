// The collisionless tables' side of a RemoteOptimizer's snapshots (remote_optimizer.h,
// snapshot.h): a shard's live rows saved with their ids and state rows, and loaded onto a shard
// of any split, each id's rows where the loading shard gives it a row; or one optimizer's state
// rows alone (recovery.h: a trainer that did not restore the shard), where its ids hold rows now.
//
// Locks, in the order taken: this optimizer's mutex, then the shard's id map (rpc::IdRows), then
// the process's update guard. Lookups take the id map and then row guards, and steps the mutex
// and then row guards, so no two of them wait on each other in a cycle.

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <distoptim/rpc/api.h>
#include <distoptim/rpc/detail/reassigned_rows.h>
#include <distoptim/rpc/row_guard.h>

#include "remote_optimizer.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

std::shared_ptr<rpc::IdEmbeddingShard> RemoteOptimizer::id_table(
    int64_t index, const rpc::RRef<rpc::IdEmbeddingShard>& table, const char* caller) {
  const std::string& here = rpc::get_worker_info().name;
  TORCH_CHECK_VALUE(table.is_owner(), caller, ": the collisionless table's shard is worker '",
                    table.owner_name(), "''s, not worker '", here, "''s");
  std::shared_ptr<rpc::IdEmbeddingShard> shard = table.local_value();
  std::lock_guard<std::mutex> lock(mutex_);
  const at::Tensor& weight = param(index, caller, /*table=*/true);
  TORCH_CHECK_VALUE(weight.is_same(shard->weight), caller, ": parameter ", index, " on worker '",
                    here, "' is not the weight of the collisionless table's shard");
  return shard;
}

int64_t RemoteOptimizer::save_id_rows(std::string prefix, int64_t index,
                                      rpc::RRef<rpc::IdEmbeddingShard> table, int64_t shard,
                                      int64_t shards, int64_t rows_per_file, double disk_share) {
  TORCH_CHECK_VALUE(rows_per_file > 0, kSaveSnapshot, ": rows_per_file is ", rows_per_file,
                    "; it must be at least 1");
  SnapshotWrites::check_disk_share(disk_share, rpc::get_worker_info().name);
  const std::shared_ptr<rpc::IdEmbeddingShard> module = id_table(index, table, kSaveSnapshot);
  auto shared_copy = std::make_shared<ParamCopy>();
  ParamCopy& copy = *shared_copy;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    module->read_live_rows([&](const at::Tensor& ids, const at::Tensor& rows) {
      // No id gains a row meanwhile, so every row handed out so far is reset here.
      reset_reassigned_rows(index);
      rpc::InPlaceUpdateGuard no_step_meanwhile;
      at::NoGradGuard no_grad;
      const at::Tensor& weight = optimizer_->params()[index];
      copy.ids = ids;
      copy.value = weight.index_select(0, rows);
      const optim::ParamState& state = optimizer_->state(index);
      copy.has_state = !state.empty();
      copy.state.step = state.step;
      for (size_t slot = 0; slot < state.buffers.size(); ++slot) {
        const at::Tensor& buffer = state.buffers[slot];
        if (!buffer.defined()) continue;
        const std::string& name = optimizer_->state_names()[slot];
        TORCH_CHECK_VALUE(buffer.sizes() == weight.sizes(), kSaveSnapshot, ": the state buffer '",
                          name, "' of a collisionless table on worker '",
                          rpc::get_worker_info().name, "' has shape ", buffer.sizes(),
                          ", not the table's ", weight.sizes());
        copy.state.buffers[name] = buffer.index_select(0, rows);
      }
    });
  }
  return snapshot_writes_.start(
      disk_share, [shared_copy, prefix, shard, shards, rows_per_file]() -> c10::IValue {
        const std::vector<int64_t> blocks =
            write_id_blocks(prefix, shard, shards, *shared_copy, rows_per_file);
        c10::impl::GenericDict summary = string_dict();
        insert_state_summary(summary, summary_of(*shared_copy));
        summary.insert("blocks", c10::List<int64_t>(blocks));
        return summary;
      });
}

void RemoteOptimizer::stage_id_rows(int64_t index, rpc::RRef<rpc::IdEmbeddingShard> table,
                                    int64_t shard, int64_t shards, std::vector<std::string> paths,
                                    c10::IValue state) {
  const std::string& here = rpc::get_worker_info().name;
  TORCH_CHECK_VALUE(shards >= 1 && shard >= 0 && shard < shards, kLoadSnapshot, ": shard ", shard,
                    " of ", shards, " on worker '", here, "'");
  TORCH_CHECK_VALUE(state.isGenericDict(), kLoadSnapshot, ": a state summary must be a dict, got ",
                    state.tagKind());
  const StateSummary summary =
      state_summary(state.toGenericDict(), "the state summary sent to worker '" + here + "'");
  const std::shared_ptr<rpc::IdEmbeddingShard> module = id_table(index, table, kLoadSnapshot);
  const at::Tensor& weight = module->weight;
  // Read with no lock held: lookups and steps go on until the commit.
  ParamCopy copy =
      read_id_blocks(paths, weight.size(1), weight.scalar_type(), summary, [&](int64_t id) {
        return rpc::ShardedIdEmbeddingBag::shard_of(id, static_cast<size_t>(shards)) ==
               static_cast<size_t>(shard);
      });
  TORCH_CHECK_VALUE(copy.ids.size(0) <= module->capacity(), kLoadSnapshot, ": shard ", shard,
                    " of ", shards, " on worker '", here, "' would hold ", copy.ids.size(0),
                    " ids of the snapshot; its capacity is ", module->capacity(), " rows");
  std::lock_guard<std::mutex> lock(mutex_);
  staged_[index] = std::move(copy);
  staged_id_tables_[index] = module;
}

void RemoteOptimizer::commit_id_rows(int64_t index, ParamCopy& copy) {
  const std::shared_ptr<rpc::IdEmbeddingShard> module = staged_id_tables_.at(index);
  const at::Tensor& weight = optimizer_->params()[index];
  at::NoGradGuard no_grad;
  // The state first, every row as a new parameter's; the rows the ids get are then written over
  // it.
  load_id_state_anew(index, copy);
  module->replace_rows(copy.ids, [&](const at::Tensor& rows) {
    rpc::InPlaceUpdateGuard no_reply_reads_meanwhile;
    // Every row now holds another id for the other optimizers over the table, whose state the
    // snapshot does not hold; this one's state is the snapshot's, whatever was noted before.
    const int64_t* row = rows.data_ptr<int64_t>();
    rpc::detail::note_reassigned_rows(weight, row, rows.numel());
    bool everything = false;
    reassigned_[index]->take(everything);
    weight.index_copy_(0, rows, copy.value);
    write_id_state_rows(index, copy, rows, /*of=*/{});
  });
}

void RemoteOptimizer::write_id_state_rows(int64_t index, const ParamCopy& copy,
                                          const at::Tensor& rows, const at::Tensor& of) {
  if (!copy.has_state) return;
  at::NoGradGuard no_grad;
  const optim::ParamState& state = optimizer_->state(index);
  for (size_t slot = 0; slot < state.buffers.size(); ++slot) {
    auto it = copy.state.buffers.find(optimizer_->state_names()[slot]);
    if (state.buffers[slot].defined() && it != copy.state.buffers.end()) {
      state.buffers[slot].index_copy_(0, rows,
                                      of.defined() ? it->second.index_select(0, of) : it->second);
    }
  }
}

void RemoteOptimizer::load_id_state_anew(int64_t index, const ParamCopy& copy) {
  at::NoGradGuard no_grad;
  // Checked by the optimizer: on error nothing changed.
  if (!copy.has_state) {
    optimizer_->load_param_state(index, std::nullopt);
    return;
  }
  const at::Tensor& weight = optimizer_->params()[index];
  optim::OptimizerStateDict::State fresh;
  fresh.step = copy.state.step;
  for (const auto& [name, rows] : copy.state.buffers) fresh.buffers[name] = at::zeros_like(weight);
  optimizer_->load_param_state(index, fresh);
  optimizer_->reset_state_rows(index, at::arange(weight.size(0), at::kLong));
}

void RemoteOptimizer::commit_id_state(int64_t index, const ParamCopy& copy) {
  const std::shared_ptr<rpc::IdEmbeddingShard> module = staged_id_tables_.at(index);
  load_id_state_anew(index, copy);
  module->read_rows_of(copy.ids, [&](const at::Tensor& rows) {
    // No row changes hands meanwhile, so the rows handed to new ids so far hold their ids now:
    // their state is either loaded below or new already. Those handed on later reset it.
    bool everything = false;
    reassigned_[index]->take(everything);
    // The snapshot's ids that hold a row now; the others were dropped since it was taken.
    const at::Tensor held = rows.nonzero().squeeze(1);
    write_id_state_rows(index, copy, rows.index_select(0, held), held);
  });
}

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
