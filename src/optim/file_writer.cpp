#include "file_writer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include <c10/util/Exception.h>

namespace distoptim {
namespace optim {
namespace detail {

struct FreeChunk {
  void operator()(char* chunk) const { std::free(chunk); }
};
using Chunk = std::unique_ptr<char, FreeChunk>;

namespace {

constexpr size_t kAlignBytes = kDirectAlignBytes;
// Long enough that the disk's time dwarfs the copy into a chunk (27 ms at 150 MB/s, against well
// under a millisecond), short enough that two stay small beside what a large file holds.
constexpr size_t kChunkBytes = size_t{4} << 20;
// Small pieces gathered into one write.
constexpr size_t kGatherBytes = size_t{1} << 20;

// A chunk on a huge-page boundary, advised huge: two page faults to fill it rather than a
// thousand (a fresh page costs far more than its copy on a virtual machine). Null without memory.
Chunk new_chunk() {
  constexpr size_t kHugePage = size_t{2} << 20;
  void* memory = std::aligned_alloc(kHugePage, kChunkBytes);
  if (memory == nullptr) return nullptr;
  (void)::madvise(memory, kChunkBytes, MADV_HUGEPAGE);  // advice: refused, the small pages serve
  return Chunk(static_cast<char*>(memory));
}

bool set_direct(int fd, bool on) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0) return false;
  return ::fcntl(fd, F_SETFL, on ? (flags | O_DIRECT) : (flags & ~O_DIRECT)) == 0;
}

// This thread's ScopedWriteRests share (0: none) and largest write around the page cache (0: no
// limit).
thread_local double t_rest_share = 0;
thread_local size_t t_max_direct_write = 0;

// write(2) until all of `size` is written: 0, or the errno of the failure. Where a write around
// the page cache is refused (EINVAL: the file system wants a larger alignment, or a short write
// left the offset unaligned), `*direct` turns false and the rest goes through the page cache.
// A write that wrote something is followed by this thread's ScopedWriteRests rest; around the
// page cache, no write is larger than its ScopedWriteRests limit. `writes`, if given, counts the
// calls.
int write_fully(int fd, const char* bytes, size_t size, bool* direct, size_t* writes = nullptr) {
  size_t done = 0;
  while (done < size) {
    const auto began = std::chrono::steady_clock::now();
    const size_t limit = *direct && t_max_direct_write > 0 ? t_max_direct_write : size;
    const ssize_t n = ::write(fd, bytes + done, std::min(size - done, limit));
    if (writes != nullptr) ++*writes;
    if (n > 0 && t_rest_share > 0) {
      std::this_thread::sleep_for((std::chrono::steady_clock::now() - began) * t_rest_share);
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EINVAL && *direct) {
      if (!set_direct(fd, false)) return EINVAL;
      *direct = false;
      continue;
    }
    if (n <= 0) return n < 0 ? errno : EIO;
    done += static_cast<size_t>(n);
  }
  return 0;
}

}  // namespace

// Two chunks: the caller fills one while a thread of its own writes the other around the page
// cache. The descriptor's offset is the writing thread's while it runs, the caller's after.
class DirectChunks {
 public:
  /// Null where the file system refuses O_DIRECT or there is no memory for the chunks (nothing
  /// changed then). `fd`'s offset must be aligned.
  static std::unique_ptr<DirectChunks> start(int fd) {
    Chunk first = new_chunk();
    Chunk second = new_chunk();
    if (!first || !second || !set_direct(fd, true)) return nullptr;
    return std::unique_ptr<DirectChunks>(new DirectChunks(fd, std::move(first), std::move(second)));
  }

  ~DirectChunks() { stop(); }
  DirectChunks(const DirectChunks&) = delete;
  DirectChunks& operator=(const DirectChunks&) = delete;

  /// False once a write failed (error() says why).
  bool append(const char* bytes, size_t size) {
    // The file offset is the chunk's, which starts on a block: filled_ says where in a block the
    // next byte goes.
    const auto address = reinterpret_cast<uintptr_t>(bytes);
    if (size >= kInPlaceMinBytes && address % kAlignBytes == filled_ % kAlignBytes) {
      const size_t head = (kAlignBytes - address % kAlignBytes) % kAlignBytes;
      if (!copy_in(bytes, head)) return false;
      const size_t whole = (size - head) / kAlignBytes * kAlignBytes;
      if (!write_in_place(bytes + head, whole)) return false;
      bytes += head + whole;
      size -= head + whole;
    }
    return copy_in(bytes, size);
  }

  /// Waits for the chunk in flight, then writes the last one (its whole blocks around the page
  /// cache, the rest through it) and turns O_DIRECT off. Returns 0 or the first failure's errno.
  int finish() {
    stop();
    if (error_ == 0) {
      const size_t whole = direct_ ? filled_ / kAlignBytes * kAlignBytes : 0;
      const char* chunk = chunks_[filling_].get();
      error_ = write_fully(fd_, chunk, whole, &direct_);
      if (direct_) direct_bytes_ += whole;
      bool direct = false;
      if (error_ == 0 && set_direct(fd_, false)) {
        error_ = write_fully(fd_, chunk + whole, filled_ - whole, &direct);
      } else if (error_ == 0) {
        error_ = errno;
      }
    }
    filled_ = 0;
    return error_;
  }

  /// Waits for the chunk in flight and ends the writing thread; what is being filled is dropped.
  void stop() {
    if (!writer_.joinable()) return;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      written_cv_.wait(lock, [this] { return pending_ == nullptr; });
      stopping_ = true;
      pending_cv_.notify_one();
    }
    writer_.join();
  }

  int error() const { return error_; }
  size_t direct_bytes() const { return direct_bytes_; }
  size_t in_place_bytes() const { return in_place_bytes_; }
  size_t in_place_writes() const { return in_place_writes_; }

 private:
  DirectChunks(int fd, Chunk first, Chunk second) : fd_(fd) {
    chunks_[0] = std::move(first);
    chunks_[1] = std::move(second);
    writer_ = std::thread([this] { run(); });
  }

  // Copies `size` bytes into the chunks, handing each full one to the writing thread.
  bool copy_in(const char* bytes, size_t size) {
    while (size > 0) {
      const size_t n = std::min(size, kChunkBytes - filled_);
      std::memcpy(chunks_[filling_].get() + filled_, bytes, n);
      filled_ += n;
      bytes += n;
      size -= n;
      if (filled_ == kChunkBytes && !hand_over()) return false;
    }
    return true;
  }

  // Writes, on the caller's thread, the chunk being filled (whole blocks) and then `size` bytes
  // (whole blocks, aligned in memory) from where they lie, once the chunk in flight is written:
  // they are written when it returns, so the caller may free them.
  bool write_in_place(const char* bytes, size_t size) {
    std::unique_lock<std::mutex> lock(mutex_);
    written_cv_.wait(lock, [this] { return pending_ == nullptr; });
    if (error_ != 0) return false;
    bool direct = direct_;
    lock.unlock();  // the writing thread waits for a chunk, which only this thread hands it
    int error = write_fully(fd_, chunks_[filling_].get(), filled_, &direct);
    size_t writes = 0;
    if (error == 0) error = write_fully(fd_, bytes, size, &direct, &writes);
    lock.lock();
    if (direct) {
      direct_bytes_ += filled_ + size;
      in_place_bytes_ += size;
      in_place_writes_ += writes;
    }
    direct_ = direct;
    error_ = error;
    filled_ = 0;
    return error_ == 0;
  }

  // Hands the full chunk to the writing thread once the one before is written; the caller fills
  // the other meanwhile.
  bool hand_over() {
    std::unique_lock<std::mutex> lock(mutex_);
    written_cv_.wait(lock, [this] { return pending_ == nullptr; });
    if (error_ != 0) return false;
    pending_ = chunks_[filling_].get();
    pending_cv_.notify_one();
    filling_ ^= 1;
    filled_ = 0;
    return true;
  }

  // The writing thread: one chunk at a time, until stopped. A new thread takes its creator's
  // nice value, so a snapshot's low priority (snapshot_files.h) holds here too.
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      pending_cv_.wait(lock, [this] { return pending_ != nullptr || stopping_; });
      if (pending_ == nullptr) return;
      const char* chunk = pending_;
      bool direct = direct_;
      lock.unlock();
      const int error = write_fully(fd_, chunk, kChunkBytes, &direct);
      lock.lock();
      if (direct) direct_bytes_ += kChunkBytes;
      direct_ = direct;
      if (error_ == 0) error_ = error;
      pending_ = nullptr;
      written_cv_.notify_one();
    }
  }

  const int fd_;
  Chunk chunks_[2];
  int filling_ = 0;    // the caller's chunk
  size_t filled_ = 0;  // of it
  std::mutex mutex_;
  std::condition_variable pending_cv_;
  std::condition_variable written_cv_;
  // Guarded by mutex_ while the writing thread runs:
  const char* pending_ = nullptr;  // the chunk to write, or null
  bool stopping_ = false;
  int error_ = 0;
  bool direct_ = true;  // false once a write around the page cache was refused
  size_t direct_bytes_ = 0;
  size_t in_place_bytes_ = 0;   // the caller's thread's alone
  size_t in_place_writes_ = 0;  // the write(2) calls that wrote them
  std::thread writer_;
};

FileWriter::FileWriter(int fd) : fd_(fd) { gathered_.reserve(kGatherBytes); }

FileWriter::~FileWriter() = default;

bool FileWriter::write(const void* data, size_t size) {
  if (error_ != 0) return false;
  const char* bytes = static_cast<const char*>(data);
  if (!direct_ && !direct_tried_ && offset_ + gathered_.size() + size > kDirectAfterBytes) {
    // Through the page cache up to an aligned offset, then around it.
    if (!flush_gathered()) return false;
    const size_t head = std::min(size, (kAlignBytes - offset_ % kAlignBytes) % kAlignBytes);
    if (!write_all(bytes, head)) return false;
    bytes += head;
    size -= head;
    if (offset_ % kAlignBytes == 0) start_direct();
  }
  if (direct_) {
    if (direct_->append(bytes, size)) return true;
    error_ = direct_->error();
    return false;
  }
  if (gathered_.size() + size <= kGatherBytes) {
    gathered_.insert(gathered_.end(), bytes, bytes + size);
    return true;
  }
  return flush_gathered() && write_all(bytes, size);
}

bool FileWriter::finish() {
  if (error_ != 0 || !flush_gathered()) return false;
  if (direct_) error_ = direct_->finish();
  return error_ == 0;
}

void FileWriter::abandon() {
  if (direct_) direct_->stop();
}

size_t FileWriter::direct_bytes() const { return direct_ ? direct_->direct_bytes() : 0; }

size_t FileWriter::in_place_bytes() const { return direct_ ? direct_->in_place_bytes() : 0; }

size_t FileWriter::in_place_writes() const { return direct_ ? direct_->in_place_writes() : 0; }

bool FileWriter::flush_gathered() {
  const bool written = write_all(gathered_.data(), gathered_.size());
  gathered_.clear();
  return written;
}

bool FileWriter::write_all(const char* bytes, size_t size) {
  if (error_ != 0) return false;
  bool direct = false;
  error_ = write_fully(fd_, bytes, size, &direct);
  if (error_ == 0) offset_ += size;
  return error_ == 0;
}

void FileWriter::start_direct() {
  direct_tried_ = true;
  direct_ = DirectChunks::start(fd_);
}

ScopedWriteRests::ScopedWriteRests(double share, size_t max_direct_write)
    : previous_share_(t_rest_share), previous_max_direct_write_(t_max_direct_write) {
  TORCH_CHECK_VALUE(share >= 0, "ScopedWriteRests: share ", share, " is negative");
  TORCH_CHECK_VALUE(max_direct_write % kAlignBytes == 0, "ScopedWriteRests: max_direct_write ",
                    max_direct_write, " is not a multiple of ", kAlignBytes, " bytes");
  t_rest_share = share;
  t_max_direct_write = max_direct_write;
}

ScopedWriteRests::~ScopedWriteRests() {
  t_rest_share = previous_share_;
  t_max_direct_write = previous_max_direct_write_;
}

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
