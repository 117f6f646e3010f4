#include "host_memory_channel.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <distoptim/comm/errors.h>

namespace distoptim {
namespace comm {

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x6873746F70746964ULL;  // "ditpotsh": a distoptim segment
// The header takes a page of its own, so the slots start page-aligned.
constexpr size_t kHeaderBytes = 4096;
// How long a waiting member spins before it sleeps, and how often a sleeping one checks that
// the members it waits for are still alive.
constexpr auto kSpin = std::chrono::microseconds(20);
constexpr auto kLivenessPeriod = std::chrono::milliseconds(50);

// What a member writes at the start of its segment. The barrier counter sits on a cache line of
// its own, apart from the fields the others only read once.
struct SegmentHeader {
  uint64_t magic;
  uint64_t token;
  int32_t group_rank;
  int32_t pid;
  uint64_t start_time;
  alignas(64) std::atomic<uint32_t> arrived;  // the last barrier this member arrived at
};
static_assert(sizeof(SegmentHeader) <= kHeaderBytes, "the header must fit its page");
static_assert(std::atomic<uint32_t>::is_always_lock_free && sizeof(std::atomic<uint32_t>) == 4,
              "the barrier counter is a futex word");

SegmentHeader* header_of(uint8_t* segment) { return reinterpret_cast<SegmentHeader*>(segment); }

uint32_t* futex_word(std::atomic<uint32_t>* counter) {
  return reinterpret_cast<uint32_t*>(counter);
}

// Shared (not private) futex operations: the word is in memory other processes map.
void futex_wake_all(std::atomic<uint32_t>* counter) {
  syscall(SYS_futex, futex_word(counter), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void futex_wait(std::atomic<uint32_t>* counter, uint32_t seen, Clock::duration at_most) {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(at_most).count();
  if (ns <= 0) return;
  timespec relative{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  // Returns early on a wake, a signal or when the word no longer holds `seen`: callers loop.
  syscall(SYS_futex, futex_word(counter), FUTEX_WAIT, seen, &relative, nullptr, 0);
}

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// A process's state letter and start time (clock ticks after boot) from /proc/PID/stat; nullopt
// when there is no such process. The start time tells a process from a later one with its pid.
struct ProcessStamp {
  char state;
  uint64_t start_time;
};

std::optional<ProcessStamp> process_stamp(int pid) {
  std::ifstream file("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!file || !std::getline(file, line)) return std::nullopt;
  // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so parse after the last
  // ')'. The start time is the 22nd field, the 20th after the command.
  const size_t end = line.rfind(')');
  if (end == std::string::npos) return std::nullopt;
  std::istringstream fields(line.substr(end + 1));
  ProcessStamp stamp{};
  fields >> stamp.state;
  std::string skip;
  for (int i = 0; i < 18; ++i) fields >> skip;
  fields >> stamp.start_time;
  if (!fields) return std::nullopt;
  return stamp;
}

std::string segment_name(const std::string& prefix, int group_rank) {
  return prefix + std::to_string(group_rank);
}

// Every member's `value`'s minimum, over Gloo: how the members agree on whether all succeeded.
int64_t agree_min(c10d::ProcessGroup& gloo, int64_t value, std::chrono::milliseconds timeout) {
  std::vector<at::Tensor> flag = {at::full({1}, value, at::kLong)};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MIN;
  options.timeout = timeout;
  gloo.allreduce(flag, options)->wait(timeout);
  return flag[0].item<int64_t>();
}

uint64_t agree_token(c10d::ProcessGroup& gloo, int group_rank, std::chrono::milliseconds timeout) {
  int64_t token = 0;
  if (group_rank == 0) {
    std::random_device device;
    std::uniform_int_distribution<int64_t> draw(1, INT64_MAX);
    token = draw(device);
  }
  std::vector<at::Tensor> value = {at::full({1}, token, at::kLong)};
  c10d::BroadcastOptions options;
  options.rootRank = 0;
  options.timeout = timeout;
  gloo.broadcast(value, options)->wait(timeout);
  return static_cast<uint64_t>(value[0].item<int64_t>());
}

// Creates, sizes (pages reserved now, so a full /dev/shm is an error here rather than a SIGBUS
// later) and maps this member's segment; null on any failure.
uint8_t* create_segment(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return nullptr;
  void* mapped = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(bytes)) == 0 &&
      posix_fallocate(fd, 0, static_cast<off_t>(bytes)) == 0) {
    mapped = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  close(fd);
  return mapped == MAP_FAILED ? nullptr : static_cast<uint8_t*>(mapped);
}

// Maps another member's segment; null unless it exists with exactly `bytes`.
uint8_t* map_segment(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return nullptr;
  struct stat info {};
  void* mapped = MAP_FAILED;
  if (fstat(fd, &info) == 0 && static_cast<size_t>(info.st_size) == bytes) {
    mapped = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  close(fd);
  return mapped == MAP_FAILED ? nullptr : static_cast<uint8_t*>(mapped);
}

}  // namespace

HostMemoryChannel::HostMemoryChannel(std::vector<int> ranks, int group_rank, size_t slot_bytes)
    : ranks_(std::move(ranks)),
      group_rank_(group_rank),
      slot_bytes_(slot_bytes),
      segment_bytes_(kHeaderBytes + 2 * slot_bytes),
      segments_(ranks_.size(), nullptr) {}

HostMemoryChannel::~HostMemoryChannel() {
  for (uint8_t* segment : segments_) {
    if (segment != nullptr) munmap(segment, segment_bytes_);
  }
}

std::unique_ptr<HostMemoryChannel> HostMemoryChannel::open(c10d::ProcessGroup& gloo,
                                                           const std::vector<int>& ranks,
                                                           int group_rank,
                                                           std::chrono::milliseconds timeout,
                                                           size_t slot_bytes) {
  TORCH_CHECK_VALUE(slot_bytes > 0 && slot_bytes % kHeaderBytes == 0,
                    "HostMemoryChannel: slot_bytes = ", slot_bytes,
                    " must be a positive multiple of ", kHeaderBytes);
  std::unique_ptr<HostMemoryChannel> channel(new HostMemoryChannel(ranks, group_rank, slot_bytes));
  const uint64_t token = agree_token(gloo, group_rank, timeout);
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(token));
  const std::string prefix = std::string("/distoptim-") + hex + "-";
  const std::string mine = segment_name(prefix, group_rank);

  uint8_t* own = create_segment(mine, channel->segment_bytes_);
  if (own != nullptr) {
    const std::optional<ProcessStamp> me = process_stamp(getpid());
    SegmentHeader* header = header_of(own);
    header->magic = kMagic;
    header->token = token;
    header->group_rank = group_rank;
    header->pid = getpid();
    header->start_time = me ? me->start_time : 0;
    header->arrived.store(0);
    channel->segments_[group_rank] = own;
  }
  // The names are removed whatever the outcome, once every member is past the mapping.
  bool shared = false;
  try {
    shared = agree_min(gloo, own != nullptr ? 1 : 0, timeout) == 1 &&
             agree_min(gloo, channel->map_peers(prefix, token) ? 1 : 0, timeout) == 1;
  } catch (...) {
    if (own != nullptr) shm_unlink(mine.c_str());
    throw;
  }
  if (own != nullptr) shm_unlink(mine.c_str());
  if (!shared) return nullptr;
  return channel;
}

bool HostMemoryChannel::map_peers(const std::string& prefix, uint64_t token) {
  for (int member = 0; member < size(); ++member) {
    if (member == group_rank_) continue;
    uint8_t* segment = map_segment(segment_name(prefix, member), segment_bytes_);
    if (segment == nullptr) return false;
    segments_[member] = segment;
    const SegmentHeader* header = header_of(segment);
    // A different pid namespace shows another process, or none, under the member's pid.
    if (header->magic != kMagic || header->token != token || header->group_rank != member ||
        !peer_alive(member)) {
      return false;
    }
  }
  return true;
}

uint8_t* HostMemoryChannel::slot(int member, int which) const {
  return segments_[member] + kHeaderBytes + static_cast<size_t>(which) * slot_bytes_;
}

bool HostMemoryChannel::peer_alive(int member) const {
  const SegmentHeader* header = header_of(segments_[member]);
  const std::optional<ProcessStamp> stamp = process_stamp(header->pid);
  // A zombie ('Z') or dead ('X') process is gone even before its parent reaps it.
  return stamp && stamp->start_time == header->start_time && stamp->state != 'Z' &&
         stamp->state != 'X';
}

void HostMemoryChannel::barrier(const std::string& what, std::chrono::milliseconds timeout) {
  if (!broken_.empty()) {
    if (broken_by_timeout_) DISTOPTIM_THROW(TimeoutError, what, ": ", broken_);
    DISTOPTIM_THROW(PeerLostError, what, ": ", broken_);
  }
  const uint32_t number = ++barriers_;
  std::atomic<uint32_t>& mine = header_of(segments_[group_rank_])->arrived;
  mine.store(number);
  futex_wake_all(&mine);

  const auto start = Clock::now();
  const auto deadline = start + timeout;
  auto next_check = start + kLivenessPeriod;
  const auto passed = [number](uint32_t seen) {
    return static_cast<int32_t>(seen - number) >= 0;  // the counters wrap
  };
  const auto arrived = [&](int member) {
    return passed(header_of(segments_[member])->arrived.load());
  };
  for (int member = 0; member < size(); ++member) {
    if (member == group_rank_) continue;
    std::atomic<uint32_t>& theirs = header_of(segments_[member])->arrived;
    for (;;) {
      const uint32_t seen = theirs.load();
      if (passed(seen)) break;
      const auto now = Clock::now();
      if (now - start < kSpin) {
        cpu_relax();
        continue;
      }
      if (now >= deadline || now >= next_check) {
        std::vector<int> missing;
        std::string lost;
        for (int m = 0; m < size(); ++m) {
          if (m == group_rank_ || arrived(m)) continue;
          missing.push_back(ranks_[m]);
          if (lost.empty() && !peer_alive(m)) {
            lost = "rank " + std::to_string(ranks_[m]) + " is lost (its process " +
                   std::to_string(header_of(segments_[m])->pid) + " has exited)";
          }
        }
        if (!lost.empty()) {
          broken_ = "an earlier collective failed: " + lost;
          DISTOPTIM_THROW(PeerLostError, what, ": ", lost);
        }
        if (now >= deadline) {
          const std::string never = "these ranks never reached it: " + c10::Join(", ", missing);
          broken_ = "an earlier collective timed out; " + never;
          broken_by_timeout_ = true;
          DISTOPTIM_THROW(TimeoutError, what, ": timed out after ", timeout.count(), " ms; ",
                          never);
        }
        next_check = now + kLivenessPeriod;
      }
      futex_wait(&theirs, seen, std::min(deadline, next_check) - now);
    }
  }
}

}  // namespace comm
}  // namespace distoptim
