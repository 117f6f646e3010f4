// share_host_memory: a group whose allreduce and reduce (sums) and broadcast go through memory
// its members share when they all run on one host.
//
// Why: on one host Gloo moves every byte through loopback TCP, which copies it into and out of
// the kernel and wakes the peer per message; for DDP's 25 MB buckets that is most of the cost of
// the allreduce. Here each member copies its data into its own segment once, the members
// reduce one share each straight from the others' segments, and each copies the others' reduced
// shares back, with two futex barriers per piece (host_memory_channel.h).
//
// Every member sends the same operations the same way: the choice between shared memory and
// Gloo depends only on what a valid collective has equal on every member (the operation, its
// reduction, the number of tensors, their device, layout and dtype), never on one member's
// strides or timing.

#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>
#include <distoptim/comm/process_group.h>

#include "forwarding_process_group.h"
#include "host_memory_channel.h"
#include "host_memory_share.h"
#include "named_failure_group.h"

namespace distoptim {
namespace comm {

namespace {

// A collective run by the group's worker thread: done through c10d's Work (wait, exception) and
// through its future (the tensors, as Gloo's futures hold them).
class HostMemoryWork : public c10d::Work {
 public:
  HostMemoryWork(int rank, c10d::OpType type, std::vector<at::Tensor> tensors, std::string what)
      : c10d::Work(rank, type),
        what_(std::move(what)),
        tensors_(std::move(tensors)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}

  // The future first, as Gloo does: whoever returns from wait() (DDP's Reducer, for the Join's
  // divisor) may read the future's value at once.
  void complete() {
    future_->markCompleted(c10::IValue(tensors_));
    finish();
  }
  void fail(const std::exception_ptr& error) {
    future_->setError(error);
    finish(error);
  }

  // "allreduce #3 over shared memory on group [0, 1] failed at rank 0": what its errors start with.
  const std::string& what() const { return what_; }
  std::vector<at::Tensor> result() override { return tensors_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  // A caller usually waits as long as the collective's own timeout, which started no later
  // (when the collective reached its barrier): the collective's error, which names the ranks
  // missing, is given the grace to come first.
  bool wait(std::chrono::milliseconds timeout) override {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      const auto done = [this] { return completed_; };
      if (timeout == ::kNoTimeout) {
        cv_.wait(lock, done);
      } else if (!cv_.wait_for(lock, timeout + std::min(timeout, kWaitGrace), done)) {
        DISTOPTIM_THROW(TimeoutError, what_, ": not done after waiting ", timeout.count(),
                        " ms (and a grace)");
      }
      if (exception_) std::rethrow_exception(exception_);
    }
    return true;
  }

 private:
  static constexpr std::chrono::milliseconds kWaitGrace{2000};

  const std::string what_;
  const std::vector<at::Tensor> tensors_;
  const c10::intrusive_ptr<c10::ivalue::Future> future_;
};

bool reducible(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
    case at::kDouble:
    case at::kBFloat16:
    case at::kByte:
    case at::kChar:
    case at::kShort:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;  // Half (and the rest) Gloo sums: not measured here yet
  }
}

bool dense_cpu(const std::vector<at::Tensor>& tensors) {
  return tensors.size() == 1 && tensors[0].device().is_cpu() && tensors[0].layout() == at::kStrided;
}

at::Tensor view_of(uint8_t* bytes, int64_t elements, at::ScalarType type) {
  return at::from_blob(bytes, {elements}, at::TensorOptions().dtype(type));
}

class HostMemoryProcessGroup : public ForwardingProcessGroup {
 public:
  HostMemoryProcessGroup(c10::intrusive_ptr<c10d::ProcessGroup> inner,
                         std::unique_ptr<HostMemoryChannel> channel,
                         std::chrono::milliseconds timeout)
      : ForwardingProcessGroup(std::move(inner)),
        channel_(std::move(channel)),
        timeout_(timeout),
        where_(c10::str(" over shared memory on group ", ranks_text(channel_->ranks()),
                        " failed at rank ", channel_->ranks()[channel_->rank()])),
        worker_([this] { run(); }) {}

  ~HostMemoryProcessGroup() override {
    std::deque<Job> left;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      left.swap(queue_);
    }
    ready_.notify_all();
    worker_.join();
    for (Job& job : left) {
      job.work->fail(std::make_exception_ptr(
          DistributedError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                           c10::str(job.work->what(), ": the group was destroyed before it ran"))));
    }
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    if (!dense_cpu(tensors) || opts.reduceOp != c10d::ReduceOp::SUM ||
        !reducible(tensors[0].scalar_type())) {
      return ForwardingProcessGroup::allreduce(tensors, opts);
    }
    return enqueue(
        c10d::OpType::ALLREDUCE, "allreduce", tensors, opts.timeout,
        [this](at::Tensor& flat, std::chrono::milliseconds timeout, const std::string& what) {
          reduce_sum(flat, kEveryMember, timeout, what);
        });
  }

  // ZeRO's stage 2 reduces each bucket to its owner: the allreduce's sums, copied to the root only.
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    if (!dense_cpu(tensors) || opts.rootTensor != 0 || opts.reduceOp != c10d::ReduceOp::SUM ||
        !reducible(tensors[0].scalar_type())) {
      return ForwardingProcessGroup::reduce(tensors, opts);
    }
    const int root = checked_root("reduce", opts.rootRank);
    return enqueue(
        c10d::OpType::REDUCE, "reduce", tensors, opts.timeout,
        [this, root](at::Tensor& flat, std::chrono::milliseconds timeout, const std::string& what) {
          reduce_sum(flat, root, timeout, what);
        });
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    if (!dense_cpu(tensors) || opts.rootTensor != 0) {
      return ForwardingProcessGroup::broadcast(tensors, opts);
    }
    const int root = checked_root("broadcast", opts.rootRank);
    return enqueue(
        c10d::OpType::BROADCAST, "broadcast", tensors, opts.timeout,
        [this, root](at::Tensor& flat, std::chrono::milliseconds timeout, const std::string& what) {
          broadcast_bytes(flat, root, timeout, what);
        });
  }

 private:
  using Body = std::function<void(at::Tensor&, std::chrono::milliseconds, const std::string& what)>;
  struct Job {
    c10::intrusive_ptr<HostMemoryWork> work;
    at::Tensor tensor;
    std::chrono::milliseconds timeout;
    Body body;
  };

  int checked_root(const char* name, int64_t root) const {
    TORCH_CHECK_VALUE(root >= 0 && root < getSize(), name, ": rootRank = ", root, " is not in [0, ",
                      getSize(), ") (group rank of ", channel_->ranks()[channel_->rank()], ")");
    return static_cast<int>(root);
  }

  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const char* name,
                                         const std::vector<at::Tensor>& tensors,
                                         std::chrono::milliseconds timeout, Body body) {
    auto work = c10::make_intrusive<HostMemoryWork>(getRank(), type, tensors,
                                                    c10::str(name, " #", ++collectives_, where_));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(Job{work, tensors[0], timeout == c10d::kUnsetTimeout ? timeout_ : timeout,
                           std::move(body)});
    }
    ready_.notify_one();
    return work;
  }

  void run() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (stopping_) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      try {
        // The pieces work on contiguous memory; a strided tensor goes through a copy.
        at::Tensor flat = job.tensor.is_contiguous() ? job.tensor : job.tensor.contiguous();
        job.body(flat, job.timeout, job.work->what());
        if (!flat.is_same(job.tensor)) job.tensor.copy_(flat);
      } catch (...) {
        job.work->fail(std::current_exception());
        continue;
      }
      job.work->complete();
    }
  }

  // Slot 0 or 1 for the next piece: consecutive pieces alternate, so a member may write a piece
  // while the others still read the previous one (each piece ends with a barrier every member
  // passes only after reading the one before).
  int next_slot() { return static_cast<int>(pieces_++ % 2); }

  static constexpr int kEveryMember = -1;

  // Sums `flat` over the members in place, piece by piece. Member m reduces share m of each
  // piece, adding the members' values in rank order, and the member `to` (every member, for
  // kEveryMember: an allreduce) copies the reduced shares from the reducers: those members end
  // with the same bits. The others' `flat` is left as it was (a reduce's input, which c10d leaves
  // undefined on them).
  void reduce_sum(at::Tensor& flat, int to, std::chrono::milliseconds timeout,
                  const std::string& what) {
    const int members = channel_->size();
    const int me = channel_->rank();
    const bool receives = to == kEveryMember || to == me;
    const at::ScalarType type = flat.scalar_type();
    const auto element = static_cast<int64_t>(flat.element_size());
    const int64_t per_piece = static_cast<int64_t>(channel_->slot_bytes()) / element;
    auto* data = static_cast<uint8_t*>(flat.data_ptr());
    const int64_t total = flat.numel();
    for (int64_t offset = 0; offset < total; offset += per_piece) {
      const int64_t length = std::min(per_piece, total - offset);
      // Shares start on 64-byte boundaries (16 floats) so the sums run on aligned vectors.
      const int64_t share = (length + members - 1) / members;
      const int64_t aligned_share = (share + 15) / 16 * 16;
      const auto begin = [&](int m) { return std::min(length, m * aligned_share); };
      const auto size = [&](int m) { return begin(m + 1) - begin(m); };
      uint8_t* piece = data + offset * element;
      const int which = next_slot();

      for (int m = 0; m < members; ++m) {
        if (m != me && size(m) > 0) {
          std::memcpy(channel_->slot(me, which) + begin(m) * element, piece + begin(m) * element,
                      size(m) * element);
        }
      }
      channel_->barrier(what, timeout);
      if (size(me) > 0) {
        // The sum lands in this member's own share of its slot (unused until now), then in
        // `flat`; the others copy it from the slot.
        uint8_t* mine = piece + begin(me) * element;
        const auto source = [&](int m) {
          return view_of(m == me ? mine : channel_->slot(m, which) + begin(me) * element, size(me),
                         type);
        };
        at::Tensor sum = view_of(channel_->slot(me, which) + begin(me) * element, size(me), type);
        at::add_out(sum, source(0), source(1));
        for (int m = 2; m < members; ++m) sum.add_(source(m));
        if (receives) std::memcpy(mine, sum.data_ptr(), size(me) * element);
      }
      channel_->barrier(what, timeout);
      if (!receives) continue;
      for (int m = 0; m < members; ++m) {
        if (m != me && size(m) > 0) {
          std::memcpy(piece + begin(m) * element, channel_->slot(m, which) + begin(m) * element,
                      size(m) * element);
        }
      }
    }
  }

  // Copies `flat` from member `root` to the others, piece by piece through the root's slots.
  void broadcast_bytes(at::Tensor& flat, int root, std::chrono::milliseconds timeout,
                       const std::string& what) {
    auto* data = static_cast<uint8_t*>(flat.data_ptr());
    const auto total = static_cast<size_t>(flat.numel()) * flat.element_size();
    for (size_t offset = 0; offset < total; offset += channel_->slot_bytes()) {
      const size_t length = std::min(channel_->slot_bytes(), total - offset);
      const int which = next_slot();
      if (channel_->rank() == root) std::memcpy(channel_->slot(root, which), data + offset, length);
      channel_->barrier(what, timeout);
      if (channel_->rank() != root) std::memcpy(data + offset, channel_->slot(root, which), length);
    }
  }

  // Fixed once built; the channel's slots and barriers, and pieces_, are the worker thread's.
  const std::unique_ptr<HostMemoryChannel> channel_;
  const std::chrono::milliseconds timeout_;
  const std::string where_;  // " over shared memory on group [0, 1] failed at rank 0"
  uint64_t pieces_ = 0;

  uint64_t collectives_ = 0;  // issuing thread (one at a time, by c10d's contract)
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Job> queue_;  // guarded by mutex_
  bool stopping_ = false;  // guarded by mutex_
  std::thread worker_;     // last: starts once the rest is built
};

}  // namespace

Group share_host_memory(const Group& group, size_t slot_bytes) {
  TORCH_CHECK_VALUE(group.is_member(), "share_host_memory: this rank is not a member of the group ",
                    ranks_text(group.ranks()));
  if (group.size() < 2) return group;
  HostMemoryShare& share = *group.host_memory_;
  std::lock_guard<std::mutex> lock(share.mutex);
  if (!share.decided) {
    std::unique_ptr<HostMemoryChannel> channel = HostMemoryChannel::open(
        *group.process_group(), group.ranks(), group.rank(), group.timeout(), slot_bytes);
    if (channel != nullptr) {
      share.shared = c10::make_intrusive<HostMemoryProcessGroup>(
          group.process_group(), std::move(channel), group.timeout());
    }
    share.decided = true;
  }
  if (!share.shared) return group;
  if (share.shared.get() == group.process_group().get()) return group;
  Group shared(share.shared, group.ranks(), group.global_rank(group.rank()), group.timeout());
  shared.host_memory_ = group.host_memory_;
  return shared;
}

}  // namespace comm
}  // namespace distoptim
