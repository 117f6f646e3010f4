#pragma once

// Gloo writes to its sockets with writev, which raises SIGPIPE when the peer has gone. A C++
// program (unlike Python, which ignores SIGPIPE and under which PyTorch's users run Gloo) is then
// killed before Gloo can report the lost peer. Rather than change the whole process's signal
// disposition, the comm layer blocks SIGPIPE in the threads that write to Gloo's sockets: the
// threads Gloo and c10d start for a group (a thread inherits the signal mask of the thread that
// creates it, so the group is made under this guard) and the caller's thread while it issues a
// send or a receive. A write to a peer that has gone then fails with EPIPE, which Gloo reports.

#include <pthread.h>
#include <signal.h>

#include <ctime>

namespace distoptim {
namespace comm {
namespace detail {

/// Blocks SIGPIPE in this thread while it lives; a SIGPIPE raised meanwhile is discarded before
/// the thread's previous mask comes back.
class SigpipeBlocked {
 public:
  SigpipeBlocked() { (void)::pthread_sigmask(SIG_BLOCK, &pipe_set(), &previous_); }
  ~SigpipeBlocked() {
    if (sigismember(&previous_, SIGPIPE) == 1) return;  // blocked already: left so
    sigset_t pending;
    if (::sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1) {
      const timespec no_wait{0, 0};
      (void)::sigtimedwait(&pipe_set(), nullptr, &no_wait);
    }
    (void)::pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
  }
  SigpipeBlocked(const SigpipeBlocked&) = delete;
  SigpipeBlocked& operator=(const SigpipeBlocked&) = delete;

 private:
  static const sigset_t& pipe_set() {
    static const sigset_t kSet = [] {
      sigset_t s;
      sigemptyset(&s);
      sigaddset(&s, SIGPIPE);
      return s;
    }();
    return kSet;
  }

  sigset_t previous_{};
};

}  // namespace detail
}  // namespace comm
}  // namespace distoptim
