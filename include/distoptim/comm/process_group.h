#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <distoptim/comm/rendezvous.h>

namespace distoptim {
namespace comm {

/// A set of ranks that run collectives together: LibTorch's c10d::ProcessGroup (Gloo) and the
/// global ranks of its members. A rank outside the group holds a Group with `is_member()` false
/// that still knows the members (PyTorch's NON_GROUP_MEMBER carries nothing).
///
/// Thread safety: a Group is an immutable handle and may be copied and read from any thread;
/// collectives on it follow c10d's rules (issued in the same order on every member).
/// Blocking and timeouts: collectives wait at most `timeout()`, then fail on every member.
/// Errors: a collective of `process_group()` whose peer died fails, in its Work's `wait`,
/// `exception` and `getFuture`, with distoptim::PeerLostError, one some member never reached
/// with distoptim::TimeoutError, each naming the global ranks at fault and keeping Gloo's text;
/// finding them costs up to min(timeout(), 2 s) after the failure (see docs/errors.md).
struct HostMemoryShare;
class Group;
Group share_host_memory(const Group& group, size_t slot_bytes);

class Group {
 public:
  Group() = default;
  Group(c10::intrusive_ptr<c10d::ProcessGroup> process_group, std::vector<int> ranks,
        int global_rank, std::chrono::milliseconds timeout);

  bool is_member() const { return rank_ >= 0; }
  /// This process's rank in the group; -1 outside it.
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  /// The global rank of every member, by group rank.
  const std::vector<int>& ranks() const { return ranks_; }
  /// Throws c10::IndexError naming the rank when it is not in the group.
  int global_rank(int group_rank) const;
  int group_rank(int global_rank) const;
  std::chrono::milliseconds timeout() const { return timeout_; }
  /// The c10d process group (null outside the group): allreduce, broadcast, ... on it.
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const;

  /// Blocks until every member has called it (at most `timeout()`).
  void barrier() const;

 private:
  friend Group share_host_memory(const Group& group, size_t slot_bytes);

  c10::intrusive_ptr<c10d::ProcessGroup> process_group_;
  // The group's shared memory once share_host_memory made it, shared by every copy.
  std::shared_ptr<HostMemoryShare> host_memory_;
  std::vector<int> ranks_;
  int rank_ = -1;
  std::chrono::milliseconds timeout_{0};
};

/// torch.distributed.init_process_group's arguments. Only the "gloo" backend exists here (CPU).
struct ProcessGroupOptions {
  /* implicit */ ProcessGroupOptions(std::string init_method = "env://")
      : init_method_(std::move(init_method)) {}
  TORCH_ARG(std::string, backend) = "gloo";
  TORCH_ARG(std::string, init_method);
  TORCH_ARG(int, rank) = -1;
  TORCH_ARG(int, world_size) = -1;
  /// For the rendezvous and for every collective (PyTorch's default: 30 minutes).
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(30);
  /// The address (or hostname) Gloo listens on. Empty: Rendezvous::local_address, the address
  /// this host reaches the rendezvous address from (loopback when the ranks met on loopback).
  TORCH_ARG(std::string, gloo_hostname);
  TORCH_ARG(std::optional<LaunchEnv>, launch_env) = std::nullopt;
};

/// Meets the other ranks and creates the default group (torch.distributed.init_process_group).
/// Errors as `rendezvous`; c10::ValueError when already initialized or for another backend.
/// Not thread safe with the other functions of this header that touch the default group.
void init_process_group(const ProcessGroupOptions& options = {});
bool is_initialized();
/// Drops the default group and every group made from it (their handles stay valid but their
/// collectives fail once the peers are gone).
void destroy_process_group();

/// The group of all ranks (torch.distributed.group.WORLD). Throws when not initialized.
const Group& world();
int get_rank();
int get_world_size();
/// This rank's position among the ranks on its host, and their number.
int get_local_rank();
int get_local_world_size();
/// The store the ranks met on, for layers that exchange small values (never for tensors). Its
/// operations end by a deadline (see DeadlineStore).
c10::intrusive_ptr<DeadlineStore> default_store();

/// A group of the given global ranks (torch.distributed.new_group). Collective: every rank of
/// the world calls it, in the same order as its other new_group calls, with the same list; a
/// rank that never calls it makes the others fail with distoptim::TimeoutError naming it, and a
/// different list is a c10::ValueError naming the rank that disagrees. Empty `ranks` means all.
Group new_group(std::vector<int> ranks = {},
                std::optional<std::chrono::milliseconds> timeout = std::nullopt);

/// `group` with its allreduce and reduce (ReduceOp::SUM) and broadcast of one dense CPU tensor
/// done through memory its members share, when every member runs on this host: each member
/// copies its data into a segment of its own once and the members reduce one share each from the
/// others' segments, where Gloo copies every byte through loopback TCP. Every other operation,
/// and Half tensors, still go to `group`'s Gloo; results are the same to rounding (the sum of a
/// share is in rank order, and every member gets the same bits: a reduce's root the allreduce's;
/// the other members' tensors are left as they were). DistributedDataParallel and
/// ZeroRedundancyOptimizer (its stage 2 reduces to the owners) use it by default.
///
/// Collective over `group` the first time it is called on `group` (or a copy of it); later calls
/// return the same group at once (DistributedDataParallel and ZeroRedundancyOptimizer on one
/// group share its memory), whatever their `slot_bytes`. Returns `group` itself on every member
/// when some member cannot map the others' memory (another host, another /dev/shm, no room in
/// it), or for a group of one.
/// Memory: 2 x `slot_bytes` per member in /dev/shm, once per group, reserved at once (collectives
/// larger than a slot go through in pieces); the segments' names are removed as soon as all members
/// have mapped them. Failures: a collective that a member never reaches fails with
/// distoptim::TimeoutError naming the global ranks missing after the collective's timeout (the
/// group's by default); one whose member's process is gone, with distoptim::PeerLostError
/// naming it within about 50 ms. Either breaks the shared memory: every later allreduce, reduce
/// or broadcast of the returned group fails at once.
/// Thread safety: as `group`'s; the shared-memory collectives run, in order, on a thread of the
/// returned group's own.
Group share_host_memory(const Group& group, size_t slot_bytes = size_t{4} << 20);

/// Splits the world into subgroups (torch.distributed.new_subgroups) and returns this rank's
/// subgroup and all of them. `group_size` consecutive ranks each (the world size must be a
/// multiple of it); by default one subgroup per host: the intra-node subgroups that
/// hierarchical averaging uses, which work on CPU (PyTorch's need CUDA). Collective.
std::pair<Group, std::vector<Group>> new_subgroups(std::optional<int> group_size = std::nullopt);

/// One subgroup per list of global ranks (torch.distributed.new_subgroups_by_enumeration);
/// the lists must not overlap. Collective.
std::pair<Group, std::vector<Group>> new_subgroups_by_enumeration(
    const std::vector<std::vector<int>>& ranks_per_subgroup);

}  // namespace comm
}  // namespace distoptim
