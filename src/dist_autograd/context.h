#pragma once

// A worker's copy of a distributed autograd context, and the container of all of them.

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <distoptim/dist_autograd/detail/gradients.h>
#include <distoptim/rpc/detail/reassigned_rows.h>

#include "functions.h"

namespace distoptim {
namespace dist_autograd {
namespace detail {

class BackwardPass;

/// a + b for two gradients of one tensor, either of them sparse COO (sparse + sparse stays
/// sparse, as in LibTorch's engine).
at::Tensor add_gradients(const at::Tensor& a, const at::Tensor& b);

/// What one worker knows of a context: the send/recv nodes its messages recorded here, the
/// workers it exchanged messages with, the leaf gradients of its backward passes, and the pass
/// running now. Thread-safe.
class Context : public std::enable_shared_from_this<Context> {
 public:
  explicit Context(int64_t id) : id_(id) {}

  int64_t id() const { return id_; }
  /// The worker that created it.
  int creator() const { return static_cast<int>(id_ >> 48); }

  void add_send(std::shared_ptr<SendBackward> send);
  void add_recv(std::shared_ptr<RecvBackward> recv);
  void add_worker(int worker);
  std::vector<std::shared_ptr<SendBackward>> sends() const;
  std::vector<std::shared_ptr<RecvBackward>> recvs() const;
  std::set<int> workers() const;

  /// Adds `grad` to the gradient of the leaf `variable`, in the pass that began here at `pin`'s
  /// position in the rows handed to new keys (rpc/detail/reassigned_rows.h): a sparse gradient
  /// then leaves out, from what earlier passes added, the rows handed out since their start, and
  /// its step leaves out those handed out from `pin`'s position on (reached_gradients).
  void accumulate(const at::Tensor& variable, at::Tensor grad,
                  const std::shared_ptr<const rpc::detail::ReassignedRowsPin>& pin = nullptr);
  c10::Dict<at::Tensor, at::Tensor> gradients() const;
  /// The gradients, with what a step needs to leave out the rows handed to new keys since.
  ReachedGradients reached_gradients() const;
  /// The gradient of `variable`, or an undefined tensor.
  at::Tensor gradient(const at::Tensor& variable) const;
  /// Replaces the gradient of `variable`.
  void set_gradient(const at::Tensor& variable, at::Tensor grad);

  /// Work the next backward pass on this worker runs once it has run all its nodes here; the
  /// pass completes when the returned future does (DistributedDataParallel's gradient reduction,
  /// through data_parallel's GradientStore).
  using PassCallback = std::function<c10::intrusive_ptr<c10::ivalue::Future>()>;
  /// Work the next backward pass on this worker runs right after it accumulated the gradient of
  /// `variable` (DistributedDataParallel launching a bucket).
  void add_gradient_listener(const at::Tensor& variable, std::function<void()> listener);
  /// The listeners added so far, by the variable's TensorImpl, removed from the context.
  std::unordered_map<const c10::TensorImpl*, std::vector<std::function<void()>>>
  take_gradient_listeners();
  void add_pass_callback(PassCallback callback);
  /// The callbacks added so far, removed from the context.
  std::vector<PassCallback> take_pass_callbacks();

  /// The pass `pass_id` (numbered as begin_pass does): the running one, a new one if
  /// `pass_id` is newer than any seen (an older unfinished one is failed), or null if it is a
  /// pass already finished here. `*started` tells whether this call made it.
  std::shared_ptr<BackwardPass> pass_for(int64_t pass_id, bool retain_graph, bool* started);
  /// The running pass, if any.
  std::shared_ptr<BackwardPass> running_pass() const;
  /// Called by a pass when it finishes, however it ends.
  void end_pass(const BackwardPass* pass);
  /// On the worker `initiator` that starts a pass (the creator, or the owner of an RRef whose
  /// backward runs there): a new pass numbered after every pass seen here, or null while one
  /// still runs (checked and started under one lock, so two concurrent backward calls cannot both
  /// start). A pass id is (count << 16 | initiator): two workers starting passes never number
  /// them alike, and every worker a pass reaches counts on from it.
  std::shared_ptr<BackwardPass> begin_pass(bool retain_graph, int initiator);

 private:
  const int64_t id_;
  mutable std::mutex mutex_;
  std::map<int64_t, std::shared_ptr<SendBackward>> sends_;  // by message id
  std::vector<std::shared_ptr<RecvBackward>> recvs_;
  std::set<int> workers_;
  c10::Dict<at::Tensor, at::Tensor> gradients_;
  // Of each sparse gradient, the start of the last pass that added to it (ReachedGradients), and
  // the first such pass's pin, the oldest position: it keeps the rows handed out since.
  std::unordered_map<const c10::TensorImpl*, int64_t> reassigned_from_;
  std::shared_ptr<const rpc::detail::ReassignedRowsPin> reassigned_pin_;
  std::vector<PassCallback> pass_callbacks_;
  // With the variable, so that the TensorImpl stays the same object until a pass takes them.
  std::vector<std::pair<at::Tensor, std::function<void()>>> gradient_listeners_;
  std::shared_ptr<BackwardPass> pass_;
  int64_t newest_pass_ = 0;
};

/// Every context this worker holds, by id; process-wide. Thread-safe.
class Container {
 public:
  static Container& instance();

  /// A new context created by this worker (`worker_id`).
  std::shared_ptr<Context> create(int worker_id);
  std::shared_ptr<Context> find(int64_t id) const;
  /// The context `id` as a worker that received one of its messages joins it: found or made.
  /// c10::ValueError if it was released here.
  std::shared_ptr<Context> join(int64_t id);
  /// The context `id` if this worker holds it, null if it never reached this worker; as join,
  /// c10::ValueError if it was released here. Makes nothing.
  std::shared_ptr<Context> find_unreleased(int64_t id) const;
  /// Removes the context; later messages of it are refused. Null if it was not here.
  std::shared_ptr<Context> release(int64_t id);
  /// Removes every context `worker` created (it is gone).
  std::vector<std::shared_ptr<Context>> release_created_by(int worker);
  /// Removes every context and forgets the released ids: the group they belonged to is gone and
  /// the next one's workers start their ids again. New contexts keep counting up, so a guard
  /// still held from before never releases one of them.
  std::vector<std::shared_ptr<Context>> release_all();
  std::vector<std::shared_ptr<Context>> all() const;
  size_t size() const;

  /// A message id unique across the group: `worker_id << 48 | n`.
  int64_t next_message_id(int worker_id);

  /// While this worker serves a request of a context, its response belongs to it too.
  void serving(int caller, uint64_t call_id, int64_t context_id);
  std::optional<int64_t> served(int caller, uint64_t call_id);

 private:
  // Released ids are remembered up to this many, the oldest forgotten first.
  static constexpr size_t kRememberedReleases = 1 << 16;

  void forget_served(int64_t context_id);
  std::shared_ptr<Context> find_unreleased_locked(int64_t id) const;  // mutex_ held

  // Lock order: mutex_, then serving_mutex_.
  mutable std::mutex mutex_;
  std::unordered_map<int64_t, std::shared_ptr<Context>> contexts_;  // guarded by mutex_
  std::unordered_set<int64_t> released_;                            // guarded by mutex_
  std::deque<int64_t> release_order_;                               // guarded by mutex_
  int64_t next_context_ = 0;                                        // guarded by mutex_
  std::atomic<int64_t> next_message_{0};
  // Every response this worker sends asks served(): the table has a lock of its own, taken only
  // while some request of a context is being served (serving_size_ > 0), so calls made outside
  // contexts take no lock here.
  std::mutex serving_mutex_;
  std::map<std::pair<int, uint64_t>, int64_t> serving_;  // guarded by serving_mutex_
  std::atomic<size_t> serving_size_{0};                  // serving_.size()
};

/// This thread's current context id.
std::optional<int64_t>& current_context();

/// Makes a context current on this thread while it lives.
class CurrentContextScope {
 public:
  explicit CurrentContextScope(std::optional<int64_t> id) : previous_(current_context()) {
    current_context() = id;
  }
  ~CurrentContextScope() { current_context() = previous_; }
  CurrentContextScope(const CurrentContextScope&) = delete;
  CurrentContextScope& operator=(const CurrentContextScope&) = delete;

 private:
  std::optional<int64_t> previous_;
};

}  // namespace detail
}  // namespace dist_autograd
}  // namespace distoptim
