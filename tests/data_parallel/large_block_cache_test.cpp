// The large block cache as LibTorch's CPU allocator: which buffers it maps, which freed blocks it
// keeps and hands out again, what it gives back to the kernel, bad options, and threads freeing
// at once. The suite runs in a process of its own (one CTest test per suite), where it installs
// the cache; every test starts from an empty cache and counts from there.

#include <algorithm>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include <sanitizer/asan_interface.h>

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <distoptim/data_parallel/large_block_cache.h>

#include "support/sanitizers.h"
#include "support/test_util.h"

namespace distoptim {
namespace data_parallel {
namespace large_block_cache_test {

using distoptim::testing::expect_error_containing;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kPage = 4096;

at::Tensor buffer_of(std::size_t bytes) {
  return at::empty({static_cast<int64_t>(bytes)}, at::kByte);
}

// Read in place: a reduction such as sum() would allocate a buffer of its own of the input's
// size in int64, itself a large block, and change the counts.
bool all_bytes_are(const at::Tensor& t, std::uint8_t value) {
  const std::uint8_t* data = t.data_ptr<std::uint8_t>();
  return std::all_of(data, data + t.numel(), [value](std::uint8_t b) { return b == value; });
}

// Installed with `options`, nothing cached; the counts from which a test measures.
LargeBlockCacheStats fresh_cache(const LargeBlockCacheOptions& options = {}) {
  install_large_block_cache(options);
  empty_large_block_cache();
  return large_block_cache_stats();
}

TEST(LargeBlockCache, AFreedBlockServesTheNextBufferOfItsSizeOnly) {
  const LargeBlockCacheStats start = fresh_cache();
  ASSERT_TRUE(large_block_cache_installed());
  void* first = nullptr;
  {
    at::Tensor t = buffer_of(4 * kMiB);
    first = t.data_ptr();
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(first) % (2 * kMiB), 0u);
    t.fill_(7);
    EXPECT_TRUE(all_bytes_are(t, 7));
    const LargeBlockCacheStats now = large_block_cache_stats();
    EXPECT_EQ(now.mapped, start.mapped + 1);
    EXPECT_EQ(now.live_bytes, start.live_bytes + 4 * kMiB);
  }
  LargeBlockCacheStats now = large_block_cache_stats();
  EXPECT_EQ(now.live_bytes, start.live_bytes);
  EXPECT_EQ(now.cached_bytes, 4 * kMiB);
  {
    at::Tensor t = buffer_of(4 * kMiB);
    EXPECT_EQ(t.data_ptr(), first);
    now = large_block_cache_stats();
    EXPECT_EQ(now.reused, start.reused + 1);
    EXPECT_EQ(now.mapped, start.mapped + 1);
    EXPECT_EQ(now.cached_bytes, 0u);
  }
  {
    // One byte more is a block of its own (whole pages); the miss gives the cached block back.
    at::Tensor t = buffer_of(4 * kMiB + 1);
    now = large_block_cache_stats();
    EXPECT_EQ(now.mapped, start.mapped + 2);
    EXPECT_EQ(now.unmapped, start.unmapped + 1);
    EXPECT_EQ(now.cached_bytes, 0u);
    EXPECT_EQ(now.live_bytes, start.live_bytes + 4 * kMiB + kPage);
  }
  EXPECT_EQ(large_block_cache_stats().cached_bytes, 4 * kMiB + kPage);
}

TEST(LargeBlockCache, SmallBuffersGoToTheAllocatorItWrapped) {
  const LargeBlockCacheStats start = fresh_cache();
  {
    at::Tensor small = at::arange(1000, at::kFloat);
    at::Tensor just_below = buffer_of(kMiB - 1);
    just_below.fill_(3);
    EXPECT_EQ(small.sum().item<double>(), 999.0 * 1000.0 / 2.0);
    EXPECT_TRUE(all_bytes_are(just_below, 3));
    const LargeBlockCacheStats now = large_block_cache_stats();
    EXPECT_EQ(now.mapped, start.mapped);
    EXPECT_EQ(now.reused, start.reused);
    EXPECT_EQ(now.live_bytes, start.live_bytes);
  }
  EXPECT_EQ(large_block_cache_stats().cached_bytes, 0u);
}

// c10's raw interface (a pointer, freed by the allocator's raw deleter), for both kinds.
TEST(LargeBlockCache, RawAllocationsOfBothKindsAreFreedByPointer) {
  const LargeBlockCacheStats start = fresh_cache();
  c10::Allocator* allocator = c10::GetCPUAllocator();
  void* small = allocator->raw_allocate(100);
  void* large = allocator->raw_allocate(3 * kMiB);
  static_cast<char*>(small)[99] = 1;
  static_cast<char*>(large)[3 * kMiB - 1] = 1;
  EXPECT_EQ(large_block_cache_stats().live_bytes, start.live_bytes + 3 * kMiB);
  allocator->raw_deallocate(small);
  allocator->raw_deallocate(large);
  const LargeBlockCacheStats now = large_block_cache_stats();
  EXPECT_EQ(now.live_bytes, start.live_bytes);
  EXPECT_EQ(now.cached_bytes, 3 * kMiB);
}

TEST(LargeBlockCache, PastItsCapItKeepsTheNewestBlocks) {
  const LargeBlockCacheStats start =
      fresh_cache(LargeBlockCacheOptions().max_cached_bytes(9 * kMiB));
  const std::size_t a = 4 * kMiB;
  const std::size_t b = 4 * kMiB + kPage;
  const std::size_t c = 4 * kMiB + 2 * kPage;
  void* b_data = nullptr;
  {
    std::vector<at::Tensor> held{buffer_of(a), buffer_of(b), buffer_of(c)};
    b_data = held[1].data_ptr();
    for (auto& t : held) t.reset();  // a first, c last
  }
  LargeBlockCacheStats now = large_block_cache_stats();
  EXPECT_EQ(now.unmapped, start.unmapped + 1);  // a, the oldest
  EXPECT_EQ(now.cached_bytes, b + c);
  {
    at::Tensor t = buffer_of(b);
    EXPECT_EQ(t.data_ptr(), b_data);
    at::Tensor u = buffer_of(a);  // a miss: c, now the oldest cached, makes room
    now = large_block_cache_stats();
    EXPECT_EQ(now.mapped, start.mapped + 4);
    EXPECT_EQ(now.unmapped, start.unmapped + 2);
    EXPECT_EQ(now.cached_bytes, 0u);
  }
}

TEST(LargeBlockCache, ACapOfZeroGivesEveryBlockBackWhenFreed) {
  const LargeBlockCacheStats start = fresh_cache(LargeBlockCacheOptions().max_cached_bytes(0));
  buffer_of(2 * kMiB).fill_(1);
  buffer_of(2 * kMiB).fill_(1);
  const LargeBlockCacheStats now = large_block_cache_stats();
  EXPECT_EQ(now.mapped, start.mapped + 2);
  EXPECT_EQ(now.unmapped, start.unmapped + 2);
  EXPECT_EQ(now.reused, start.reused);
  EXPECT_EQ(now.cached_bytes, 0u);
}

TEST(LargeBlockCache, ALowerCapGivesTheExcessBackAtOnceOldestFirst) {
  const LargeBlockCacheStats start = fresh_cache();
  void* newer = nullptr;
  {
    at::Tensor older_block = buffer_of(4 * kMiB);
    at::Tensor newer_block = buffer_of(4 * kMiB);
    newer = newer_block.data_ptr();
    older_block.reset();
  }
  EXPECT_EQ(large_block_cache_stats().cached_bytes, 8 * kMiB);
  install_large_block_cache(LargeBlockCacheOptions().max_cached_bytes(4 * kMiB));
  const LargeBlockCacheStats now = large_block_cache_stats();
  EXPECT_EQ(now.cached_bytes, 4 * kMiB);
  EXPECT_EQ(now.unmapped, start.unmapped + 1);
  EXPECT_EQ(buffer_of(4 * kMiB).data_ptr(), newer);
}

TEST(LargeBlockCache, ABadOptionIsRefusedAndChangesNothing) {
  fresh_cache(LargeBlockCacheOptions().max_cached_bytes(8 * kMiB));
  buffer_of(4 * kMiB).fill_(0);
  const LargeBlockCacheStats before = large_block_cache_stats();
  try {
    install_large_block_cache(LargeBlockCacheOptions().min_block_bytes(100));
    ADD_FAILURE() << "expected c10::ValueError";
  } catch (const c10::ValueError& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("install_large_block_cache: min_block_bytes = 100 is below one page "
                           "(4096 bytes)"),
              std::string::npos)
        << message;
  }
  EXPECT_TRUE(large_block_cache_installed());
  // The old options hold: half a MiB is still the wrapped allocator's, 4 MiB still cached.
  buffer_of(kMiB / 2).fill_(0);
  const LargeBlockCacheStats after = large_block_cache_stats();
  EXPECT_EQ(after.mapped, before.mapped);
  EXPECT_EQ(after.cached_bytes, before.cached_bytes);
  EXPECT_EQ(after.unmapped, before.unmapped);
}

TEST(LargeBlockCache, WhatTheKernelRefusesIsAnErrorNamingTheSize) {
  const LargeBlockCacheStats start = fresh_cache();
  // 256 TiB: more than a process's whole address space below the 47-bit limit.
  const std::size_t too_large = std::size_t{1} << 48;
  expect_error_containing(
      [&] { buffer_of(too_large); },
      {"large block cache: the kernel refused to map " + std::to_string(too_large) + " bytes ("});
  const LargeBlockCacheStats now = large_block_cache_stats();
  EXPECT_EQ(now.mapped, start.mapped);
  EXPECT_EQ(now.live_bytes, start.live_bytes);
}

// Under AddressSanitizer a cached block is poisoned, so a tensor's memory used after it was freed
// is still reported; handed out again, it is usable.
TEST(LargeBlockCache, UnderAddressSanitizerACachedBlockIsPoisoned) {
#if DISTOPTIM_UNDER_ASAN
  fresh_cache();
  void* data = nullptr;
  {
    at::Tensor t = buffer_of(2 * kMiB);
    data = t.data_ptr();
    EXPECT_EQ(__asan_address_is_poisoned(data), 0);
  }
  EXPECT_EQ(__asan_address_is_poisoned(data), 1);
  EXPECT_EQ(__asan_address_is_poisoned(static_cast<char*>(data) + 2 * kMiB - 1), 1);
  at::Tensor again = buffer_of(2 * kMiB);
  ASSERT_EQ(again.data_ptr(), data);
  EXPECT_EQ(__asan_address_is_poisoned(data), 0);
  again.fill_(1);
  empty_large_block_cache();
#else
  GTEST_SKIP() << "not built with AddressSanitizer";
#endif
}

// Threads allocating and freeing large and small buffers at once: every large one is counted
// once, as reused or mapped, every value read back is the one written, and none stays live.
TEST(LargeBlockCache, ThreadsAllocatingAndFreeingAtOnceKeepExactCounts) {
  const LargeBlockCacheStats start = fresh_cache();
  constexpr int kThreads = 4;
  constexpr int kRounds = 50;
  std::vector<std::thread> threads;
  std::vector<int> wrong(kThreads, 0);
  for (int id = 0; id < kThreads; ++id) {
    threads.emplace_back([id, &wrong] {
      for (int round = 0; round < kRounds; ++round) {
        const std::size_t bytes = (1 + static_cast<std::size_t>((id + round) % 3)) * kMiB;
        at::Tensor large = buffer_of(bytes);
        at::Tensor small = at::full({64}, id, at::kInt);
        large.fill_(id + 1);
        if (!all_bytes_are(large, static_cast<std::uint8_t>(id + 1)) ||
            small.sum().item<int64_t>() != 64 * id) {
          ++wrong[id];
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong, std::vector<int>(kThreads, 0));
  const LargeBlockCacheStats now = large_block_cache_stats();
  EXPECT_EQ((now.reused - start.reused) + (now.mapped - start.mapped),
            static_cast<std::uint64_t>(kThreads * kRounds));
  EXPECT_EQ(now.live_bytes, start.live_bytes);
}

}  // namespace large_block_cache_test
}  // namespace data_parallel
}  // namespace distoptim
