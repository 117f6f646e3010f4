#pragma once

// The writes of an owner's snapshot files that go on after the owner answered: a snapshot's owner
// answers its first call once its copy is taken, with a ticket, so that the trainer sends its next
// step only then (the snapshot is a cut of that trainer's steps), and a second call with the ticket
// once the files are written (snapshot.h).

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "snapshot_files.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

class SnapshotWrites {
 public:
  /// A write whose ticket was not claimed this long after it ended is forgotten: its trainer was
  /// lost between its two calls (a live one claims it as soon as every owner has copied).
  static constexpr std::chrono::minutes kUnclaimedLifetime{10};

  SnapshotWrites() = default;
  SnapshotWrites(const SnapshotWrites&) = delete;
  SnapshotWrites& operator=(const SnapshotWrites&) = delete;
  /// Waits for every write still going on.
  ~SnapshotWrites();

  /// c10::ValueError naming `disk_share` and `worker` unless 0 < disk_share <= 1 (a value from
  /// the wire: NaN and infinities included).
  static void check_disk_share(double disk_share, const std::string& worker);
  /// Starts `write` on a LowPriorityThread; returns its ticket. What it returns (or throws) is
  /// what claim(ticket)'s future completes with. Its writes around the page cache go 4 MiB at a
  /// time (kSnapshotMaxDirectWriteBytes), each followed by a rest that keeps the disk busy with
  /// them `disk_share` of the time (SnapshotOptions::disk_share; checked by the caller).
  int64_t start(double disk_share, std::function<c10::IValue()> write);
  /// The copy the write reads failed: waits for the write to end and forgets it.
  void drop(int64_t ticket);
  /// The future of the write numbered `ticket`, which completes once it is written; each ticket
  /// is claimed once. Also forgets the writes claimed before that have ended, and those unclaimed
  /// too long. c10::ValueError naming the ticket and `worker` for one not started here,
  /// claimed before, or forgotten.
  c10::intrusive_ptr<c10::ivalue::Future> claim(int64_t ticket, const std::string& worker);

 private:
  struct Write {
    c10::intrusive_ptr<c10::ivalue::Future> written;
    std::chrono::steady_clock::time_point ended;  // set by the thread before `written` completes
    bool claimed = false;
    std::unique_ptr<LowPriorityThread> thread;  // last: destroyed (joined) first
  };
  /// Takes out the writes that ended and were claimed, or went unclaimed too long (their threads
  /// at their ends, joined when the last reference goes). Under mutex_.
  std::vector<std::shared_ptr<Write>> take_ended();

  std::mutex mutex_;
  int64_t next_ticket_ = 0;
  std::map<int64_t, std::shared_ptr<Write>> writes_;
};

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
