#include "distrun/output_relay.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace distoptim {
namespace launcher {
namespace {

constexpr size_t kMaxLineBytes = 64 * 1024;
constexpr size_t kReadBytes = 64 * 1024;

}  // namespace

void OutputRelay::read_available(int max_reads) {
  bool at_eof = false;
  for (int i = 0; i < max_reads && !at_eof; ++i) {
    const size_t old_size = pending_.size();
    pending_.resize(old_size + kReadBytes);
    const ssize_t n = ::read(pipe_.get(), &pending_[old_size], kReadBytes);
    pending_.resize(old_size + static_cast<size_t>(std::max<ssize_t>(n, 0)));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    at_eof = n <= 0;
  }
  flush(at_eof);
  if (at_eof) pipe_.reset();
}

void OutputRelay::close() {
  flush(/*at_eof=*/true);
  pipe_.reset();
}

void OutputRelay::flush(bool at_eof) {
  std::string batch;
  size_t start = 0;
  while (start < pending_.size()) {
    const size_t available = pending_.size() - start;
    const void* newline =
        std::memchr(&pending_[start], '\n', std::min(available, kMaxLineBytes + 1));
    size_t length;
    size_t consumed;
    if (newline != nullptr) {
      length = static_cast<size_t>(static_cast<const char*>(newline) - &pending_[start]);
      consumed = length + 1;
    } else if (available > kMaxLineBytes) {
      length = consumed = kMaxLineBytes;
    } else if (at_eof) {
      length = consumed = available;
    } else {
      break;
    }
    batch += prefix_;
    batch.append(pending_, start, length);
    batch += '\n';
    if (tail_limit_ > 0) {
      tail_.append(pending_, start, length);
      tail_ += '\n';
    }
    start += consumed;
  }
  pending_.erase(0, start);
  if (tail_.size() > tail_limit_) tail_.erase(0, tail_.size() - tail_limit_);
  write_all(out_fd_, batch);
}

}  // namespace launcher
}  // namespace distoptim
