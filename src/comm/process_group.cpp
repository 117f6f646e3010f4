#include <distoptim/comm/process_group.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <mutex>
#include <set>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <gloo/common/error.h>
#include <gloo/transport/tcp/address.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <distoptim/comm/errors.h>
#include <distoptim/comm/store_round.h>
#include <distoptim/comm/store_wait.h>

#include "host_memory_share.h"
#include "named_failure_group.h"
#include "sigpipe_blocked.h"

namespace distoptim {
namespace comm {

namespace {

using Clock = std::chrono::steady_clock;

// The default group and what new groups are made from. Guarded by `state_mutex`; a Group handed
// out is an immutable copy, so collectives never take this lock.
struct DefaultState {
  Rendezvous rendezvous;
  Group world;
  std::string gloo_hostname;
  // Every rank numbers its new_group calls the same way: the number keys the group's store.
  int64_t groups_made = 0;
};

std::mutex state_mutex;
std::unique_ptr<DefaultState> state;

DefaultState& initialized_state(const char* caller) {
  TORCH_CHECK_VALUE(state != nullptr, caller,
                    ": the default process group is not initialized; call "
                    "distoptim::comm::init_process_group first");
  return *state;
}

// The global ranks among `ranks` (by group rank) whose Gloo address appears in `gloo_text`, a
// failed connect's message ("connect [127.0.0.1]:54706: Connection refused"). Each member
// publishes the addresses of its pairs, one per peer, under "<prefix>/0/<group rank>" (c10d's
// PrefixStore joins with '/', c10d's Gloo group adds the device number): they are read back and
// formatted by Gloo itself. A member whose key is absent or unreadable is not named.
std::vector<int> ranks_at_address(DeadlineStore& store, const std::string& prefix,
                                  const std::vector<int>& ranks, int group_rank,
                                  const std::string& gloo_text, Clock::time_point deadline) {
  const size_t entry_size = ::gloo::transport::tcp::Address().bytes().size();
  std::vector<int> found;
  for (int r = 0; r < static_cast<int>(ranks.size()); ++r) {
    const std::string key = prefix + "/0/" + std::to_string(r);
    if (r == group_rank || !store.check({key}, deadline)) continue;
    const std::vector<uint8_t> bytes = store.get(key, deadline);
    for (size_t at = 0; at + entry_size <= bytes.size(); at += entry_size) {
      std::string address;
      try {
        address = ::gloo::transport::tcp::Address(
                      std::vector<char>(bytes.begin() + at, bytes.begin() + at + entry_size))
                      .str();
      } catch (const std::exception&) {
        continue;
      }
      // "[127.0.0.1]:1" must not match "[127.0.0.1]:1234".
      const size_t pos = gloo_text.find(address);
      if (pos == std::string::npos) continue;
      const size_t end = pos + address.size();
      if (end == gloo_text.size() || std::isdigit(gloo_text[end]) == 0) {
        found.push_back(ranks[r]);
        break;
      }
    }
  }
  return found;
}

// Throws Gloo's failure `e` to connect the group as a distoptim error naming the ranks it could
// not reach: TimeoutError for a connect that ran out of time, PeerLostError for one refused or
// broken, DistributedError for anything else. Gloo's exceptions are not c10::Errors: let
// through, they pass handlers written for LibTorch's errors and end the process (std::terminate).
[[noreturn]] void throw_connect_failure(DeadlineStore& store, const std::string& caller,
                                        const std::string& prefix, const std::vector<int>& ranks,
                                        int group_rank, std::chrono::milliseconds timeout,
                                        const std::exception& e) {
  const std::string gloo_text = e.what();
  const std::string head = caller + ": connecting the Gloo group " + ranks_text(ranks) +
                           " failed at rank " + std::to_string(ranks[group_rank]) + ": ";
  if (dynamic_cast<const ::gloo::IoException*>(&e) == nullptr) {
    DISTOPTIM_THROW(DistributedError, head, "Gloo: ", gloo_text);
  }
  std::vector<int> unreachable;
  try {
    unreachable =
        ranks_at_address(store, prefix, ranks, group_rank, gloo_text,
                         Clock::now() + std::min(timeout, std::chrono::milliseconds(2000)));
  } catch (const c10::Error&) {
    // The store is gone too: the error says no rank could be singled out.
  }
  const std::string culprits = unreachable.empty()
                                   ? "the peer's rank is not known"
                                   : "could not reach rank" +
                                         std::string(unreachable.size() > 1 ? "s " : " ") +
                                         c10::Join(", ", unreachable);
  // Gloo's words for a connect that ran out of time: "Connect timeout", "Timed out".
  const bool timed_out = gloo_text.find("timeout") != std::string::npos ||
                         gloo_text.find("Timeout") != std::string::npos ||
                         gloo_text.find("Timed out") != std::string::npos;
  if (timed_out) {
    // Gloo waits up to 5 times its timeout for a pair to connect (tcp/pair.h, Pair::waitUntil).
    DISTOPTIM_THROW(TimeoutError, head,
                    "timed out (Gloo waits up to 5 times the group's timeout of ", timeout.count(),
                    " ms to connect); ", culprits, "; Gloo: ", gloo_text);
  }
  DISTOPTIM_THROW(PeerLostError, head, culprits, "; Gloo: ", gloo_text);
}

// A Gloo group of the global ranks `ranks` (this process is `group_rank` among them). Gloo meets
// its peers through a PrefixStore over the rendezvous's DeadlineStore: its store operations too
// end by the rendezvous timeout. The same store, under `prefix + "failures/"`, is where members
// report a failed collective, so that its error names the ranks at fault (named_failure_group.h).
// `caller` names the call in errors.
c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_group(
    const c10::intrusive_ptr<DeadlineStore>& store, const std::string& caller,
    const std::string& prefix, const std::vector<int>& ranks, int group_rank,
    std::chrono::milliseconds timeout, const std::string& hostname) {
  // Gloo's device thread and c10d's worker threads start here and keep this thread's mask.
  const detail::SigpipeBlocked sigpipe_blocked;
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
  try {
    gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>(prefix, store), group_rank,
        static_cast<int>(ranks.size()), options);
  } catch (const c10::Error&) {
    throw;  // the store's errors name who is missing already
  } catch (const std::exception& e) {
    throw_connect_failure(*store, caller, prefix, ranks, group_rank, timeout, e);
  }
  return name_failures(std::move(gloo),
                       FailureChannel{store, prefix + "failures/", ranks, group_rank, timeout});
}

// Checks every rank of the world passed the same `ranks` to the new_group call numbered `id`
// (each arrived in `round` with the ranks it passed), waiting for all of them at most `timeout`.
// Called by members only.
void agree_on_members(DeadlineStore& store, const StoreRound& round, const std::vector<int>& ranks,
                      Clock::time_point deadline, std::chrono::milliseconds timeout, int64_t id) {
  const std::vector<int> missing = round.wait_for_all(deadline);
  DISTOPTIM_CHECK_WITH(TimeoutError, missing.empty(), "new_group(ranks=", ranks_text(ranks),
                       ") (call #", id, "): rank ", round.rank(), " waited ", timeout.count(),
                       " ms; these ranks never called it: ", c10::Join(", ", missing));
  const std::string mine = ranks_text(ranks);
  const int my_rank = round.rank();
  for (int r = 0; r < round.world_size(); ++r) {
    const std::vector<uint8_t> bytes = store.get(round.arrival_key(r), deadline);
    const std::string theirs(bytes.begin(), bytes.end());
    TORCH_CHECK_VALUE(theirs == mine, "new_group (call #", id, "): rank ", r,
                      " passed ranks=", theirs, " but rank ", my_rank, " passed ranks=", mine,
                      "; every rank must make the same groups in the same order");
  }
}

}  // namespace

Group::Group(c10::intrusive_ptr<c10d::ProcessGroup> process_group, std::vector<int> ranks,
             int global_rank, std::chrono::milliseconds timeout)
    : process_group_(std::move(process_group)),
      host_memory_(std::make_shared<HostMemoryShare>()),
      ranks_(std::move(ranks)),
      timeout_(timeout) {
  const auto it = std::find(ranks_.begin(), ranks_.end(), global_rank);
  rank_ = it == ranks_.end() ? -1 : static_cast<int>(it - ranks_.begin());
  TORCH_INTERNAL_ASSERT(is_member() == static_cast<bool>(process_group_));
}

int Group::global_rank(int group_rank) const {
  TORCH_CHECK_INDEX(group_rank >= 0 && group_rank < size(),
                    "Group::global_rank: group_rank = ", group_rank, " is not in [0, ", size(),
                    ")");
  return ranks_[group_rank];
}

int Group::group_rank(int global_rank) const {
  const auto it = std::find(ranks_.begin(), ranks_.end(), global_rank);
  TORCH_CHECK_INDEX(it != ranks_.end(), "Group::group_rank: global rank ", global_rank,
                    " is not a member of the group ", ranks_text(ranks_));
  return static_cast<int>(it - ranks_.begin());
}

const c10::intrusive_ptr<c10d::ProcessGroup>& Group::process_group() const {
  return process_group_;
}

void Group::barrier() const {
  TORCH_CHECK_VALUE(is_member(), "Group::barrier: this rank is not a member of the group ",
                    ranks_text(ranks_));
  c10d::BarrierOptions options;
  options.timeout = timeout_;
  process_group_->barrier(options)->wait(timeout_);
}

void init_process_group(const ProcessGroupOptions& options) {
  TORCH_CHECK_VALUE(options.backend() == "gloo", "init_process_group: backend '", options.backend(),
                    "' is not available; this build has 'gloo' (CPU)");
  std::lock_guard<std::mutex> lock(state_mutex);
  TORCH_CHECK_VALUE(state == nullptr,
                    "init_process_group: the default process group is already initialized");
  // Every thread started from here on (rank 0's store server, Gloo's and c10d's) blocks SIGPIPE.
  const detail::SigpipeBlocked sigpipe_blocked;
  auto fresh = std::make_unique<DefaultState>();
  fresh->rendezvous = rendezvous(RendezvousOptions(options.init_method())
                                     .rank(options.rank())
                                     .world_size(options.world_size())
                                     .timeout(options.timeout())
                                     .launch_env(options.launch_env()));
  const Rendezvous& rdzv = fresh->rendezvous;
  fresh->gloo_hostname =
      options.gloo_hostname().empty() ? rdzv.local_address : options.gloo_hostname();
  std::vector<int> all(rdzv.world_size);
  for (int r = 0; r < rdzv.world_size; ++r) all[r] = r;
  fresh->world = Group(make_gloo_group(rdzv.store, "init_process_group", "world/", all, rdzv.rank,
                                       options.timeout(), fresh->gloo_hostname),
                       all, rdzv.rank, options.timeout());
  state = std::move(fresh);
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(state_mutex);
  return state != nullptr;
}

void destroy_process_group() {
  std::unique_ptr<DefaultState> dropped;
  {
    std::lock_guard<std::mutex> lock(state_mutex);
    dropped = std::move(state);
  }
}

const Group& world() {
  std::lock_guard<std::mutex> lock(state_mutex);
  return initialized_state("world").world;
}

int get_rank() {
  std::lock_guard<std::mutex> lock(state_mutex);
  return initialized_state("get_rank").rendezvous.rank;
}

int get_world_size() {
  std::lock_guard<std::mutex> lock(state_mutex);
  return initialized_state("get_world_size").rendezvous.world_size;
}

int get_local_rank() {
  std::lock_guard<std::mutex> lock(state_mutex);
  return initialized_state("get_local_rank").rendezvous.local_rank;
}

int get_local_world_size() {
  std::lock_guard<std::mutex> lock(state_mutex);
  return initialized_state("get_local_world_size").rendezvous.local_world_size;
}

c10::intrusive_ptr<DeadlineStore> default_store() {
  std::lock_guard<std::mutex> lock(state_mutex);
  return initialized_state("default_store").rendezvous.store;
}

Group new_group(std::vector<int> ranks, std::optional<std::chrono::milliseconds> timeout) {
  std::unique_lock<std::mutex> lock(state_mutex);
  DefaultState& s = initialized_state("new_group");
  const int world_size = s.rendezvous.world_size;
  const int my_rank = s.rendezvous.rank;
  if (ranks.empty()) {
    for (int r = 0; r < world_size; ++r) ranks.push_back(r);
  }
  std::set<int> seen;
  for (int r : ranks) {
    TORCH_CHECK_VALUE(r >= 0 && r < world_size, "new_group: rank ", r,
                      " in ranks=", ranks_text(ranks), " is not in [0, ", world_size, ")");
    TORCH_CHECK_VALUE(seen.insert(r).second, "new_group: rank ", r,
                      " appears twice in ranks=", ranks_text(ranks));
  }
  const std::chrono::milliseconds group_timeout = timeout.value_or(s.rendezvous.timeout);
  TORCH_CHECK_VALUE(group_timeout.count() > 0, "new_group: timeout = ", group_timeout.count(),
                    " ms; must be positive");
  // Group ranks follow global order, as PyTorch's new_group sorts its ranks.
  std::sort(ranks.begin(), ranks.end());
  const int64_t id = ++s.groups_made;
  const c10::intrusive_ptr<DeadlineStore> store = s.rendezvous.store;
  const std::string hostname = s.gloo_hostname;
  lock.unlock();  // the waits below may be long; the group number is already taken

  const std::string prefix = "group/" + std::to_string(id) + "/";
  const std::string announced = ranks_text(ranks);
  const auto deadline = Clock::now() + group_timeout;
  StoreRound round(*store, StoreRound::Keys::under(prefix + "ranks/"), my_rank, world_size);
  round.arrive(std::vector<uint8_t>(announced.begin(), announced.end()), deadline);
  const auto it = std::find(ranks.begin(), ranks.end(), my_rank);
  if (it == ranks.end()) return Group({}, ranks, my_rank, group_timeout);
  agree_on_members(*store, round, ranks, deadline, group_timeout, id);
  const int group_rank = static_cast<int>(it - ranks.begin());
  const std::string caller =
      "new_group(ranks=" + announced + ") (call #" + std::to_string(id) + ")";
  return Group(
      make_gloo_group(store, caller, prefix + "pg/", ranks, group_rank, group_timeout, hostname),
      ranks, my_rank, group_timeout);
}

std::pair<Group, std::vector<Group>> new_subgroups(std::optional<int> group_size) {
  std::vector<std::vector<int>> ranks_per_subgroup;
  {
    std::lock_guard<std::mutex> lock(state_mutex);
    const Rendezvous& rdzv = initialized_state("new_subgroups").rendezvous;
    if (group_size.has_value()) {
      TORCH_CHECK_VALUE(*group_size >= 1 && *group_size <= rdzv.world_size,
                        "new_subgroups: group_size = ", *group_size, " is not in [1, ",
                        rdzv.world_size, "]");
      TORCH_CHECK_VALUE(rdzv.world_size % *group_size == 0, "new_subgroups: world size ",
                        rdzv.world_size, " is not a multiple of group_size = ", *group_size);
      for (int first = 0; first < rdzv.world_size; first += *group_size) {
        std::vector<int> ranks(*group_size);
        for (int i = 0; i < *group_size; ++i) ranks[i] = first + i;
        ranks_per_subgroup.push_back(std::move(ranks));
      }
    } else {
      // One subgroup per host, in the order hosts first appear among the ranks.
      std::map<std::string, size_t> subgroup_of_host;
      for (int r = 0; r < rdzv.world_size; ++r) {
        const auto inserted = subgroup_of_host.emplace(rdzv.hosts[r], ranks_per_subgroup.size());
        if (inserted.second) ranks_per_subgroup.emplace_back();
        ranks_per_subgroup[inserted.first->second].push_back(r);
      }
    }
  }
  return new_subgroups_by_enumeration(ranks_per_subgroup);
}

std::pair<Group, std::vector<Group>> new_subgroups_by_enumeration(
    const std::vector<std::vector<int>>& ranks_per_subgroup) {
  TORCH_CHECK_VALUE(!ranks_per_subgroup.empty(),
                    "new_subgroups_by_enumeration: ranks_per_subgroup is empty");
  {
    std::lock_guard<std::mutex> lock(state_mutex);
    initialized_state("new_subgroups_by_enumeration");
  }
  std::set<int> seen;
  for (size_t g = 0; g < ranks_per_subgroup.size(); ++g) {
    TORCH_CHECK_VALUE(!ranks_per_subgroup[g].empty(), "new_subgroups_by_enumeration: subgroup ", g,
                      " is empty");
    for (int r : ranks_per_subgroup[g]) {
      TORCH_CHECK_VALUE(seen.insert(r).second, "new_subgroups_by_enumeration: rank ", r,
                        " is in more than one subgroup (again in subgroup ", g, ")");
    }
  }
  Group mine;
  std::vector<Group> subgroups;
  for (const auto& ranks : ranks_per_subgroup) {
    subgroups.push_back(new_group(ranks));
    if (subgroups.back().is_member()) mine = subgroups.back();
  }
  return {mine, subgroups};
}

}  // namespace comm
}  // namespace distoptim
