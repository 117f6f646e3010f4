#pragma once

// A process group whose failed collectives name the ranks at fault (internal to the comm layer).

#include <chrono>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <distoptim/comm/store_wait.h>

namespace distoptim {
namespace comm {

/// What the members of a group need to tell each other, after a failure, which of them are
/// still there: the store the group met through and a key prefix of its own on it.
struct FailureChannel {
  c10::intrusive_ptr<DeadlineStore> store;
  /// Failure reports live under this prefix (unique to the group on `store`).
  std::string key_prefix;
  /// The global rank of every member, by group rank.
  std::vector<int> ranks;
  int group_rank = -1;
  /// The group's timeout; the grace after a failure is min(timeout, 2 s).
  std::chrono::milliseconds timeout{0};
};

/// Wraps `inner` (Gloo) so that every Work it returns fails, in `wait`, `exception` and the
/// future of `getFuture`, with a distoptim error that names the global ranks at fault and keeps
/// Gloo's text as detail: PeerLostError for a broken connection, TimeoutError for a collective
/// that ran out of time, DistributedError for anything else. See named_failure_group.cpp for
/// how the ranks at fault are found. Errors thrown when a collective is issued (bad arguments)
/// pass through unchanged.
c10::intrusive_ptr<c10d::ProcessGroup> name_failures(c10::intrusive_ptr<c10d::ProcessGroup> inner,
                                                     FailureChannel channel);

/// Global ranks as the errors print them: "[0, 2]".
std::string ranks_text(const std::vector<int>& ranks);

}  // namespace comm
}  // namespace distoptim
