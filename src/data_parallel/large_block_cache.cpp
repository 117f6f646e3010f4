#include <distoptim/data_parallel/large_block_cache.h>

#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <sanitizer/asan_interface.h>

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

namespace distoptim {
namespace data_parallel {
namespace {

constexpr const char* kInstall = "install_large_block_cache";
constexpr std::size_t kPageBytes = 4096;
constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

std::size_t round_up(std::size_t value, std::size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// `bytes` (whole pages) from the kernel, starting on a huge page boundary so transparent huge
// pages can back all of it; null when the kernel refuses.
void* map_block(std::size_t bytes) {
  const std::size_t span = bytes + kHugePageBytes;
  void* raw = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto begin = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t start = round_up(begin, kHugePageBytes);
  const std::size_t head = start - begin;
  const std::size_t tail = span - head - bytes;
  if (head > 0) ::munmap(raw, head);
  if (tail > 0) ::munmap(reinterpret_cast<char*>(start + bytes), tail);
  // Advice only: without THP the block is served in 4 KiB pages.
  ::madvise(reinterpret_cast<void*>(start), bytes, MADV_HUGEPAGE);
  return reinterpret_cast<void*>(start);
}

class LargeBlockCache final : public c10::Allocator {
 public:
  explicit LargeBlockCache(c10::Allocator* fallback)
      : fallback_(fallback), fallback_deleter_(fallback->raw_deleter()) {}

  c10::DataPtr allocate(std::size_t bytes) const override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (bytes < min_block_bytes_.load(std::memory_order_relaxed)) {
      // The fallback's pointer is its own context (it has a raw deleter), so release() can hand
      // it back by pointer alone.
      c10::DataPtr small = fallback_->allocate(bytes);
      void* data = small.release_context();
      return {data, data, &release, cpu};
    }
    const std::size_t block = round_up(bytes, kPageBytes);
    void* data = take_cached(block);
    if (data == nullptr) data = map_fresh(block, bytes);
    c10::profiledCPUMemoryReporter().New(data, block);
    return {data, data, &release, cpu};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  static void release(void* data);

  void set_options(const LargeBlockCacheOptions& options) {
    std::lock_guard<std::mutex> lock(mutex_);
    options_ = options;
    min_block_bytes_.store(options.min_block_bytes(), std::memory_order_relaxed);
    trim_locked(options_.max_cached_bytes());
  }

  LargeBlockCacheStats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

  void empty() {
    std::lock_guard<std::mutex> lock(mutex_);
    trim_locked(0);
  }

 private:
  struct FreeBlock {
    void* data;
    std::size_t bytes;
  };

  // A cached block of exactly `bytes`, the most recently freed first (its pages are the likeliest
  // to be in the caches and the TLB); null when none.
  void* take_cached(std::size_t bytes) const {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
      if (it->bytes != bytes) continue;
      void* data = it->data;
      ASAN_UNPOISON_MEMORY_REGION(data, bytes);
      free_.erase(std::next(it).base());
      stats_.cached_bytes -= bytes;
      stats_.live_bytes += bytes;
      ++stats_.reused;
      live_.emplace(data, bytes);
      return data;
    }
    return nullptr;
  }

  void* map_fresh(std::size_t bytes, std::size_t asked) const {
    {
      // Sizes that miss are new ones: the blocks cached longest (of sizes no longer asked for,
      // likeliest) make room for it, so that a miss does not grow the process while the cache
      // holds memory.
      std::lock_guard<std::mutex> lock(mutex_);
      trim_locked(stats_.cached_bytes > bytes ? stats_.cached_bytes - bytes : 0);
    }
    void* data = map_block(bytes);
    if (data == nullptr) {
      // What is cached is of other sizes: give it back and ask again before failing.
      {
        std::lock_guard<std::mutex> lock(mutex_);
        trim_locked(0);
      }
      data = map_block(bytes);
    }
    if (data == nullptr) {
      const int error = errno;
      TORCH_CHECK(false, "large block cache: the kernel refused to map ", asked, " bytes (",
                  std::strerror(error), ")");
    }
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.live_bytes += bytes;
    ++stats_.mapped;
    live_.emplace(data, bytes);
    return data;
  }

  // Returns false when `data` is not one of this cache's blocks.
  bool give_back(void* data) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = live_.find(data);
    if (it == live_.end()) return false;
    const std::size_t bytes = it->second;
    live_.erase(it);
    stats_.live_bytes -= bytes;
    if (bytes > options_.max_cached_bytes()) {
      unmap_locked(data, bytes);
      return true;
    }
    trim_locked(options_.max_cached_bytes() - bytes);
    // Under AddressSanitizer a tensor's memory read after it was freed is still reported while
    // its block waits in the cache.
    ASAN_POISON_MEMORY_REGION(data, bytes);
    free_.push_back({data, bytes});
    stats_.cached_bytes += bytes;
    return true;
  }

  // Unmaps the oldest cached blocks until at most `keep` bytes are cached.
  void trim_locked(std::size_t keep) const {
    std::size_t dropped = 0;
    while (stats_.cached_bytes > keep && dropped < free_.size()) {
      const FreeBlock& oldest = free_[dropped++];
      // The address range may be mapped again, by anyone: it must not stay poisoned.
      ASAN_UNPOISON_MEMORY_REGION(oldest.data, oldest.bytes);
      stats_.cached_bytes -= oldest.bytes;
      unmap_locked(oldest.data, oldest.bytes);
    }
    free_.erase(free_.begin(), free_.begin() + static_cast<std::ptrdiff_t>(dropped));
  }

  void unmap_locked(void* data, std::size_t bytes) const {
    ::munmap(data, bytes);
    ++stats_.unmapped;
  }

  c10::Allocator* const fallback_;
  const c10::DeleterFnPtr fallback_deleter_;
  std::atomic<std::size_t> min_block_bytes_{0};  // read without the lock by every allocation
  mutable std::mutex mutex_;
  LargeBlockCacheOptions options_;
  mutable std::unordered_map<void*, std::size_t> live_;  // block -> its mapped bytes
  mutable std::vector<FreeBlock> free_;                  // oldest first
  mutable LargeBlockCacheStats stats_;
};

// Set once, under the install mutex, before it can allocate; never destroyed, as tensors may
// outlive any static. Atomic: release() reads it on whatever thread frees a tensor.
std::atomic<LargeBlockCache*> the_cache{nullptr};
std::mutex install_mutex;

void LargeBlockCache::release(void* data) {
  // Blocks start on a huge page boundary; a fallback's buffer rarely does, and skips the look-up.
  const bool maybe_block = reinterpret_cast<std::uintptr_t>(data) % kHugePageBytes == 0;
  LargeBlockCache* cache = the_cache.load(std::memory_order_acquire);
  if (maybe_block && data != nullptr && cache->give_back(data)) {
    c10::profiledCPUMemoryReporter().Delete(data);
    return;
  }
  cache->fallback_deleter_(data);
}

}  // namespace

void install_large_block_cache(const LargeBlockCacheOptions& options) {
  TORCH_CHECK_VALUE(options.min_block_bytes() >= kPageBytes, kInstall,
                    ": min_block_bytes = ", options.min_block_bytes(),
                    " is below one page (4096 bytes)");
  std::lock_guard<std::mutex> lock(install_mutex);
  c10::Allocator* current = c10::GetCPUAllocator();
  LargeBlockCache* installed = the_cache.load();
  if (installed != nullptr && current == installed) {
    installed->set_options(options);
    return;
  }
  TORCH_CHECK(installed == nullptr, kInstall,
              ": LibTorch's CPU allocator was replaced after the cache was installed; the cache "
              "cannot wrap a second one");
  TORCH_CHECK(current->raw_deleter() != nullptr, kInstall,
              ": LibTorch's current CPU allocator cannot free a buffer by its pointer alone (no "
              "raw_deleter), so the cache cannot serve its small buffers through it");
  auto* cache = new LargeBlockCache(current);
  cache->set_options(options);
  the_cache.store(cache);
  c10::SetCPUAllocator(cache, /*priority=*/0);
  if (c10::GetCPUAllocator() != cache) {
    // Never current, so nothing was allocated through it.
    the_cache.store(nullptr);
    delete cache;
    TORCH_CHECK(false, kInstall,
                ": an allocator set with a higher priority keeps LibTorch's CPU allocator");
  }
}

bool large_block_cache_installed() {
  std::lock_guard<std::mutex> lock(install_mutex);
  LargeBlockCache* installed = the_cache.load();
  return installed != nullptr && c10::GetCPUAllocator() == installed;
}

LargeBlockCacheStats large_block_cache_stats() {
  std::lock_guard<std::mutex> lock(install_mutex);
  LargeBlockCache* installed = the_cache.load();
  return installed != nullptr ? installed->stats() : LargeBlockCacheStats{};
}

void empty_large_block_cache() {
  std::lock_guard<std::mutex> lock(install_mutex);
  LargeBlockCache* installed = the_cache.load();
  if (installed != nullptr) installed->empty();
}

}  // namespace data_parallel
}  // namespace distoptim
