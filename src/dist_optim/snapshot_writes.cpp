#include "snapshot_writes.h"

#include <utility>
#include <vector>

#include <ATen/core/jit_type.h>
#include <c10/util/Exception.h>

#include "file_writer.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

SnapshotWrites::~SnapshotWrites() {
  // Each thread's destructor waits for it.
  std::lock_guard<std::mutex> lock(mutex_);
  writes_.clear();
}

void SnapshotWrites::check_disk_share(double disk_share, const std::string& worker) {
  TORCH_CHECK_VALUE(disk_share > 0 && disk_share <= 1, kSaveSnapshot, ": disk_share is ",
                    disk_share, " on worker '", worker, "'; it must be more than 0 and at most 1");
}

int64_t SnapshotWrites::start(double disk_share, std::function<c10::IValue()> write) {
  auto entry = std::make_shared<Write>();
  entry->written = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t ticket = next_ticket_++;
  writes_[ticket] = entry;
  // The thread holds its entry by a plain pointer: the entry owns the thread, so outlives it.
  Write* raw = entry.get();
  entry->thread = std::make_unique<LowPriorityThread>([written = entry->written, raw,
                                                       write = std::move(write), disk_share] {
    c10::IValue result;
    std::exception_ptr failure;
    try {
      // Busy `disk_share` of the time: a write of t, then a rest of (1 / share - 1) t.
      const optim::detail::ScopedWriteRests rests(1 / disk_share - 1, kSnapshotMaxDirectWriteBytes);
      result = write();
    } catch (...) {
      failure = std::current_exception();
    }
    raw->ended = std::chrono::steady_clock::now();
    // A claim's reply goes out from here (the future's callbacks run on this thread).
    if (failure) {
      written->setError(failure);
    } else {
      written->markCompleted(std::move(result));
    }
  });
  return ticket;
}

void SnapshotWrites::drop(int64_t ticket) {
  std::shared_ptr<Write> entry;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = writes_.find(ticket);
    if (it == writes_.end()) return;
    entry = std::move(it->second);
    writes_.erase(it);
  }
  entry->thread.reset();  // waits for it
}

c10::intrusive_ptr<c10::ivalue::Future> SnapshotWrites::claim(int64_t ticket,
                                                              const std::string& worker) {
  std::vector<std::shared_ptr<Write>> ended;  // joined after the lock is released
  c10::intrusive_ptr<c10::ivalue::Future> written;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ended = take_ended();
    auto it = writes_.find(ticket);
    TORCH_CHECK_VALUE(it != writes_.end() && !it->second->claimed, kSaveSnapshot, ": worker '",
                      worker, "' has no snapshot write numbered ", ticket,
                      " to claim (never begun, claimed before, or unclaimed for ",
                      kUnclaimedLifetime.count(), " minutes after it ended)");
    it->second->claimed = true;
    written = it->second->written;
  }
  return written;
}

std::vector<std::shared_ptr<SnapshotWrites::Write>> SnapshotWrites::take_ended() {
  std::vector<std::shared_ptr<Write>> ended;
  const auto now = std::chrono::steady_clock::now();
  for (auto it = writes_.begin(); it != writes_.end();) {
    const Write& write = *it->second;
    if (write.written->completed() && (write.claimed || now - write.ended > kUnclaimedLifetime)) {
      ended.push_back(std::move(it->second));
      it = writes_.erase(it);
    } else {
      ++it;
    }
  }
  return ended;
}

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
