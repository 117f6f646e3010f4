#pragma once

// A file-size limit (RLIMIT_FSIZE) for the life of the object, as a full disk would stop a write
// (tests of how a failed write is reported). SIGXFSZ is ignored meanwhile: going over the limit
// would otherwise end the process instead of failing the write.

#include <signal.h>
#include <sys/resource.h>

namespace distoptim {
namespace testing {

class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &saved_);
    previous_handler_ = ::signal(SIGXFSZ, SIG_IGN);
    rlimit limit = saved_;
    limit.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &limit);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &saved_);
    ::signal(SIGXFSZ, previous_handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  rlimit saved_{};
  void (*previous_handler_)(int) = nullptr;
};

}  // namespace testing
}  // namespace distoptim
