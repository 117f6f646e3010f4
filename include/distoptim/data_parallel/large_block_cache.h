#pragma once

// A CPU allocator for LibTorch that gives large tensors mappings of their own and keeps them for
// reuse, so that memory a pass frees is there for the next one and nothing else. Made for ZeRO
// stage 2 (docs/data_parallel.md): autograd's gradients are fresh every pass and stage 2 frees
// each at once; at glibc's defaults those freed blocks stay in malloc's heap, cut up by smaller
// allocations, and the memory stage 2 frees never shows as memory saved.

#include <cstddef>
#include <cstdint>

#include <torch/arg.h>

namespace distoptim {
namespace data_parallel {

struct LargeBlockCacheOptions {
  /// A tensor buffer of at least this many bytes is mapped from the kernel on its own (starting on
  /// a 2 MiB boundary, transparent huge pages asked for, its size rounded up to whole 4 KiB
  /// pages); smaller ones go to the allocator that was LibTorch's CPU allocator before. At least
  /// 4096.
  TORCH_ARG(std::size_t, min_block_bytes) = std::size_t{1} << 20;
  /// Freed blocks are kept for a buffer of the same rounded size, up to this many bytes in all;
  /// past it the oldest go back to the kernel. 0 keeps none (every large buffer is mapped afresh
  /// and unmapped when freed: what glibc's mmap threshold does, page faults included).
  TORCH_ARG(std::size_t, max_cached_bytes) = std::size_t{64} << 20;
};

/// Makes the cache LibTorch's CPU allocator (c10::SetCPUAllocator, priority 0) for the rest of
/// the process, wrapping the one that was (it keeps serving the small buffers, and frees those it
/// allocated before). Called again, it only takes the new options (a lower max_cached_bytes
/// returns the excess at once). Process-wide, like glibc's settings: call it once at start-up,
/// before training, on every rank that wants it. Throws c10::ValueError for an option out of
/// range, and c10::Error if the current allocator cannot free by pointer alone (no raw_deleter),
/// if an allocator set with a higher priority keeps the place, or if another replaced the cache
/// since it was installed; nothing changes then.
void install_large_block_cache(const LargeBlockCacheOptions& options = {});

/// Whether the cache is LibTorch's CPU allocator now.
bool large_block_cache_installed();

struct LargeBlockCacheStats {
  std::size_t live_bytes = 0;    // mapped and held by tensors
  std::size_t cached_bytes = 0;  // mapped and free for reuse
  std::uint64_t reused = 0;      // large buffers served from the cache
  std::uint64_t mapped = 0;      // large buffers mapped afresh
  std::uint64_t unmapped = 0;    // blocks given back to the kernel
};

/// The counts since the cache was installed (all zero before).
LargeBlockCacheStats large_block_cache_stats();

/// Gives every cached block back to the kernel (what torch.cuda.empty_cache does for CUDA's).
void empty_large_block_cache();

}  // namespace data_parallel
}  // namespace distoptim
