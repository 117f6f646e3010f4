#pragma once

// Writes a file's bytes, in order, through its descriptor, for write_checkpoint_file. Small pieces
// (the zip writer's headers and padding) are gathered; large ones go out without a copy of their
// own. A file that grows past kDirectAfterBytes (a snapshot's block of a table is 128 MB; an
// optimizer's state dict is mostly less) goes on around the page cache (O_DIRECT), in aligned
// chunks, one written by a thread of the writer's while the next is filled: the writing thread then
// pays a copy into the chunk, not the kernel's page-cache copy and writeback, which on a parameter
// server ran at the trainers' priority whatever the writer's and took their CPU. A large piece
// whose memory lines up with its file offset is not copied at all (kInPlaceMinBytes). Where the
// file system refuses O_DIRECT (or a direct write), the file is written through the page cache as
// before; the bytes written are the same either way.

#include <sys/types.h>

#include <cstddef>
#include <memory>
#include <vector>

namespace distoptim {
namespace optim {
namespace detail {

/// A file up to this size is written through the page cache alone.
constexpr size_t kDirectAfterBytes = size_t{8} << 20;
/// O_DIRECT's alignment of memory, file offsets and lengths (Linux's block devices want 512 or
/// 4096 bytes).
constexpr size_t kDirectAlignBytes = 4096;
/// A piece of at least this size whose memory lines up with the file offset it goes to (the same
/// offset within a kDirectAlignBytes block: write_pickle_archive lays its large records so) is
/// written from where it lies, its whole blocks around the page cache, not copied into a chunk.
constexpr size_t kInPlaceMinBytes = size_t{1} << 20;

class DirectChunks;

class FileWriter {
 public:
  /// `fd`: open for writing, at offset 0, not shared with another writer meanwhile.
  explicit FileWriter(int fd);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  /// Appends `size` bytes; false once a write has failed (error() says why). Never throws. The
  /// bytes are written or copied before it returns.
  bool write(const void* data, size_t size);
  /// Writes out what is gathered and waits for every chunk in flight; false on failure. The
  /// descriptor is left open and not synced (the caller fsyncs it).
  bool finish();
  /// Waits for the chunk in flight and writes nothing more: before the descriptor is closed on a
  /// failure.
  void abandon();
  /// The errno of the first failed write, or 0.
  int error() const { return error_; }
  /// Bytes that went around the page cache (0 where the file system refused O_DIRECT).
  size_t direct_bytes() const;
  /// Of those, the bytes written from the caller's memory rather than copied into a chunk.
  size_t in_place_bytes() const;
  /// The write(2) calls that wrote them (more where ScopedWriteRests cuts the writes).
  size_t in_place_writes() const;

 private:
  bool flush_gathered();
  bool write_all(const char* bytes, size_t size);
  // Starts writing around the page cache at the current offset (which must be aligned); where the
  // file system refuses it, the file goes on through the page cache.
  void start_direct();

  int fd_;
  int error_ = 0;
  size_t offset_ = 0;  // bytes handed to the kernel through the page cache
  bool direct_tried_ = false;
  std::vector<char> gathered_;
  std::unique_ptr<DirectChunks> direct_;
};

/// While one lives, every write(2) a FileWriter makes on this thread is followed by a rest of
/// `share` times that write's duration, and no write around the page cache is larger than
/// `max_direct_write` bytes (0: as large as the piece written from the caller's memory). For a
/// background writer that shares the machine with latency-bound work: the disk's DMA reads every
/// byte from memory, and a writer that hands the disk a record of many megabytes at once (a burst
/// of a dozen requests or more, where dd's probe queues one) holds the memory bus the other work
/// waits on (dist_optim's snapshots; docs/benchmarks.md has the measurements). c10::ValueError for
/// a negative share or a limit that is not a multiple of kDirectAlignBytes.
class ScopedWriteRests {
 public:
  explicit ScopedWriteRests(double share, size_t max_direct_write = 0);
  ~ScopedWriteRests();
  ScopedWriteRests(const ScopedWriteRests&) = delete;
  ScopedWriteRests& operator=(const ScopedWriteRests&) = delete;

 private:
  double previous_share_;
  size_t previous_max_direct_write_;
};

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
