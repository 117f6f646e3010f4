#pragma once

// Shared memory between the members of a group on one host, and the barrier that orders their
// use of it (internal to the comm layer; host_memory_group.cpp runs collectives over it).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace distoptim {
namespace comm {

/// Every member maps one segment of its own and the segments of the others. A segment holds a
/// header (who made it), the member's barrier counter and two slots of `slot_bytes`, used in
/// turn by consecutive pieces of the collectives (so a piece is written while the previous one
/// may still be read).
///
/// Trust: only members of the group (processes of the same user, which already exchange
/// tensors over Gloo) can map the segments; a segment's header is checked when it is mapped.
/// Cleanup: each segment's name is removed as soon as every member has mapped them all, so
/// nothing is left in /dev/shm once the channel is open, whatever happens to the processes
/// afterwards (a member killed while the group is being opened can leave its segment behind).
/// Thread safety: one thread at a time uses a channel.
class HostMemoryChannel {
 public:
  /// Collective over `gloo` (every member calls it, at the same point of the group's sequence of
  /// collectives). Returns null on every member when some member could not map the others'
  /// segments (another host, another /dev/shm, no space), all members deciding alike.
  /// `ranks` are the members' global ranks (for errors), `group_rank` this process's.
  static std::unique_ptr<HostMemoryChannel> open(c10d::ProcessGroup& gloo,
                                                 const std::vector<int>& ranks, int group_rank,
                                                 std::chrono::milliseconds timeout,
                                                 size_t slot_bytes);
  ~HostMemoryChannel();
  HostMemoryChannel(const HostMemoryChannel&) = delete;
  HostMemoryChannel& operator=(const HostMemoryChannel&) = delete;

  int size() const { return static_cast<int>(ranks_.size()); }
  int rank() const { return group_rank_; }
  const std::vector<int>& ranks() const { return ranks_; }
  size_t slot_bytes() const { return slot_bytes_; }
  /// Slot `which` (0 or 1) of member `member`'s segment.
  uint8_t* slot(int member, int which) const;

  /// Arrives at the next barrier and waits until every member has arrived at it, at most
  /// `timeout`. Throws distoptim::TimeoutError naming the global ranks that never arrived,
  /// or distoptim::PeerLostError naming one whose process is gone, each starting with `what`.
  /// After a failure the channel is broken: every later call throws at once.
  void barrier(const std::string& what, std::chrono::milliseconds timeout);

 private:
  HostMemoryChannel(std::vector<int> ranks, int group_rank, size_t slot_bytes);
  bool map_peers(const std::string& prefix, uint64_t token);
  bool peer_alive(int member) const;

  std::vector<int> ranks_;
  int group_rank_;
  size_t slot_bytes_;
  size_t segment_bytes_;
  std::vector<uint8_t*> segments_;  // by group rank; null where not mapped
  uint32_t barriers_ = 0;           // barriers this member has arrived at
  std::string broken_;              // the failure that broke the channel, empty while it works
  bool broken_by_timeout_ = false;
};

}  // namespace comm
}  // namespace distoptim
