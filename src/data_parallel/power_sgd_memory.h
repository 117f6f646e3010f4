#pragma once

// What PowerSGDState remembers between iterations (power_sgd_hook.h), shared by the state's own
// methods (power_sgd_state.cpp) and the hooks (power_sgd_hook.cpp).

#include <cstdint>
#include <mutex>
#include <random>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

#include <distoptim/data_parallel/power_sgd_hook.h>

namespace distoptim {
namespace data_parallel {

struct PowerSGDState::Memory {
  mutable std::mutex mutex;
  // NumPy's legacy RandomState(seed) is this Mersenne Twister, seeded the same way.
  std::mt19937 rng;                                      // guarded by mutex
  std::unordered_map<size_t, at::Tensor> error_dict;     // guarded by mutex
  std::unordered_map<size_t, at::Tensor> p_memory_dict;  // guarded by mutex
  std::unordered_map<size_t, at::Tensor> q_memory_dict;  // guarded by mutex
  int64_t iter = 0;                                      // guarded by mutex
  int64_t total_numel_before_compression = 0;            // guarded by mutex
  int64_t total_numel_after_compression = 0;             // guarded by mutex

  explicit Memory(uint32_t seed) : rng(seed) {}

  // NumPy's RandomState.randint(1_000_000_000): 30-bit masked draws, rejected above the bound.
  // Called with mutex held.
  uint64_t next_seed() {
    constexpr uint32_t kBound = 999'999'999;
    constexpr uint32_t kMask = (uint32_t{1} << 30) - 1;
    uint32_t value = 0;
    do {
      value = static_cast<uint32_t>(rng()) & kMask;
    } while (value > kBound);
    return value;
  }

  // Each bucket's layout (its gradients' shapes, in order) when its memories were made. Called
  // with mutex held, before a bucket's memories are read: memories made under another layout (a
  // checkpoint loaded into a DDP that has not rebuilt its buckets yet) would be added to other
  // gradients' places, so they are dropped and the bucket starts afresh.
  std::unordered_map<size_t, std::vector<std::vector<int64_t>>> layouts;  // guarded by mutex
  void forget_if_relaid(size_t bucket, const std::vector<at::Tensor>& gradients) {
    std::vector<std::vector<int64_t>> layout;
    layout.reserve(gradients.size());
    for (const at::Tensor& gradient : gradients) layout.push_back(gradient.sizes().vec());
    auto known = layouts.find(bucket);
    if (known != layouts.end() && known->second == layout) return;
    if (known != layouts.end()) {
      error_dict.erase(bucket);
      p_memory_dict.erase(bucket);
      q_memory_dict.erase(bucket);
    }
    layouts[bucket] = std::move(layout);
  }

  // PyTorch's maybe_increase_iter: bucket 0 is the last of an iteration. Called with mutex held.
  void count_bucket(bool is_last) {
    if (is_last) ++iter;
  }
};

// The hooks' way into the state's memory.
struct PowerSGDStateAccess {
  using Memory = PowerSGDState::Memory;
  static Memory& memory(PowerSGDState& state) { return *state.memory_; }
};

}  // namespace data_parallel
}  // namespace distoptim
