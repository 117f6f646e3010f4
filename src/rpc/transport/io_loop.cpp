// The I/O loop: its threads, the handoff of the loop to another thread while one runs a long
// job, and the requests run after a handler (io_loop.h).

#include "io_loop.h"

#include <algorithm>
#include <optional>
#include <utility>

#include <ATen/ThreadLocalState.h>
#include <asio/post.hpp>

#include <c10/util/Exception.h>

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

// The loop this thread leads, and where a handler leaves the job to run after it returns.
thread_local IoLoop* t_leading = nullptr;
thread_local std::function<void()>* t_after = nullptr;
// The loop this thread keeps while it runs a job, and that job's number.
thread_local IoLoop* t_keeping = nullptr;
thread_local uint64_t t_kept_job = 0;
// Whether this thread, outside every loop, leads t_leading (IoLoop::lead_left_loop_until).
thread_local bool t_outside = false;
// Set by a handler (leave_to_next_wait) on a thread that runs run_thread or leads from outside:
// whom the loop is to be left for.
thread_local std::shared_ptr<const IoLoop::NextWaiter> t_leave_for;

// The loops of the process, for an outside wait to find one left for it. Taken before a loop's
// own mutex, never while holding one.
struct LoopRegistry {
  std::mutex mutex;
  std::vector<IoLoop*> loops;
};
LoopRegistry& loop_registry() {
  static auto* registry = new LoopRegistry();  // never destroyed: loops may outlive statics
  return *registry;
}

}  // namespace

IoLoop::ThreadModes IoLoop::ThreadModes::current() {
  ThreadModes modes;
  c10::impl::LocalDispatchKeySet keys =
      c10::impl::tls_local_dispatch_key_set();  // raw_repr is not const
  modes.included_keys = keys.included_.raw_repr();
  modes.excluded_keys = keys.excluded_.raw_repr();
  const c10::AutogradState& autograd = c10::AutogradState::get_tls_state();
  modes.grad = autograd.get_grad_mode();
  modes.inference = autograd.get_inference_mode();
  modes.forward_grad = autograd.get_fw_grad_mode();
  const at::RecordFunctionTLS& record_functions = at::get_record_function_tls_();
  modes.record_functions = record_functions.tls_record_function_enabled_;
  const at::impl::SavedTensorDefaultHooksTLS& hooks = at::SavedTensorDefaultHooks::get_tls_state();
  modes.nothing_installed = record_functions.sorted_tls_callbacks_.empty() && hooks.stack.empty() &&
                            !hooks.disabled_error_message &&
                            c10::ThreadLocalDebugInfo::current() == nullptr &&
                            at::functorch::functorchTLSAccessor() == nullptr &&
                            c10::impl::TorchDispatchModeTLS::stack_len() == 0 &&
                            c10::impl::TorchDispatchModeTLS::get_mode() == nullptr &&
                            c10::impl::PythonDispatcherTLS::get_state() == nullptr &&
                            at::impl::PythonTorchFunctionTLS::stack_len() == 0 &&
                            at::impl::PythonTorchFunctionTLS::get_mode() == nullptr &&
                            !at::impl::PythonTorchFunctionTLS::is_disabled();
  return modes;
}

bool IoLoop::ThreadModes::same_as(const ThreadModes& other) const {
  return nothing_installed && other.nothing_installed && included_keys == other.included_keys &&
         excluded_keys == other.excluded_keys && grad == other.grad &&
         inference == other.inference && forward_grad == other.forward_grad &&
         record_functions == other.record_functions;
}

IoLoop::IoLoop(asio::io_context& io, int threads, std::chrono::microseconds long_job)
    : io_(io), long_job_(long_job), wake_(std::make_shared<Wake>()) {
  wake_->io = &io;
  {
    LoopRegistry& registry = loop_registry();
    std::lock_guard<std::mutex> lock(registry.mutex);
    registry.loops.push_back(this);
  }
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this] { run_thread(); });
  }
}

IoLoop::~IoLoop() {
  join();
  {
    LoopRegistry& registry = loop_registry();
    std::lock_guard<std::mutex> lock(registry.mutex);
    registry.loops.erase(std::find(registry.loops.begin(), registry.loops.end(), this));
  }
  {
    // An outside thread still leading leaves at once: the io_context has stopped.
    std::unique_lock<std::mutex> lock(mutex_);
    outside_left_.wait(lock, [this] { return outside_leaders_ == 0; });
  }
  std::lock_guard<std::mutex> lock(wake_->mutex);
  wake_->io = nullptr;
}

void IoLoop::wait_stopped() {
  std::unique_lock<std::mutex> lock(mutex_);
  stopped_cv_.wait(lock, [this] { return stopped_; });
}

void IoLoop::join() {
  for (std::thread& thread : threads_) {
    if (thread.joinable()) thread.join();
  }
}

bool IoLoop::can_run_after_handler() {
  IoLoop* loop = t_leading;
  if (loop == nullptr || t_after == nullptr || *t_after) {
    return false;
  }
  // While this thread leads, a waiting follower stays waiting: the answer holds until the
  // handler returns, and while the job keeps the loop (only a hand-over ends a follower's wait).
  std::lock_guard<std::mutex> lock(loop->mutex_);
  return loop->waiting_ > 0;
}

void IoLoop::run_after_handler(std::function<void()> job) {
  TORCH_INTERNAL_ASSERT(t_leading != nullptr && !*t_after && job);
  *t_after = std::move(job);
}

bool IoLoop::on_loop_thread() { return t_leading != nullptr || t_keeping != nullptr; }

void IoLoop::leave_to_next_wait(std::shared_ptr<const NextWaiter> waiter) {
  if (t_leading != nullptr && (t_after != nullptr || t_outside)) {
    t_leave_for = std::move(waiter);
  }
}

bool IoLoop::lead_until(const std::function<bool()>& done,
                        const std::function<void(std::function<void()>)>& arm,
                        std::optional<std::chrono::steady_clock::time_point> deadline) {
  IoLoop* loop = t_keeping;
  if (loop == nullptr) {
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(loop->mutex_);
    if (loop->kept_job_ != t_kept_job) {
      return false;  // A watching follower took the loop over.
    }
    loop->kept_job_ = 0;  // Led, not kept: no follower takes it over meanwhile.
  }
  t_leading = loop;  // t_after stays null: no job after a handler run here
  loop->run_handlers_until(done, arm, deadline);
  t_leading = nullptr;
  std::unique_lock<std::mutex> lock(loop->mutex_);
  if (loop->io_.stopped()) {
    loop->stop_locked(lock);
    return true;
  }
  // Kept again by the job that waited, which may now block elsewhere: someone must watch it.
  t_kept_job = loop->keep_locked(lock);
  return true;
}

void IoLoop::run_handlers_until(const std::function<bool()>& done,
                                const std::function<void(std::function<void()>)>& arm,
                                std::optional<std::chrono::steady_clock::time_point> deadline) {
  arm([wake = wake_] {
    std::lock_guard<std::mutex> lock(wake->mutex);
    if (wake->io != nullptr) asio::post(*wake->io, [] {});
  });
  // Under a loop thread's modes, not the waiting thread's: a reply decoded under its inference
  // mode would be an inference tensor, one recorded under its no-grad guard would lose its
  // autograd history. A thread already in them keeps its state (the guard copies every part of
  // it in and out: microseconds per wait, cache-cold as waits are).
  std::optional<at::ThreadLocalStateGuard> loop_state;
  if (!ThreadModes::current().same_as(loop_modes_)) {
    loop_state.emplace(*loop_state_);
  }
  while (!done() && !io_.stopped()) {
    if (!deadline) {
      io_.run_one();
    } else if (io_.run_one_until(*deadline) == 0 && std::chrono::steady_clock::now() >= *deadline) {
      break;
    }
  }
}

IoLoop* IoLoop::claim_left_loop() {
  LoopRegistry& registry = loop_registry();
  std::lock_guard<std::mutex> registry_lock(registry.mutex);
  for (IoLoop* loop : registry.loops) {
    std::lock_guard<std::mutex> lock(loop->mutex_);
    if (!loop->stopped_ && loop->left_job_ != 0 && loop->kept_job_ == loop->left_job_) {
      loop->kept_job_ = 0;  // Led, not kept: no follower takes it over meanwhile.
      loop->left_job_ = 0;
      ++loop->outside_leaders_;
      return loop;
    }
  }
  return nullptr;
}

bool IoLoop::lead_left_loop_until(const std::function<bool()>& done,
                                  const std::function<void(std::function<void()>)>& arm,
                                  std::optional<std::chrono::steady_clock::time_point> deadline,
                                  const std::function<void()>& last) {
  if (t_leading != nullptr || t_keeping != nullptr) {
    return false;
  }
  IoLoop* loop = claim_left_loop();
  if (loop == nullptr) {
    return false;
  }
  t_leading = loop;
  t_outside = true;
  t_leave_for.reset();
  // Ends the lead even if something in it throws (handlers do not): a loop left claimed would
  // never be read again, and its destructor would wait for this thread forever.
  struct EndLead {
    IoLoop* loop;
    EndLead(const EndLead&) = delete;
    EndLead& operator=(const EndLead&) = delete;
    ~EndLead() {
      const std::shared_ptr<const NextWaiter> leave_for = std::move(t_leave_for);  // empties it
      t_outside = false;
      t_leading = nullptr;
      loop->end_outside_lead(leave_for);
    }
  } end{loop};
  loop->run_handlers_until(done, arm, deadline);
  if (last && !t_leave_for && done()) last();  // unless a handler of the lead already asked
  return true;
}

void IoLoop::end_outside_lead(const std::shared_ptr<const NextWaiter>& leave_for) {
  // Notified under the lock: once it is released the loop may be destroyed (~IoLoop waits for
  // outside_leaders_ to drop).
  std::lock_guard<std::mutex> lock(mutex_);
  --outside_leaders_;
  if (io_.stopped()) {
    led_ = false;
    stopped_ = true;
    follow_.notify_all();
    stopped_cv_.notify_all();
  } else if (leave_for && leave_for->comes_back()) {
    left_job_ = kept_job_ = ++jobs_begun_;
    if (waiting_ > 0 && !watching_) follow_.notify_one();  // someone must watch
  } else {
    led_ = false;  // Another reply is expected: a loop thread reads it.
    follow_.notify_one();
  }
  outside_left_.notify_all();
}

uint64_t IoLoop::keep_locked(std::unique_lock<std::mutex>& lock) {
  const uint64_t number = ++jobs_begun_;
  kept_job_ = number;
  const bool wake = waiting_ > 0 && !watching_;  // a follower asleep is woken to watch
  lock.unlock();
  if (wake) {
    follow_.notify_one();
  }
  return number;
}

void IoLoop::stop_locked(std::unique_lock<std::mutex>& lock) {
  led_ = false;
  stopped_ = true;
  lock.unlock();
  follow_.notify_all();
  stopped_cv_.notify_all();
}

bool IoLoop::follow(std::unique_lock<std::mutex>& lock) {
  using Clock = std::chrono::steady_clock;
  ++waiting_;
  bool watching = false;
  uint64_t seen_job = 0;      // the job keeping the loop at the last look
  uint64_t seen_begun = 0;    // jobs_begun_ at the last look
  Clock::time_point seen_at;  // when seen_job was first seen keeping it
  bool lead = false;
  while (!stopped_) {
    if (!led_) {
      lead = true;
      break;
    }
    const Clock::time_point now = Clock::now();
    if (watching && kept_job_ != 0 && kept_job_ == seen_job && now - seen_at >= long_job_) {
      kept_job_ = 0;  // One job kept the loop a whole long_job_: take it over.
      lead = true;
      break;
    }
    if (kept_job_ != 0 && (watching || !watching_)) {
      // A job keeps the loop and no other follower watches it: watch.
      if (kept_job_ != seen_job) {
        seen_job = kept_job_;
        seen_at = now;
      }
      watching = watching_ = true;
      seen_begun = jobs_begun_;
      follow_.wait_until(lock, seen_at + long_job_);
    } else if (watching && jobs_begun_ != seen_begun) {
      seen_begun = jobs_begun_;  // Jobs ran since the last look: go on watching.
      follow_.wait_for(lock, long_job_);
    } else {
      if (watching) {
        watching = watching_ = false;  // A long_job_ without a job: sleep until woken.
      }
      follow_.wait(lock);
    }
  }
  --waiting_;
  if (watching) {
    watching_ = false;
  }
  return lead;
}

void IoLoop::run_thread() {
  at::ThreadLocalState state;  // this thread's, before any job ran on it
  const ThreadModes modes = ThreadModes::current();
  std::unique_lock<std::mutex> lock(mutex_);
  if (!loop_state_) {
    loop_state_ = std::make_unique<at::ThreadLocalState>(std::move(state));
    loop_modes_ = modes;
  }
  while (follow(lock)) {
    led_ = true;
    bool leading = true;
    while (leading) {
      lock.unlock();
      std::function<void()> job;
      t_leading = this;
      t_after = &job;
      t_leave_for.reset();
      bool running = true;
      while (!job && !t_leave_for && running) {
        running = io_.run_one() > 0;  // 0: stopped (a work guard keeps it from running dry)
      }
      const std::shared_ptr<const NextWaiter> leave_for = job ? nullptr : std::move(t_leave_for);
      t_leave_for.reset();
      t_leading = nullptr;
      t_after = nullptr;

      lock.lock();
      if (!running) {
        stop_locked(lock);
        return;
      }
      if (leave_for) {
        if (leave_for->comes_back()) {
          // Left for the next outside wait; this thread follows, watching it as a job.
          left_job_ = kept_job_ = ++jobs_begun_;
          leading = false;
        }
        continue;  // Or the caller is blocked on something else: read on.
      }
      // The job keeps the loop; a follower watches it (woken once per run of jobs).
      t_kept_job = keep_locked(lock);
      t_keeping = this;
      job();
      job = nullptr;  // its captures go before the lock is taken
      t_keeping = nullptr;
      lock.lock();
      // t_kept_job, as lead_until renumbers the job it resumes.
      if (kept_job_ == t_kept_job && !stopped_) {
        kept_job_ = 0;  // Still leading: read on.
      } else {
        leading = false;  // Released or taken over: follow.
      }
    }
  }
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
