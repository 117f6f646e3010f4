#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <asio/io_context.hpp>

namespace distoptim {
namespace rpc {
namespace detail {

/// The threads that run an io_context's loop, one at a time (leader/followers): at any moment at
/// most one of them leads, running the loop's handlers, and every hand-over goes through one
/// mutex, so the handlers are confined as on a single I/O thread. A handler may ask to run a job
/// on its own thread once it returns (run_after_hand_off): the leader then hands the loop to a
/// waiting follower and runs the job, which may block (a request waiting for a nested call)
/// without stalling the loop, and then waits to lead again. A job handed to another thread
/// waits for that thread to wake; here the thread that read the message runs it at once, and the
/// follower's wake-up is off the job's path.
///
/// Threading: the threads start at construction and run until the io_context stops; join()
/// (also the destructor) from a thread outside the loop. One mutex guards the fields below.
class IoLoop {
 public:
  IoLoop(asio::io_context& io, int threads);
  ~IoLoop();
  IoLoop(const IoLoop&) = delete;
  IoLoop& operator=(const IoLoop&) = delete;

  /// Waits until the io_context has stopped and no handler runs any more; a job handed over
  /// (run_after_hand_off) may still be running.
  void wait_stopped();
  /// Waits for every thread to leave: the io_context stopped and every job handed over returned.
  void join();

  /// Whether the calling thread runs a handler of a loop with a follower waiting to take it
  /// over, and has no job set yet: run_after_hand_off may be called.
  static bool can_hand_off();
  /// From a handler the loop runs, after can_hand_off() said yes: runs `job` on this thread right
  /// after the handler returns, once a follower has taken the loop over. The job must not throw.
  static void run_after_hand_off(std::function<void()> job);

 private:
  void run_thread();

  asio::io_context& io_;
  std::mutex mutex_;
  std::condition_variable follow_;      // a follower may lead, or the loop stopped
  std::condition_variable stopped_cv_;  // the loop stopped
  bool led_ = false;                    // a thread leads
  bool stopped_ = false;                // the io_context stopped: every thread leaves
  int waiting_ = 0;                     // followers waiting to lead
  std::vector<std::thread> threads_;
};

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
