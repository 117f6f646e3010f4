// The file writer under write_checkpoint_file (src/optim/file_writer.h): whatever the sizes of
// the pieces it is given, the file holds exactly their bytes, through the page cache up to
// kDirectAfterBytes and around it past them where the file system takes O_DIRECT; a write that
// fails past the threshold (a file-size limit, as a full disk) is reported with its errno.
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "file_writer.h"
#include "support/file_size_limit.h"

namespace distoptim {
namespace optim {
namespace file_writer_test {

using detail::FileWriter;
using detail::kDirectAfterBytes;

constexpr size_t kMiB = size_t{1} << 20;

class FileWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string base = ::testing::TempDir();
    if (!base.empty() && base.back() == '/') base.pop_back();
    std::string pattern = base + "/distoptim_file_writer_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Whether this directory's file system takes O_DIRECT at all.
  bool takes_direct_io() const {
    const std::string probe = dir_ + "/probe";
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_DIRECT, 0600);
    if (fd < 0) return false;
    ::close(fd);
    ::unlink(probe.c_str());
    return true;
  }

  // `total` bytes that differ from one offset to the next (a shifted or repeated piece shows).
  static std::vector<char> pattern_bytes(size_t total) {
    std::vector<char> bytes(total);
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < total; ++i) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      bytes[i] = static_cast<char>(x);
    }
    return bytes;
  }

  static std::vector<char> read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::vector<char>(std::istreambuf_iterator<char>(in), {});
  }

  std::string dir_;
};

// Pieces of the given sizes in turn, the last repeated until `total` bytes are given.
TEST_F(FileWriterTest, TheFileHoldsExactlyThePiecesWhateverTheirSizes) {
  struct Case {
    const char* name;
    size_t total;
    std::vector<size_t> pieces;
  };
  const std::vector<Case> cases = {
      {"small pieces, under the threshold", kDirectAfterBytes, {1, 7, 4096, 100}},
      {"one piece past the threshold",
       3 * kDirectAfterBytes + 12345,
       {3 * kDirectAfterBytes + 12345}},
      {"small pieces across it", kDirectAfterBytes + 9 * kMiB + 3, {1000, 1, 4097, 333}},
      {"large unaligned pieces",
       5 * kDirectAfterBytes + 1,
       {kDirectAfterBytes - 1, 3, 9 * kMiB + 5}},
      {"ending on a chunk's edge", 2 * kDirectAfterBytes + 4 * kMiB, {kMiB + 1, 64}},
  };
  const bool direct_io = takes_direct_io();
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::vector<char> bytes = pattern_bytes(c.total);
    const std::string path = dir_ + "/file";
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ASSERT_GE(fd, 0);
    FileWriter writer(fd);
    size_t given = 0;
    for (size_t i = 0; given < c.total; i = std::min(i + 1, c.pieces.size() - 1)) {
      const size_t piece = std::min(c.pieces[i], c.total - given);
      ASSERT_TRUE(writer.write(bytes.data() + given, piece)) << "at byte " << given;
      given += piece;
    }
    ASSERT_TRUE(writer.finish()) << std::strerror(writer.error());
    ::close(fd);
    const std::vector<char> written = read_file(path);
    ASSERT_EQ(written.size(), bytes.size());
    EXPECT_TRUE(written == bytes);
    if (c.total <= kDirectAfterBytes || !direct_io) {
      EXPECT_EQ(writer.direct_bytes(), 0u);
    } else {
      // Everything from the piece that took the file past the threshold (or the next aligned
      // offset) on, but the last unaligned block.
      EXPECT_GE(writer.direct_bytes(), c.total - kDirectAfterBytes - 2 * 4096);
      EXPECT_LE(writer.direct_bytes(), c.total);
    }
  }
}

using testing::FileSizeLimit;
// A write refused past the threshold (the file may not grow beyond 20 MiB): write() or finish()
// returns false with EFBIG, the bytes before the limit are in the file, and nothing after.
TEST_F(FileWriterTest, AWriteRefusedPastTheThresholdIsReportedWithItsErrno) {
  const size_t limit = 20 * kMiB + 512;
  const std::vector<char> bytes = pattern_bytes(40 * kMiB);
  const std::string path = dir_ + "/limited";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  ASSERT_GE(fd, 0);
  bool finished = false;
  {
    FileSizeLimit limited(limit);
    FileWriter writer(fd);
    bool accepted = true;
    for (size_t given = 0; accepted && given < bytes.size(); given += kMiB + 7) {
      accepted = writer.write(bytes.data() + given, std::min(kMiB + 7, bytes.size() - given));
    }
    finished = accepted && writer.finish();
    EXPECT_EQ(writer.error(), EFBIG) << std::strerror(writer.error());
  }
  ::close(fd);
  EXPECT_FALSE(finished);
  const std::vector<char> written = read_file(path);
  ASSERT_LE(written.size(), limit);
  EXPECT_TRUE(std::equal(written.begin(), written.end(), bytes.begin()));
}

// A producer that stops half-way (an exception in the zip writer, say): abandon() waits for the
// chunk in flight, so the descriptor may be closed at once; nothing more is written after it.
TEST_F(FileWriterTest, AbandonedMidwayWritesNothingMore) {
  const std::vector<char> bytes = pattern_bytes(30 * kMiB);
  const std::string path = dir_ + "/abandoned";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  ASSERT_GE(fd, 0);
  FileWriter writer(fd);
  ASSERT_TRUE(writer.write(bytes.data(), bytes.size()));
  writer.abandon();
  const off_t size = ::lseek(fd, 0, SEEK_END);
  ::close(fd);
  EXPECT_LE(static_cast<size_t>(size), bytes.size());
  const std::vector<char> written = read_file(path);
  EXPECT_EQ(written.size(), static_cast<size_t>(size));
  EXPECT_TRUE(std::equal(written.begin(), written.end(), bytes.begin()));
}

// A large piece whose memory lines up with the file offset it goes to (the same offset within a
// block) is written from where it lies, its whole blocks; the same piece one byte off is copied
// into the chunks. The file holds exactly the bytes either way.
TEST_F(FileWriterTest, ALargePieceLinedUpWithItsFileOffsetIsWrittenFromItsOwnMemory) {
  const size_t total = 3 * kDirectAfterBytes + 777;
  const std::vector<char> bytes = pattern_bytes(total);
  const bool direct_io = takes_direct_io();
  for (const size_t shift : {size_t{0}, size_t{1}}) {
    SCOPED_TRACE(shift == 0 ? "lined up" : "one byte off");
    // The bytes at `shift` past a block's start, so that byte i lies at i + shift in a block.
    std::unique_ptr<char, decltype(&std::free)> memory(
        static_cast<char*>(std::aligned_alloc(
            detail::kDirectAlignBytes,
            (total / detail::kDirectAlignBytes + 2) * detail::kDirectAlignBytes)),
        &std::free);
    char* data = memory.get() + shift;
    std::memcpy(data, bytes.data(), total);
    const std::string path = dir_ + "/in_place";
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ASSERT_GE(fd, 0);
    FileWriter writer(fd);
    // A header's worth, then a large piece (which takes the file past the threshold), then
    // another that ends in a partial block.
    const size_t header = 100;
    const size_t large = 2 * kDirectAfterBytes + 5000;
    ASSERT_TRUE(writer.write(data, header));
    ASSERT_TRUE(writer.write(data + header, large));
    ASSERT_TRUE(writer.write(data + header + large, total - header - large));
    ASSERT_TRUE(writer.finish()) << std::strerror(writer.error());
    ::close(fd);
    const std::vector<char> written = read_file(path);
    ASSERT_EQ(written.size(), bytes.size());
    EXPECT_TRUE(written == bytes);
    if (shift == 0 && direct_io) {
      // All of both large pieces but their partial blocks.
      EXPECT_GE(writer.in_place_bytes(), total - header - 3 * detail::kDirectAlignBytes);
      EXPECT_LE(writer.in_place_bytes(), total - header);
    } else {
      EXPECT_EQ(writer.in_place_bytes(), 0u);
    }
  }
}

// A thread's ScopedWriteRests limit cuts the writes of a large piece from the caller's memory
// into writes of at most that many bytes; the file's bytes are the same. A limit that is not a
// multiple of the alignment, or a negative share, is refused naming the value, and the thread's
// writes stay uncut.
TEST_F(FileWriterTest, ALimitedThreadCutsItsWritesAroundThePageCacheAndWritesTheSameBytes) {
  const size_t total = 3 * kDirectAfterBytes + 777;
  const size_t limit = 64 * 1024;
  const std::vector<char> bytes = pattern_bytes(total);
  std::unique_ptr<char, decltype(&std::free)> memory(
      static_cast<char*>(
          std::aligned_alloc(detail::kDirectAlignBytes,
                             (total / detail::kDirectAlignBytes + 1) * detail::kDirectAlignBytes)),
      &std::free);
  std::memcpy(memory.get(), bytes.data(), total);
  // A header's worth, then the rest in one piece lined up with its file offset: the in-place
  // writes and their count.
  const auto write_file = [&](const std::string& name) {
    const std::string path = dir_ + "/" + name;
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    EXPECT_GE(fd, 0);
    FileWriter writer(fd);
    EXPECT_TRUE(writer.write(memory.get(), detail::kDirectAlignBytes));
    EXPECT_TRUE(
        writer.write(memory.get() + detail::kDirectAlignBytes, total - detail::kDirectAlignBytes));
    EXPECT_TRUE(writer.finish()) << std::strerror(writer.error());
    ::close(fd);
    EXPECT_TRUE(read_file(path) == bytes) << name;
    return std::pair<size_t, size_t>(writer.in_place_bytes(), writer.in_place_writes());
  };
  const auto uncut = write_file("uncut");
  std::pair<size_t, size_t> cut;
  {
    const detail::ScopedWriteRests limited(0, limit);
    cut = write_file("cut");
  }
  EXPECT_EQ(cut.first, uncut.first);
  if (takes_direct_io()) {
    ASSERT_GT(uncut.first, 2 * kDirectAfterBytes);
    EXPECT_GE(cut.second, (cut.first + limit - 1) / limit);
    EXPECT_LT(uncut.second, cut.second / 4);
  } else {
    EXPECT_EQ(cut.second, 0u);
  }
  try {
    const detail::ScopedWriteRests refused(0, 1000);
    ADD_FAILURE() << "a limit of 1000 bytes was taken";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "ScopedWriteRests: max_direct_write 1000 is not a multiple of 4096 bytes"),
              std::string::npos)
        << e.what();
  }
  try {
    const detail::ScopedWriteRests refused(-1, limit);
    ADD_FAILURE() << "a share of -1 was taken";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("ScopedWriteRests: share -1 is negative"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(write_file("after the refusals"), uncut);
}

}  // namespace file_writer_test
}  // namespace optim
}  // namespace distoptim
