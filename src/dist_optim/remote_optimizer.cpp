// RemoteOptimizer (remote_optimizer.h), the owner's side of a DistributedOptimizer: its steps
// under the owner's update locks, its state dict, and the staging and commit of what a snapshot
// or a backup's copies load. Sending steps to a backup is remote_optimizer_replicas.cpp's.

#include "remote_optimizer.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <c10/util/Exception.h>

#include <distoptim/dist_autograd/context.h>
#include <distoptim/dist_autograd/detail/gradients.h>
#include <distoptim/optim/registry.h>
#include <distoptim/rpc/api.h>
#include <distoptim/rpc/classes.h>
#include <distoptim/rpc/detail/internal_registry.h>
#include <distoptim/rpc/detail/reassigned_rows.h>
#include <distoptim/rpc/row_guard.h>

#include "archive_writer.h"
#include "huge_pages.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

namespace {

// The local values of `groups`, each with its overrides. Parameters are numbered across groups,
// as the owner's optimizer numbers them.
std::vector<optim::ParamGroup> local_groups(
    const std::vector<std::vector<rpc::RRef<at::Tensor>>>& groups,
    const std::vector<c10::IValue>& overrides) {
  TORCH_CHECK_VALUE(groups.size() == overrides.size(), "DistributedOptimizer: ", groups.size(),
                    " param groups with ", overrides.size(), " sets of overrides");
  std::vector<optim::ParamGroup> out;
  size_t i = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<at::Tensor> values;
    values.reserve(groups[g].size());
    for (const rpc::RRef<at::Tensor>& param : groups[g]) {
      TORCH_CHECK_VALUE(param.is_owner(), "DistributedOptimizer: parameter ", i, " (",
                        param.owner().name, "'s) reached the optimizer of worker '",
                        rpc::get_worker_info().name, "'");
      values.push_back(param.local_value());
      TORCH_CHECK_VALUE(values.back().requires_grad() && values.back().is_leaf(),
                        "DistributedOptimizer: parameter ", i, " on worker '",
                        rpc::get_worker_info().name,
                        "' is not a leaf tensor that requires grad, so no gradient reaches it");
      ++i;
    }
    out.emplace_back(std::move(values), optim::OptionBag::from_ivalue(overrides[g]));
  }
  return out;
}

}  // namespace

RemoteOptimizer::RemoteOptimizer(std::string optimizer,
                                 std::vector<std::vector<rpc::RRef<at::Tensor>>> groups,
                                 c10::IValue options, std::vector<c10::IValue> overrides)
    : optimizer_(optim::create_optimizer(optimizer, local_groups(groups, overrides),
                                         optim::OptionBag::from_ivalue(options))) {
  for (const at::Tensor& param : optimizer_->params()) {
    reassigned_.push_back(std::make_unique<rpc::detail::ReassignedRowsReader>(param));
  }
}

void RemoteOptimizer::step(int64_t context_id, c10::IValue changes) {
  // Lock order: this optimizer's mutex, then the tensors' locks (row_guard.h).
  std::lock_guard<std::mutex> lock(mutex_);
  // All or nothing: the step's gradients are read here, under its lock, before anything changes.
  // A step whose trainer was lost before this point finds its context released (the trainer's
  // contexts go with it) and fails having changed nothing, options included; one that got its
  // gradients is applied whole, whatever becomes of its caller meanwhile. A context the backward
  // pass never brought here has no gradients for this owner: a step of nothing.
  const dist_autograd::detail::ReachedGradients reached =
      dist_autograd::detail::gradients_if_reached(context_id);
  std::vector<at::Tensor> gradients;
  gradients.reserve(optimizer_->params().size());
  for (const at::Tensor& param : optimizer_->params()) {
    auto it = reached.gradients.find(param);
    gradients.push_back(it == reached.gradients.end() ? at::Tensor() : it->value());
  }
  if (!changes.isNone()) {
    TORCH_CHECK_TYPE(changes.isList(), "DistributedOptimizer: option changes must be a list, got ",
                     changes.tagKind());
    const c10::ArrayRef<c10::IValue> by_group = changes.toListRef();
    TORCH_CHECK_VALUE(by_group.size() == optimizer_->num_param_groups(),
                      "DistributedOptimizer: ", "option changes for ", by_group.size(),
                      " param groups, the optimizer of '", rpc::get_worker_info().name, "' has ",
                      optimizer_->num_param_groups());
    // Every group's bag is decoded before any is set. The caller checked them as this optimizer
    // does; a group set again with the same values (after a failed step) is unchanged.
    std::vector<optim::OptionBag> bags;
    bags.reserve(by_group.size());
    for (const c10::IValue& bag : by_group) bags.push_back(optim::OptionBag::from_ivalue(bag));
    for (size_t g = 0; g < bags.size(); ++g) {
      if (!bags[g].empty()) optimizer_->set_group_options(g, bags[g]);
    }
  }
  // Rows of a collisionless table handed to new ids since the last step start with a new
  // parameter's state (rpc/detail/reassigned_rows.h).
  for (size_t i = 0; i < optimizer_->params().size(); ++i) {
    reset_reassigned_rows(static_cast<int64_t>(i));
  }
  const bool replicated = mirror_ && backup_ready(*mirror_);
  // Only what the step writes is locked: of a parameter whose sparse gradient's update is
  // row-local, the rows it names; of any other with a gradient, the whole parameter (a dense
  // layer on the same server). Other trainers' steps of other parameters and rows, and lookups
  // and replies of them, go on meanwhile (this optimizer's state is mutex_'s).
  const std::vector<at::Tensor> rows_by_param = row_local_rows(gradients);
  std::vector<at::Tensor> params, rows;
  for (size_t i = 0; i < gradients.size(); ++i) {
    if (!gradients[i].defined()) continue;
    params.push_back(optimizer_->params()[i]);
    rows.push_back(rows_by_param[i]);  // undefined: the whole parameter
  }
  rpc::InPlaceRowUpdateGuard no_reply_reads_what_changes_meanwhile(params, rows);
  // A collisionless table's rows handed to new ids since the backward pass that moved them hold
  // another id now: their gradient is dropped. The guard keeps the rest from changing hands
  // until the step is done (the table hands a row out under its row lock).
  for (size_t i = 0; i < gradients.size(); ++i) {
    const at::Tensor& param = optimizer_->params()[i];
    auto from = reached.reassigned_from.find(param.unsafeGetTensorImpl());
    if (gradients[i].defined() && from != reached.reassigned_from.end()) {
      gradients[i] = rpc::detail::without_rows_reassigned_since(param, gradients[i], from->second);
    }
  }
  optimizer_->step(gradients);
  // A table shard's sparse rows go as rows even beside a dense parameter: whole, they would be
  // the shard and its state at every step.
  if (replicated) send_to_backup(gradients, rows_by_param);
}

c10::IValue RemoteOptimizer::state_dict() {
  // Copies of the state (OptimizerStateDict), taken between this optimizer's steps.
  std::lock_guard<std::mutex> lock(mutex_);
  return optimizer_->state_dict().to_ivalue();
}

void RemoteOptimizer::load_state_dict(c10::IValue state) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Rows handed to new keys from now on reset the loaded state too.
  for (const auto& reader : reassigned_) reader->start();
  optimizer_->load_state_dict(optim::OptimizerStateDict::from_ivalue(state));
}

const at::Tensor& RemoteOptimizer::param(int64_t index, const char* caller, bool table) const {
  const std::vector<at::Tensor>& params = optimizer_->params();
  TORCH_CHECK_VALUE(index >= 0 && static_cast<size_t>(index) < params.size(), caller,
                    ": parameter ", index, " on worker '", rpc::get_worker_info().name,
                    "': its optimizer has ", params.size(), " parameters");
  const at::Tensor& param = params[index];
  TORCH_CHECK_VALUE(!table || param.dim() == 2, caller, ": parameter ", index, " on worker '",
                    rpc::get_worker_info().name, "' has shape ", param.sizes(),
                    ", not the 2-D rows of a table");
  return param;
}

std::vector<ParamCopy> RemoteOptimizer::copy_targets(const std::vector<int64_t>& indices) {
  // Shapes and dtypes under the mutex, and the kept memory; new memory outside it.
  std::vector<std::pair<at::Tensor, std::map<std::string, at::Tensor>>> likes;
  std::vector<ParamCopy> copies(indices.size());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < indices.size(); ++i) {
      std::map<std::string, at::Tensor> buffers;
      const optim::ParamState& state = optimizer_->state(indices[i]);
      for (size_t slot = 0; slot < state.buffers.size(); ++slot) {
        if (state.buffers[slot].defined()) {
          buffers[optimizer_->state_names()[slot]] = state.buffers[slot];
        }
      }
      likes.emplace_back(optimizer_->params()[indices[i]], std::move(buffers));
      auto kept = kept_copies_.find(indices[i]);
      if (kept != kept_copies_.end()) {
        copies[i] = std::move(kept->second);
        kept_copies_.erase(kept);
      }
    }
  }
  // Filled with zeros, so that every page is mapped now (fresh pages cost the kernel far more
  // than a copy: at 1e7 rows the copy under the lock took seconds, not the copy's time), in huge
  // pages where the kernel gives them: a 2 MB page is one fault where 4 KB pages are 512. At low
  // priority, with no lock held: the first snapshot's 2.56 GB of a 1e7-row table took 5 s of a
  // core, which steps beside it had shared.
  auto fits = [](const at::Tensor& memory, const at::Tensor& like) {
    return memory.defined() && memory.sizes().equals(like.sizes()) &&
           memory.scalar_type() == like.scalar_type() && memory.is_contiguous();
  };
  auto touched_like = [&](const at::Tensor& memory, const at::Tensor& like) {
    if (fits(memory, like)) return memory;
    at::Tensor made =
        optim::detail::empty_with_huge_pages(like.sizes(), like.options().requires_grad(false));
    // memset, not zero_(): zero_ would spread the work over the intra-op threads, whose priority
    // is the trainers'.
    std::memset(made.data_ptr(), 0, made.nbytes());
    return made;
  };
  // Kept memory that fits needs no thread: a snapshot's owner goes straight on to its copy, which
  // the trainer waits for (snapshot.h).
  bool all_fit = true;
  for (size_t i = 0; i < indices.size() && all_fit; ++i) {
    all_fit = fits(copies[i].value, likes[i].first) &&
              copies[i].state.buffers.size() == likes[i].second.size();
    for (const auto& [name, buffer] : likes[i].second) {
      auto kept = copies[i].state.buffers.find(name);
      all_fit = all_fit && kept != copies[i].state.buffers.end() && fits(kept->second, buffer);
    }
  }
  if (all_fit) return copies;
  run_at_low_priority([&] {
    for (size_t i = 0; i < indices.size(); ++i) {
      copies[i].value = touched_like(copies[i].value, likes[i].first);
      std::map<std::string, at::Tensor> buffers;
      for (const auto& [name, buffer] : likes[i].second) {
        auto kept = copies[i].state.buffers.find(name);
        buffers[name] = touched_like(
            kept == copies[i].state.buffers.end() ? at::Tensor() : kept->second, buffer);
      }
      copies[i].state.buffers = std::move(buffers);
    }
  });
  return copies;
}

int64_t RemoteOptimizer::reserve_copies(std::vector<int64_t> indices) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int64_t index : indices) param(index, "SnapshotSchedule", /*table=*/false);
  }
  std::vector<ParamCopy> copies = copy_targets(indices);
  int64_t bytes = 0;
  for (const ParamCopy& copy : copies) {
    bytes += copy.value.nbytes();
    for (const auto& [name, buffer] : copy.state.buffers) bytes += buffer.nbytes();
  }
  keep_copies(indices, std::move(copies));
  return bytes;
}

void RemoteOptimizer::keep_copies(const std::vector<int64_t>& indices,
                                  std::vector<ParamCopy> copies) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t i = 0; i < indices.size(); ++i) kept_copies_[indices[i]] = std::move(copies[i]);
}

namespace {

// Copies `source` into `target`; where both lie contiguous in memory with one dtype, byte for
// byte, with the CRC-32 of the copy's bytes kept in `crcs` for the file that will hold them.
void copy_taking_crc(const at::Tensor& target, const at::Tensor& source,
                     optim::detail::KnownCrcs& crcs) {
  // Sparse first: a sparse tensor has no is_contiguous().
  if (target.is_sparse() || source.is_sparse() || !target.is_contiguous() ||
      !source.is_contiguous() || target.scalar_type() != source.scalar_type() ||
      !target.sizes().equals(source.sizes())) {
    target.copy_(source);
    return;
  }
  const size_t bytes = target.nbytes();
  crcs[{target.data_ptr(), bytes}] =
      optim::detail::copy_with_crc(target.data_ptr(), source.data_ptr(), bytes);
}

}  // namespace

void RemoteOptimizer::copy_param(int64_t index, ParamCopy& into, int64_t piece_rows,
                                 RowsCopied* copied) const {
  at::NoGradGuard no_grad;
  const at::Tensor& param = optimizer_->params()[index];
  const bool fits = into.value.defined() && into.value.sizes().equals(param.sizes());
  TORCH_INTERNAL_ASSERT(fits || piece_rows <= 0, "a shard's copy is read while it is made");
  if (!fits) into.value = at::empty_like(param);
  // Each tensor copied, its source beside it.
  std::vector<std::pair<at::Tensor, at::Tensor>> pairs{{into.value, param}};
  const optim::ParamState& state = optimizer_->state(index);
  into.has_state = !state.empty();
  into.state.step = state.step;
  std::map<std::string, at::Tensor> buffers;
  for (size_t slot = 0; slot < state.buffers.size(); ++slot) {
    const at::Tensor& buffer = state.buffers[slot];
    if (!buffer.defined()) continue;
    const std::string& name = optimizer_->state_names()[slot];
    auto it = into.state.buffers.find(name);
    // A buffer created since copy_targets looked (a first step in between) gets memory here.
    const bool kept = it != into.state.buffers.end() && it->second.sizes().equals(buffer.sizes()) &&
                      it->second.scalar_type() == buffer.scalar_type();
    buffers[name] = kept ? it->second : at::empty_like(buffer);
    pairs.emplace_back(buffers[name], buffer);
  }
  into.state.buffers = std::move(buffers);
  const int64_t rows = param.dim() > 0 ? param.size(0) : 0;
  if (piece_rows <= 0 || rows == 0) {
    optim::detail::KnownCrcs crcs;
    for (auto& [target, source] : pairs) copy_taking_crc(target, source, crcs);
    if (copied != nullptr) copied->advance(rows, crcs);
    return;
  }
  for (int64_t from = 0; from < rows; from += piece_rows) {
    const int64_t to = std::min(rows, from + piece_rows);
    optim::detail::KnownCrcs crcs;
    for (auto& [target, source] : pairs) {
      copy_taking_crc(target.slice(0, from, to), source.slice(0, from, to), crcs);
    }
    if (copied != nullptr) copied->advance(to, crcs);
  }
}

namespace {

c10::impl::GenericDict summary_dict(const StateSummary& state) {
  c10::impl::GenericDict dict = string_dict();
  insert_state_summary(dict, state);
  return dict;
}

StateSummary summary_from(const c10::IValue& state) {
  TORCH_CHECK_VALUE(state.isGenericDict(), kLoadSnapshot, ": a state summary must be a dict, got ",
                    state.tagKind());
  return state_summary(state.toGenericDict(),
                       "the state summary sent to worker '" + rpc::get_worker_info().name + "'");
}

}  // namespace

int64_t RemoteOptimizer::index_of(rpc::RRef<at::Tensor> param) {
  TORCH_CHECK_VALUE(param.is_owner(), "index_of: the parameter is worker '", param.owner_name(),
                    "''s, not worker '", rpc::get_worker_info().name, "''s");
  const at::Tensor value = param.local_value();
  std::lock_guard<std::mutex> lock(mutex_);
  const std::vector<at::Tensor>& params = optimizer_->params();
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].is_same(value)) return static_cast<int64_t>(i);
  }
  return -1;
}

int64_t RemoteOptimizer::save_table_rows(std::string prefix, int64_t index, int64_t shard,
                                         int64_t shards, int64_t first_row, int64_t rows_per_file,
                                         double disk_share) {
  TORCH_CHECK_VALUE(rows_per_file > 0, kSaveSnapshot, ": rows_per_file is ", rows_per_file,
                    "; it must be at least 1");
  SnapshotWrites::check_disk_share(disk_share, rpc::get_worker_info().name);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    param(index, kSaveSnapshot, /*table=*/true);
  }
  // The copy and what its writer reads, kept alive by the writer beyond this call.
  struct ShardCopy {
    ParamCopy copy;
    RowsCopied copied;
  };
  auto shard_copy = std::make_shared<ShardCopy>();
  shard_copy->copy = std::move(copy_targets({index}).front());
  // The first blocks are written while the rest of the shard is copied, each once its rows are.
  // The writer starts once the locks are taken, so that its start delays them in no way.
  std::optional<int64_t> ticket;
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    rpc::InPlaceUpdateGuard no_step_meanwhile;
    auto write = [this, shard_copy, prefix, index, shard, shards, first_row,
                  rows_per_file]() -> c10::IValue {
      const std::vector<int64_t> blocks = write_shard_blocks(
          prefix, shard, shards, first_row, shard_copy->copy, rows_per_file, &shard_copy->copied);
      c10::impl::GenericDict summary = summary_dict(summary_of(shard_copy->copy));
      summary.insert("blocks", c10::List<int64_t>(blocks));
      std::vector<ParamCopy> kept;
      kept.push_back(std::move(shard_copy->copy));
      keep_copies({index}, std::move(kept));
      return summary;
    };
    ticket = snapshot_writes_.start(disk_share, std::move(write));
    copy_param(index, shard_copy->copy, rows_per_file, &shard_copy->copied);
  } catch (...) {
    shard_copy->copied.abandon();  // the writer stops; its error says less than this one
    if (ticket) snapshot_writes_.drop(*ticket);
    throw;
  }
  return *ticket;
}

int64_t RemoteOptimizer::save_params(std::string path, std::vector<int64_t> indices,
                                     std::vector<int64_t> dense_indices, double disk_share) {
  TORCH_CHECK_VALUE(indices.size() == dense_indices.size(), kSaveSnapshot, ": ", indices.size(),
                    " parameters named by ", dense_indices.size(), " indices");
  SnapshotWrites::check_disk_share(disk_share, rpc::get_worker_info().name);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int64_t index : indices) param(index, kSaveSnapshot, /*table=*/false);
  }
  auto copies = std::make_shared<std::vector<ParamCopy>>(copy_targets(indices));
  auto copied = std::make_shared<RowsCopied>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    rpc::InPlaceUpdateGuard no_step_meanwhile;
    for (size_t i = 0; i < indices.size(); ++i) {
      copy_param(indices[i], (*copies)[i], 0, copied.get());
    }
  }
  return snapshot_writes_.start(
      disk_share, [this, copies, copied, path, indices, dense_indices]() -> c10::IValue {
        const optim::detail::KnownCrcs crcs = copied->crcs();
        write_params_file(path, dense_indices, *copies, &crcs);
        c10::impl::GenericList summaries(c10::AnyType::get());
        for (const ParamCopy& copy : *copies) summaries.push_back(summary_dict(summary_of(copy)));
        keep_copies(indices, std::move(*copies));
        return summaries;
      });
}

c10::intrusive_ptr<c10::ivalue::Future> RemoteOptimizer::snapshot_written(int64_t ticket) {
  return snapshot_writes_.claim(ticket, rpc::get_worker_info().name);
}

void RemoteOptimizer::stage_table_rows(int64_t index, int64_t first_row, c10::IValue blocks,
                                       c10::IValue state) {
  int64_t rows = 0, dim = 0;
  c10::ScalarType dtype;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const at::Tensor& table = param(index, kLoadSnapshot, /*table=*/true);
    rows = table.size(0);
    dim = table.size(1);
    dtype = table.scalar_type();
  }
  const StateSummary summary = summary_from(state);
  TORCH_CHECK_VALUE(blocks.isList(), kLoadSnapshot, ": blocks must be a list, got ",
                    blocks.tagKind());
  std::vector<BlockFile> files;
  for (const c10::IValue& entry : blocks.toListRef()) {
    TORCH_CHECK_VALUE(entry.isList() && entry.toListRef().size() == 4 &&
                          entry.toListRef()[0].isString() && entry.toListRef()[1].isInt() &&
                          entry.toListRef()[2].isInt() && entry.toListRef()[3].isInt(),
                      kLoadSnapshot, ": a block must be [path, shard, first_row, end_row]");
    const c10::ArrayRef<c10::IValue> fields = entry.toListRef();
    files.push_back(BlockFile{fields[0].toStringRef(), fields[1].toInt(), fields[2].toInt(),
                              fields[3].toInt()});
  }
  bool in_order = !files.empty() && files.front().first_row <= first_row &&
                  files.back().end_row >= first_row + rows;
  for (size_t b = 0; in_order && b < files.size(); ++b) {
    in_order = files[b].first_row < files[b].end_row &&
               (b == 0 || files[b - 1].end_row == files[b].first_row);
  }
  TORCH_CHECK_VALUE(in_order, kLoadSnapshot, ": the blocks sent to worker '",
                    rpc::get_worker_info().name, "' do not hold its rows [", first_row, ", ",
                    first_row + rows, ") in order");
  // Read with no lock held: steps go on until the commit.
  stage(index, read_block_rows(files, first_row, first_row + rows, dim, dtype, summary));
}

void RemoteOptimizer::stage_param(int64_t index, std::string path, int64_t dense_index,
                                  c10::IValue state) {
  at::Tensor like;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    like = param(index, kLoadSnapshot, /*table=*/false);
  }
  stage(index, read_param(path, dense_index, like, summary_from(state)));
}

void RemoteOptimizer::stage(int64_t index, ParamCopy copy) {
  std::lock_guard<std::mutex> lock(mutex_);
  staged_[index] = std::move(copy);
}

void RemoteOptimizer::commit_staged(int64_t index) { commit(index, /*with_value=*/true); }

void RemoteOptimizer::commit_staged_state(int64_t index) { commit(index, /*with_value=*/false); }

void RemoteOptimizer::commit_staged_value(int64_t index) {
  commit(index, /*with_value=*/true, /*with_state=*/false);
}

void RemoteOptimizer::commit(int64_t index, bool with_value, bool with_state) {
  std::lock_guard<std::mutex> lock(mutex_);
  const at::Tensor& target = param(index, kLoadSnapshot, /*table=*/false);
  auto it = staged_.find(index);
  TORCH_CHECK_VALUE(it != staged_.end(), kLoadSnapshot, ": nothing was staged for parameter ",
                    index, " on worker '", rpc::get_worker_info().name, "'");
  if (it->second.ids.defined()) {
    if (!with_value) {
      commit_id_state(index, it->second);
    } else {
      if (!with_state) it->second.has_state = false;  // this optimizer's state starts anew
      commit_id_rows(index, it->second);
    }
    staged_.erase(it);
    staged_id_tables_.erase(index);
    return;
  }
  TORCH_CHECK_VALUE(it->second.value.defined() || !with_value, kLoadSnapshot,
                    ": no value was staged for parameter ", index, " on worker '",
                    rpc::get_worker_info().name, "'");
  TORCH_CHECK_VALUE(!it->second.value.defined() || it->second.value.sizes() == target.sizes(),
                    kLoadSnapshot, ": parameter ", index, " on worker '",
                    rpc::get_worker_info().name, "' has shape ", target.sizes(),
                    ", what was staged ", it->second.value.sizes());
  // This parameter's state alone: the others' (a merged optimizer holds another server's
  // parameters beside its own) are not copied.
  std::optional<optim::OptimizerStateDict::State> state;
  if (it->second.has_state) state = std::move(it->second.state);
  {
    rpc::InPlaceUpdateGuard no_reply_reads_meanwhile;
    at::NoGradGuard no_grad;
    // Checked first: on error nothing changed. Rows handed to new keys from now on reset the
    // loaded state.
    if (with_state) reassigned_[index]->start();
    if (with_state) optimizer_->load_param_state(index, state);
    if (with_value) target.copy_(it->second.value);
  }
  staged_.erase(it);
}

void RemoteOptimizer::drop_staged(int64_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  staged_.erase(index);
  staged_id_tables_.erase(index);
}

void RemoteOptimizer::reset_reassigned_rows(int64_t index) {
  bool everything = false;
  const std::vector<int64_t> reassigned = reassigned_[index]->take(everything);
  if (everything) {
    // This optimizer fell too far behind the table's hand-outs to know which rows they were.
    optimizer_->reset_state_rows(index, at::arange(optimizer_->params()[index].size(0), at::kLong));
  } else if (!reassigned.empty()) {
    optimizer_->reset_state_rows(index, at::tensor(reassigned, at::kLong));
  }
}

namespace {
bool register_remote_optimizer() {
  register_step_mirror();
  rpc::detail::register_internal_class<RemoteOptimizer, std::string,
                                       std::vector<std::vector<rpc::RRef<at::Tensor>>>, c10::IValue,
                                       std::vector<c10::IValue>>(kRemoteOptimizerClass);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "step", &RemoteOptimizer::step);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "state_dict",
                                        &RemoteOptimizer::state_dict);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "load_state_dict",
                                        &RemoteOptimizer::load_state_dict);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "index_of",
                                        &RemoteOptimizer::index_of);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "reserve_copies",
                                        &RemoteOptimizer::reserve_copies);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "save_table_rows",
                                        &RemoteOptimizer::save_table_rows);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "save_params",
                                        &RemoteOptimizer::save_params);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "snapshot_written",
                                        &RemoteOptimizer::snapshot_written);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "stage_table_rows",
                                        &RemoteOptimizer::stage_table_rows);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "save_id_rows",
                                        &RemoteOptimizer::save_id_rows);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "stage_id_rows",
                                        &RemoteOptimizer::stage_id_rows);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "stage_param",
                                        &RemoteOptimizer::stage_param);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "commit_staged",
                                        &RemoteOptimizer::commit_staged);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "commit_staged_state",
                                        &RemoteOptimizer::commit_staged_state);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "commit_staged_value",
                                        &RemoteOptimizer::commit_staged_value);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "drop_staged",
                                        &RemoteOptimizer::drop_staged);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "set_backup",
                                        &RemoteOptimizer::set_backup);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "stage_from_backup",
                                        &RemoteOptimizer::stage_from_backup);
  rpc::register_method<RemoteOptimizer>(kRemoteOptimizerClass, "take_state",
                                        &RemoteOptimizer::take_state);
  return true;
}
}  // namespace

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim

// Registered at start-up, so that an owner which never builds a DistributedOptimizer itself (a
// parameter server) can host one. The linker is told to keep this symbol (CMakeLists.txt).
extern "C" const bool distoptim_dist_optim_registered =  // NOLINT: a C name, kept by the linker
    distoptim::dist_optim::detail::register_remote_optimizer();
