#pragma once

// Replicas (replicas.h): a backup's copies of what its primaries' steps change, and the primary's
// side that sends each step's changes there before the step's reply returns.
//
// The backup keeps, per primary, tensors by key: each replicated parameter under its key (a
// table shard's or module's key with the parameter's place), and each trainer's optimizer state
// of it beside it. A copy is sent whole first and then row by row (the rows a sparse step
// changed) or whole again (a dense step). Process-wide on the backup, so that the trainers'
// optimizers on one primary share one copy of a parameter they all step.

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace distoptim {
namespace dist_optim {
namespace detail {

/// What a recovery from a backup's copies names in its errors.
constexpr const char* kRecoverFromBackup = "recover_lost_owners";

/// One change of a copy: `values` replaces the whole copy when `rows` is undefined; otherwise
/// values[i] is the copy's row rows[i] (a copy that was never sent whole is an error).
struct MirrorUpdate {
  std::string key;
  at::Tensor rows;
  at::Tensor values;
};

/// A primary optimizer's replication: the backup, the keys of its parameters' copies and whose
/// state it sends. Used under the optimizer's lock.
class MirrorLink {
 public:
  /// `param_keys`: one per parameter of the optimizer, in its order; `state_owner`: the trainer
  /// whose optimizer this is (its state's copies are its own).
  /// `continue_without_backup`: steps go on, not copied, while the backup is lost
  /// (ReplicaOptions::continue_without_backup).
  MirrorLink(std::string backup, std::vector<std::string> param_keys, std::string state_owner,
             bool continue_without_backup);

  const std::string& backup() const { return backup_; }
  const std::string& state_owner() const { return state_owner_; }
  size_t size() const { return param_keys_.size(); }
  const std::string& param_key(size_t index) const { return param_keys_[index]; }
  /// The key of state buffer `name` of parameter `index`, and of its step count.
  std::string state_key(size_t index, const std::string& name) const;
  std::string step_key(size_t index) const;

  /// Whether `key` was sent whole by this link (a copy must be before it takes rows).
  bool sent_whole(const std::string& key) const { return sent_whole_.count(key) > 0; }
  /// Sends `updates` (one call, applied all or nothing on the backup) and waits for the answer;
  /// then notes the whole ones as sent. Throws what the call throws.
  void send(std::vector<MirrorUpdate> updates);
  /// Whether everything was sent whole to the backup's current incarnation (and no send failed
  /// since): otherwise the next step sends everything whole first. c10::ValueError naming the
  /// backup when it is no member of the group now.
  bool in_sync() const;
  /// Everything was sent whole to incarnation `backup_id` of the backup.
  void note_synced(int backup_id) {
    synced_to_ = backup_id;
    lost_id_.reset();
    uncopied_steps_ = 0;
  }
  /// The backup's copy under `key` is whole and current (a restore read it): rows may follow.
  void note_sent_whole(const std::string& key) { sent_whole_.insert(key); }
  /// After a failed send: everything goes whole next (the backup may be a new incarnation).
  void forget_sent();
  bool continue_without_backup() const { return continue_without_backup_; }
  /// Whether the backup is lost: no member has its name, or its incarnation is the one a send
  /// failed to as lost (note_lost).
  bool backup_lost() const;
  /// A send failed as lost: the backup's current incarnation is lost for good.
  void note_lost();
  /// A step went on without the backup (continue_without_backup); how many did since everything
  /// last went whole.
  void note_uncopied_step() { ++uncopied_steps_; }
  int64_t uncopied_steps() const { return uncopied_steps_; }

 private:
  std::string backup_;
  std::vector<std::string> param_keys_;
  std::string state_owner_;
  std::set<std::string> sent_whole_;
  int synced_to_ = -1;  // the backup's worker id when everything was sent whole; -1: not in sync
  bool continue_without_backup_;
  std::optional<int> lost_id_;  // the backup's incarnation a send failed to as lost
  int64_t uncopied_steps_ = 0;
};

/// The id of the member named `name`; nullopt when none is.
std::optional<int> member_id(const std::string& name);

/// Registers the backup's functions (once, at start-up).
bool register_step_mirror();

/// The backup's side, read through rpc (replicas.h): the keys of `primary`'s copies held on
/// `backup`, and one copy (undefined when there is none).
std::vector<std::string> mirrored_keys(const std::string& backup, const std::string& primary);
at::Tensor mirrored_copy(const std::string& backup, const std::string& primary,
                         const std::string& key);
/// Drops the copies of trainer `trainer`'s optimizer state that `primary` sent to `backup` (a
/// dead trainer's, once its successor took them over); returns how many were dropped.
int64_t drop_mirrored_state(const std::string& backup, const std::string& primary,
                            const std::string& trainer);

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
