// The transport's reader (transport/connection.h) on a real Unix-domain socket pair: frames that
// arrive many to a read, or split anywhere across reads, are delivered whole and in order,
// through a handler that pauses reading (or resumes it from inside itself) and one that replaces
// itself; a frame that breaks the framing after good ones in the same read closes the connection
// after exactly those.

#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <asio/io_context.hpp>
#include <asio/local/stream_protocol.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>

#include "message.h"
#include "transport/connection.h"

namespace distoptim {
namespace rpc {
namespace detail {
namespace connection_test {

// A frame as the test sends it and expects it back: its id, body and tensors' bytes.
struct TestFrame {
  uint64_t id = 0;
  std::string body;
  std::vector<std::string> tensors;
  bool operator==(const TestFrame& other) const {
    return id == other.id && body == other.body && tensors == other.tensors;
  }
};

std::string header_bytes(uint64_t id, size_t body_length, size_t tensor_count) {
  MessageHeader header;
  header.type = MessageType::kRequest;
  header.id = id;
  header.body_length = static_cast<uint32_t>(body_length);
  header.tensor_count = static_cast<uint32_t>(tensor_count);
  return encode_header(header);
}

// The frame's bytes on the wire: header, tensor lengths, body, tensors.
std::string wire_bytes(const TestFrame& frame) {
  std::string out = header_bytes(frame.id, frame.body.size(), frame.tensors.size());
  for (const std::string& tensor : frame.tensors) put_le(&out, tensor.size(), 8);
  out += frame.body;
  for (const std::string& tensor : frame.tensors) out += tensor;
  return out;
}

TestFrame received(const Frame& frame) {
  TestFrame out{frame.header.id, *frame.body, {}};
  for (const at::Tensor& buffer : frame.buffers) {
    out.tensors.emplace_back(static_cast<const char*>(buffer.data_ptr()), buffer.nbytes());
  }
  return out;
}

std::string random_bytes(std::mt19937& random, size_t size) {
  std::string out(size, '\0');
  for (char& byte : out) byte = static_cast<char>(random() & 0xff);
  return out;
}

// `count` frames, mostly small (a few to a few hundred bytes: many to one read of the inbox),
// every `medium_every`-th with a tensor of a few KiB (read straight into the tensor after what
// the inbox held), every `large_every`-th with one of 70,000 bytes, and every 37th with 100 tiny
// tensors (more than the reader keeps its lists sized for between frames).
std::vector<TestFrame> make_frames(size_t count, size_t medium_every, size_t large_every) {
  std::mt19937 random(7);
  std::vector<TestFrame> frames;
  for (size_t i = 0; i < count; ++i) {
    TestFrame frame;
    frame.id = 1000 + i;
    frame.body = random_bytes(random, random() % 200);
    const size_t tensors = random() % 4;
    for (size_t t = 0; t < tensors; ++t)
      frame.tensors.push_back(random_bytes(random, random() % 64));
    if (medium_every > 0 && i % medium_every == medium_every - 1) {
      frame.tensors.push_back(random_bytes(random, 3000 + i));
    }
    if (large_every > 0 && i % large_every == large_every - 1) {
      frame.tensors.push_back(random_bytes(random, 70000));
    }
    if (i % 37 == 36) {
      for (size_t t = 0; t < 100; ++t) frame.tensors.push_back(random_bytes(random, random() % 9));
    }
    frames.push_back(std::move(frame));
  }
  return frames;
}

std::string wire_bytes(const std::vector<TestFrame>& frames) {
  std::string out;
  for (const TestFrame& frame : frames) out += wire_bytes(frame);
  return out;
}

void send_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t sent = ::send(fd, data, size, MSG_NOSIGNAL);
    ASSERT_GT(sent, 0) << "writing the test's stream: " << std::strerror(errno);
    data += sent;
    size -= static_cast<size_t>(sent);
  }
}

// A connection on one end of a socket pair; the test writes raw bytes into the other end, from
// its own thread or from threads it starts (joined first when the pair goes).
class SocketPair {
 public:
  SocketPair() {
    int fds[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) {
      throw std::runtime_error(std::string("socketpair: ") + std::strerror(errno));
    }
    writer = fds[1];
    reader = fds[0];
    connection = std::make_shared<Connection>(
        io, asio::local::stream_protocol::socket(io, asio::local::stream_protocol(), fds[0]),
        std::string());
  }
  ~SocketPair() {
    // A writer still blocked (the test failed before reading everything) fails instead.
    ::shutdown(writer, SHUT_RDWR);
    for (std::thread& thread : threads) thread.join();
    ::close(writer);
  }

  // Runs the connection's I/O until a handler stops it, at most `bound` (then fails).
  void run(std::chrono::seconds bound = std::chrono::seconds(60)) {
    asio::steady_timer deadline(io, bound);
    deadline.async_wait([this, bound](const asio::error_code& error) {
      if (error) return;
      ADD_FAILURE() << "the frames did not all arrive within " << bound.count() << " s";
      io.stop();
    });
    io.run();
  }

  // Whether the connection has read every byte written so far; waits for it at most 10 s.
  bool all_read() const {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (true) {
      int unread = 0;
      if (::ioctl(reader, FIONREAD, &unread) != 0) return false;
      if (unread == 0) return true;
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  asio::io_context io;
  int writer = -1;
  int reader = -1;  // the connection's end, owned by its socket
  std::shared_ptr<Connection> connection;
  std::vector<std::thread> threads;
};

TEST(RpcConnection, ABurstReadAtOnceArrivesInOrderThroughPausesAndAHandlerSwap) {
  const std::vector<TestFrame> frames = make_frames(300, 25, 60);
  // Frames 24, 49, 74, ... have a tensor of a few KiB, 59, 119, ... one of 70,000 bytes.
  constexpr size_t kPauseAt = 40;
  constexpr size_t kSwapAt = 61;
  constexpr size_t kSecondPauseAt = 150;
  const std::string stream = wire_bytes(frames);
  std::vector<TestFrame> got_by_first, got_by_second;
  int depth = 0;
  int max_depth = 0;
  bool paused = false;
  bool delivered_while_paused = false;
  std::string closed_why;
  SocketPair pair;  // after what its threads use: they end first
  // The first hundred frames wait in the socket before the first read: it takes many at once.
  const size_t first_part =
      wire_bytes(std::vector<TestFrame>(frames.begin(), frames.begin() + 100)).size();
  ASSERT_LT(first_part, size_t{100} << 10);
  send_all(pair.writer, stream.data(), first_part);
  pair.threads.emplace_back([&pair, &stream, first_part] {
    send_all(pair.writer, stream.data() + first_part, stream.size() - first_part);
  });
  auto on_closed = [&](const std::string& why) {
    closed_why = why;
    pair.io.stop();
  };
  const WireLimits limits;
  // The second handler: after the swap; pauses once more, resumed from another thread.
  auto second = [&](Frame frame) {
    max_depth = std::max(max_depth, ++depth);
    delivered_while_paused |= paused;
    got_by_second.push_back(received(frame));
    bool go_on = true;
    if (got_by_second.back().id == frames[kSecondPauseAt].id) {
      paused = true;
      go_on = false;
      pair.threads.emplace_back([&pair, &paused] {
        // Time for a reader that ignored the pause to deliver: a pause that holds has no event.
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        asio::post(pair.io, [&paused] { paused = false; });
        pair.connection->resume_reading();
      });
    }
    if (got_by_second.back().id == frames.back().id) pair.io.stop();
    --depth;
    return go_on;
  };
  // The first handler: pauses (resumed from the I/O thread), then replaces itself with the
  // second. Both where the frames after are small ones already in the inbox.
  auto first = [&](Frame frame) {
    max_depth = std::max(max_depth, ++depth);
    delivered_while_paused |= paused;
    got_by_first.push_back(received(frame));
    bool go_on = true;
    if (got_by_first.back().id == frames[kPauseAt].id) {
      paused = true;
      go_on = false;
      asio::post(pair.io, [&pair, &paused] {
        paused = false;
        pair.connection->resume_reading();
      });
    }
    if (got_by_first.back().id == frames[kSwapAt].id) {
      pair.connection->read_frames(limits, second, on_closed);
    }
    --depth;
    return go_on;
  };
  pair.connection->read_frames(limits, first, on_closed);
  pair.run();

  EXPECT_EQ(closed_why, "");
  EXPECT_EQ(max_depth, 1) << "a frame was delivered from inside the handler of another";
  EXPECT_FALSE(delivered_while_paused);
  ASSERT_EQ(got_by_first.size(), kSwapAt + 1);
  ASSERT_EQ(got_by_second.size(), frames.size() - kSwapAt - 1);
  for (size_t i = 0; i < frames.size(); ++i) {
    const TestFrame& got = i <= kSwapAt ? got_by_first[i] : got_by_second[i - kSwapAt - 1];
    ASSERT_EQ(got, frames[i]) << "frame " << i;
  }
}

TEST(RpcConnection, FramesSplitAnywhereAcrossReadsArriveWhole) {
  const std::vector<TestFrame> frames = make_frames(80, 20, 0);
  const std::string stream = wire_bytes(frames);
  SocketPair pair;  // after the stream: its writer thread ends first
  // Pieces of 1 to 17 bytes, each sent once the connection has read all before it, so that reads
  // end inside headers, lengths, bodies and tensors, and the inbox holds the start of a field
  // whose rest is read after.
  pair.threads.emplace_back([&pair, &stream] {
    std::mt19937 random(11);
    for (size_t done = 0; done < stream.size();) {
      const size_t piece = std::min<size_t>(1 + random() % 17, stream.size() - done);
      send_all(pair.writer, stream.data() + done, piece);
      done += piece;
      if (!pair.all_read()) return;  // the test fails by run()'s bound
    }
  });
  std::vector<TestFrame> got;
  std::string closed_why;
  pair.connection->read_frames(
      WireLimits(),
      [&](Frame frame) {
        got.push_back(received(frame));
        if (got.size() == frames.size()) pair.io.stop();
        return true;
      },
      [&](const std::string& why) {
        closed_why = why;
        pair.io.stop();
      });
  pair.run();
  EXPECT_EQ(closed_why, "");
  ASSERT_EQ(got.size(), frames.size());
  for (size_t i = 0; i < frames.size(); ++i) ASSERT_EQ(got[i], frames[i]) << "frame " << i;
}

TEST(RpcConnection, AResumeFromInsideTheHandlerOutlastsItsPause) {
  const std::vector<TestFrame> frames = make_frames(10, 0, 0);
  const std::string stream = wire_bytes(frames);
  std::vector<TestFrame> got;
  std::string closed_why;
  SocketPair pair;
  send_all(pair.writer, stream.data(), stream.size());
  pair.connection->read_frames(
      WireLimits(),
      [&](Frame frame) {
        got.push_back(received(frame));
        if (got.size() == frames.size()) pair.io.stop();
        if (got.size() != 3) return true;
        // The budget freed while the frame was handled: the resume comes before the pause.
        pair.connection->resume_reading();
        return false;
      },
      [&](const std::string& why) {
        closed_why = why;
        pair.io.stop();
      });
  pair.run(std::chrono::seconds(10));
  EXPECT_EQ(closed_why, "");
  ASSERT_EQ(got.size(), frames.size()) << "reading stayed paused after frame 3";
  for (size_t i = 0; i < frames.size(); ++i) ASSERT_EQ(got[i], frames[i]) << "frame " << i;
}

// What follows five good frames in the same read, and the reason the connection gives.
struct BadTail {
  std::string name;
  std::string bytes;
  std::string why;
  WireLimits limits;
};

std::vector<BadTail> bad_tails() {
  std::vector<BadTail> tails;
  std::string bad_magic = header_bytes(7, 0, 0);
  bad_magic[0] ^= 0x5a;
  MessageHeader decoded;
  tails.push_back({"a header with a bad magic", bad_magic,
                   "it sent " + decode_header(bad_magic, &decoded).value_or("?"), WireLimits()});

  WireLimits small;
  small.max_body_bytes = 1024;
  MessageHeader oversized;
  oversized.id = 8;
  oversized.body_length = 4096;
  tails.push_back({"a body over the limit", header_bytes(8, 4096, 0),
                   "it sent " + check_header(oversized, small).value_or("?"), small});

  // A frame cut inside its body, then the end of the stream.
  const std::string whole = wire_bytes(TestFrame{9, std::string(300, 'b'), {std::string(50, 't')}});
  tails.push_back(
      {"the end of the stream inside a frame", whole.substr(0, 100), "end of file", WireLimits()});
  return tails;
}

TEST(RpcConnection, ABadFrameAfterGoodOnesInOneReadClosesAfterExactlyThose) {
  for (const BadTail& tail : bad_tails()) {
    SCOPED_TRACE(tail.name);
    SocketPair pair;
    std::vector<TestFrame> good = make_frames(5, 0, 0);
    // Never delivered: it follows the bad bytes (and the farewell-less close).
    const TestFrame after{99, "after", {}};
    std::string stream = wire_bytes(good) + tail.bytes;
    if (tail.why != "end of file") stream += wire_bytes(after);
    ASSERT_LT(stream.size(), size_t{4096}) << "the whole stream fits one read of the inbox";
    send_all(pair.writer, stream.data(), stream.size());
    if (tail.why == "end of file") ::shutdown(pair.writer, SHUT_WR);

    std::vector<TestFrame> got;
    std::vector<std::string> closed;
    pair.connection->read_frames(
        tail.limits,
        [&](Frame frame) {
          EXPECT_TRUE(closed.empty()) << "a frame after the connection closed";
          got.push_back(received(frame));
          return true;
        },
        [&](const std::string& why) {
          closed.push_back(why);
          pair.io.stop();
        });
    pair.run();
    EXPECT_EQ(closed, std::vector<std::string>{tail.why});
    EXPECT_TRUE(pair.connection->closed());
    ASSERT_EQ(got.size(), good.size());
    for (size_t i = 0; i < good.size(); ++i) EXPECT_EQ(got[i], good[i]) << "frame " << i;
  }
}

}  // namespace connection_test
}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
