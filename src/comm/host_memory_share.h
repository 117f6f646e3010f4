#pragma once

// What every copy of a Group shares about its shared memory (internal to the comm layer).

#include <mutex>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace distoptim {
namespace comm {

/// share_host_memory's answer for one group, found once (collectively) and kept while any copy
/// of the group lives. Holds the shared-memory process group, never a Group: the Group it
/// returns points back here.
struct HostMemoryShare {
  std::mutex mutex;
  bool decided = false;                           // guarded by mutex
  c10::intrusive_ptr<c10d::ProcessGroup> shared;  // null when decided against; guarded by mutex
};

}  // namespace comm
}  // namespace distoptim
