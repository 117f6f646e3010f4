// The replica side of a RemoteOptimizer (replicas.h): sending each step's changes to the owner's
// backup, stepping on without it while it is lost (ReplicaOptions::continue_without_backup),
// reading a parameter back from a backup's copies, and taking over another optimizer's state
// when DistributedOptimizer::rebind merges a lost owner's parameters into this one.

#include <map>
#include <optional>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>
#include <distoptim/rpc/api.h>
#include <distoptim/rpc/row_guard.h>

#include "huge_pages.h"
#include "remote_optimizer.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

std::vector<at::Tensor> RemoteOptimizer::row_local_rows(
    const std::vector<at::Tensor>& gradients) const {
  std::vector<at::Tensor> rows(gradients.size());
  for (size_t i = 0; i < gradients.size(); ++i) {
    if (optimizer_->updates_only_gradient_rows(i, gradients[i])) {
      rows[i] = gradients[i]._indices().select(0, 0);
    }
  }
  return rows;
}

void RemoteOptimizer::set_backup(std::string backup, std::vector<std::string> param_keys,
                                 std::string state_owner, bool restored_from_it,
                                 bool continue_without_backup) {
  const std::string me = rpc::get_worker_info().name;
  TORCH_CHECK_VALUE(backup != me, "replicate_steps: worker '", me, "' cannot be its own backup");
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK_VALUE(param_keys.size() == optimizer_->params().size(),
                    "replicate_steps: ", param_keys.size(), " keys for the ",
                    optimizer_->params().size(), " parameters of the optimizer on worker '", me,
                    "'");
  for (size_t i = 0; i < param_keys.size(); ++i) {
    TORCH_CHECK_VALUE(!param_keys[i].empty(), "replicate_steps: the key of parameter ", i,
                      " on worker '", me, "' is empty");
  }
  auto link = std::make_unique<MirrorLink>(std::move(backup), std::move(param_keys),
                                           std::move(state_owner), continue_without_backup);
  if (continue_without_backup && !restored_from_it) {
    // Everything whole now, or, while the backup is lost, once its next incarnation joins.
    backup_ready(*link);
  } else if (restored_from_it) {
    // A restore from the backup's copies: they hold what this optimizer now holds (the other
    // trainers' steps of these parameters since the restore went to them too, before returning).
    const int backup_id = rpc::get_worker_info(link->backup()).id;
    for (const MirrorUpdate& whole : everything_whole(*link, /*with_values=*/false)) {
      link->note_sent_whole(whole.key);
    }
    link->note_synced(backup_id);
  } else {
    send_everything_whole(*link);
  }
  mirror_ = std::move(link);
}

bool RemoteOptimizer::backup_ready(MirrorLink& link) {
  if (!link.continue_without_backup()) {
    // A backup that came back as a new incarnation (or a failed send) gets everything whole.
    if (!link.in_sync()) send_everything_whole(link);
    return true;
  }
  if (link.backup_lost()) {
    link.note_uncopied_step();
    return false;
  }
  if (link.in_sync()) return true;
  try {
    const int64_t uncopied = link.uncopied_steps();
    send_everything_whole(link);
    // Said, so that an operator (or a test) sees when the parameters are on two workers again.
    TORCH_WARN("replicas: worker '", rpc::get_worker_info().name,
               "' copied everything of trainer '", link.state_owner(), "' to its backup '",
               link.backup(), "', after ", uncopied, " step(s) not copied");
    return true;
  } catch (const PeerLostError& error) {
    link.note_lost();
    link.note_uncopied_step();
    TORCH_WARN("replicas: worker '", rpc::get_worker_info().name, "' steps on without its backup '",
               link.backup(), "', lost: ", error.what_without_backtrace());
    return false;
  }
}

void RemoteOptimizer::send_everything_whole(MirrorLink& link) {
  const int backup_id = rpc::get_worker_info(link.backup()).id;
  link.forget_sent();
  // Every parameter and the state it has, at one moment (no other optimizer's step of them
  // meanwhile): the copies the later steps' rows apply to, and all a recovery needs.
  rpc::InPlaceUpdateGuard no_update_meanwhile;
  try {
    link.send(everything_whole(link, /*with_values=*/true));
  } catch (c10::Error& error) {
    error.add_context("replicas: worker '" + rpc::get_worker_info().name +
                      "' could not copy its parameters to its backup '" + link.backup() +
                      "'; the step was not applied");
    throw;
  }
  link.note_synced(backup_id);
}

std::vector<MirrorUpdate> RemoteOptimizer::everything_whole(const MirrorLink& link,
                                                            bool with_values) const {
  at::NoGradGuard no_grad;
  std::vector<MirrorUpdate> updates;
  auto value = [with_values](const at::Tensor& t) {
    return with_values ? optim::detail::clone_with_huge_pages(t) : at::Tensor();
  };
  for (size_t i = 0; i < link.size(); ++i) {
    updates.push_back({link.param_key(i), at::Tensor(), value(optimizer_->params()[i])});
    const optim::ParamState& state = optimizer_->state(i);
    if (state.empty()) continue;
    for (size_t slot = 0; slot < state.buffers.size(); ++slot) {
      if (!state.buffers[slot].defined()) continue;
      updates.push_back({link.state_key(i, optimizer_->state_names()[slot]), at::Tensor(),
                         value(state.buffers[slot])});
    }
    updates.push_back({link.step_key(i), at::Tensor(),
                       with_values ? at::scalar_tensor(state.step, at::kLong) : at::Tensor()});
  }
  return updates;
}

void RemoteOptimizer::stage_from_backup(int64_t index, std::string backup, std::string primary,
                                        std::string param_key, std::string state_owner,
                                        bool with_value) {
  const std::string me = primary.empty() ? rpc::get_worker_info().name : primary;
  at::Tensor like;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    like = param(index, kRecoverFromBackup, /*table=*/false);
  }
  ParamCopy copy;
  // The value only when it is loaded: a table shard's is the whole shard.
  if (with_value) {
    copy.value = mirrored_copy(backup, me, param_key);
    TORCH_CHECK_VALUE(copy.value.defined(), kRecoverFromBackup, ": worker '", backup,
                      "' holds no copy of '", param_key, "' of worker '", me, "'");
    TORCH_CHECK_VALUE(
        copy.value.sizes() == like.sizes() && copy.value.scalar_type() == like.scalar_type(),
        kRecoverFromBackup, ": the copy of '", param_key, "' on worker '", backup, "' has shape ",
        copy.value.sizes(), ", parameter ", index, " on worker '", rpc::get_worker_info().name,
        "' ", like.sizes());
  }
  const std::string prefix = param_key + "/state/" + state_owner + "/";
  for (const std::string& key : mirrored_keys(backup, me)) {
    if (key.rfind(prefix, 0) != 0) continue;
    const std::string name = key.substr(prefix.size());
    const at::Tensor value = mirrored_copy(backup, me, key);
    if (!value.defined()) continue;  // gone meanwhile: a new incarnation of the backup
    copy.has_state = true;
    if (name == "step") {
      copy.state.step = value.item<int64_t>();
    } else {
      copy.state.buffers[name] = value;
    }
  }
  stage(index, std::move(copy));
}

void RemoteOptimizer::send_to_backup(const std::vector<at::Tensor>& gradients,
                                     const std::vector<at::Tensor>& rows) {
  at::NoGradGuard no_grad;
  std::vector<MirrorUpdate> updates;
  for (size_t i = 0; i < gradients.size(); ++i) {
    if (!gradients[i].defined()) continue;
    const at::Tensor& param = optimizer_->params()[i];
    // Each changed row once (a sparse gradient may name a row many times).
    const at::Tensor changed =
        rows[i].defined() ? std::get<0>(at::_unique(rows[i], /*sorted=*/true)) : at::Tensor();
    // A copy that the backup holds takes the changed rows; any other goes whole.
    auto update = [&](const std::string& key, const at::Tensor& value) {
      if (changed.defined() && value.dim() >= 1 && value.size(0) == param.size(0) &&
          mirror_->sent_whole(key)) {
        updates.push_back({key, changed, value.index_select(0, changed)});
      } else {
        updates.push_back({key, at::Tensor(), optim::detail::clone_with_huge_pages(value)});
      }
    };
    update(mirror_->param_key(i), param);
    const optim::ParamState& state = optimizer_->state(i);
    for (size_t slot = 0; slot < state.buffers.size(); ++slot) {
      if (!state.buffers[slot].defined()) continue;
      update(mirror_->state_key(i, optimizer_->state_names()[slot]), state.buffers[slot]);
    }
    updates.push_back(
        {mirror_->step_key(i), at::Tensor(), at::scalar_tensor(state.step, at::kLong)});
  }
  try {
    mirror_->send(std::move(updates));
  } catch (const PeerLostError& error) {
    if (!mirror_->continue_without_backup()) throw;
    // The step stays applied here, not copied: the backup's next incarnation takes it whole.
    mirror_->note_lost();
    mirror_->note_uncopied_step();
    TORCH_WARN("replicas: worker '", rpc::get_worker_info().name, "' steps on without its backup '",
               mirror_->backup(), "', lost: ", error.what_without_backtrace());
  } catch (c10::Error& error) {
    // The backup may be a new incarnation when this optimizer next steps: everything whole then.
    mirror_->forget_sent();
    error.add_context("replicas: the step was applied on worker '" + rpc::get_worker_info().name +
                      "' but not copied to its backup '" + mirror_->backup() + "'");
    throw;
  }
}

void RemoteOptimizer::take_state(rpc::RRef<RemoteOptimizer> from, std::vector<int64_t> from_indices,
                                 std::vector<int64_t> to_indices) {
  TORCH_CHECK_VALUE(from.is_owner(), "DistributedOptimizer::rebind: the optimizer to take state ",
                    "from is worker '", from.owner_name(), "''s, not worker '",
                    rpc::get_worker_info().name, "''s");
  TORCH_CHECK_VALUE(from_indices.size() == to_indices.size(),
                    "DistributedOptimizer::rebind: ", from_indices.size(),
                    " parameters' state for ", to_indices.size());
  const std::shared_ptr<RemoteOptimizer> old = from.local_value();
  // The old optimizer's buffers themselves (it steps no more): load_state_dict copies them once.
  std::map<int64_t, optim::OptimizerStateDict::State> taken;
  {
    std::lock_guard<std::mutex> lock(old->mutex_);
    for (size_t i = 0; i < from_indices.size(); ++i) {
      old->param(from_indices[i], "DistributedOptimizer::rebind", /*table=*/false);
      const optim::ParamState& state = old->optimizer_->state(from_indices[i]);
      if (state.empty()) continue;
      optim::OptimizerStateDict::State& kept = taken[to_indices[i]];
      kept.step = state.step;
      for (size_t slot = 0; slot < state.buffers.size(); ++slot) {
        if (state.buffers[slot].defined()) {
          kept.buffers[old->optimizer_->state_names()[slot]] = state.buffers[slot];
        }
      }
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (const int64_t index : to_indices) param(index, "DistributedOptimizer::rebind", false);
  for (const int64_t index : to_indices) {
    auto it = taken.find(index);
    reassigned_[index]->start();  // rows handed to new keys from now on reset the taken state
    optimizer_->load_param_state(
        index, it == taken.end()
                   ? std::nullopt
                   : std::optional<optim::OptimizerStateDict::State>(std::move(it->second)));
  }
}

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
