#include <distoptim/data_parallel/power_sgd_hook.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <random>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/frobenius_norm.h>
#include <ATen/ops/linalg_qr.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/sub.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "bucket_allreduce.h"
#include "power_sgd_memory.h"

namespace distoptim {
namespace data_parallel {

namespace {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

void rethrow_if_failed(const c10::ivalue::Future& done) {
  if (done.hasError()) std::rethrow_exception(done.exception_ptr());
}

// The futures' callbacks hold the state weakly: they are destroyed on the thread that ran them,
// which must not be the one to destroy the state's group (a group's destructor joins its threads).
std::shared_ptr<PowerSGDState> live_state(const std::weak_ptr<PowerSGDState>& state) {
  std::shared_ptr<PowerSGDState> live = state.lock();
  TORCH_CHECK(live != nullptr,
              "PowerSGD hook: the state was destroyed while a bucket was being reduced");
  return live;
}

// PyTorch's _orthogonalize_gram_schmidt over a batch of matrices (batch x rows x rank), in place.
// The norms are torch.norm's (frobenius_norm) so the columns round as PyTorch's do.
void orthogonalize_gram_schmidt(const at::Tensor& matrices, double epsilon) {
  const int64_t columns = matrices.size(2);
  for (int64_t i = 0; i < columns; ++i) {
    at::Tensor column = matrices.narrow(2, i, 1);
    const at::Tensor norm = at::frobenius_norm(column, {1}, /*keepdim=*/true);
    if (epsilon == 0) {
      column.div_(norm);
    } else {
      column.div_(norm + epsilon);
    }
    if (i + 1 < columns) {
      at::Tensor rest = matrices.narrow(2, i + 1, columns - i - 1);
      rest.sub_(at::sum(column * rest, {1}, /*keepdim=*/true) * column);
    }
  }
}

// PyTorch's _orthogonalize: Gram-Schmidt for rank 1 or 2 and 16-bit types, QR otherwise.
void orthogonalize(const at::Tensor& matrices, double epsilon) {
  const at::ScalarType type = matrices.scalar_type();
  if (matrices.size(2) <= 2 || type == at::kHalf || type == at::kBFloat16) {
    orthogonalize_gram_schmidt(matrices, epsilon);
  } else {
    matrices.copy_(std::get<0>(at::linalg_qr(matrices)));
  }
}

// Fills `factors` with standard normal values from torch.manual_seed(seed), in order, as
// PyTorch draws its Qs: on the CPU, from a generator of their own.
void fill_random(const std::vector<at::Tensor>& factors, uint64_t seed) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (const at::Tensor& factor : factors) {
    factor.copy_(at::randn(factor.sizes(), generator, factor.options()));
  }
}

// Which scratch buffer of a bucket (PowerSGDHookBase::scratch).
constexpr int kInputCopy = 0;
constexpr int kPadded = 1;

class PowerSGDHookBase : public c10d::CommHookInterface {
 public:
  explicit PowerSGDHookBase(std::shared_ptr<PowerSGDState> state) : state_(std::move(state)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    bool plain = false;
    {
      PowerSGDStateAccess::Memory& memory = PowerSGDStateAccess::memory(*state_);
      std::lock_guard<std::mutex> lock(memory.mutex);
      if (memory.iter < state_->options().start_power_sgd_iter()) {
        memory.count_bucket(bucket.isLast());
        plain = true;
      }
    }
    if (plain) return allreduce_mean(state_->process_group(), bucket.getBufferRef());
    return compress(bucket);
  }
  at::Tensor parseHookResult(const c10::IValue& result) override { return result.toTensor(); }

 protected:
  virtual FuturePtr compress(c10d::GradBucket& bucket) = 0;

  // A buffer of bucket `bucket` kept from one iteration to the next (`slot` names which), of
  // `numel` elements like `like`: a bucket of a model's size would otherwise fault in fresh
  // pages every iteration. One iteration's round of a bucket ends before the next begins (DDP
  // waits for every bucket's future), so the buffers are never in two rounds at once.
  at::Tensor scratch(size_t bucket, int slot, int64_t numel, const at::Tensor& like) {
    std::lock_guard<std::mutex> lock(scratch_mutex_);
    at::Tensor& buffer = scratch_[{bucket, slot}];
    if (!buffer.defined() || buffer.numel() != numel || buffer.dtype() != like.dtype()) {
      buffer = at::empty({numel}, like.options());
    }
    return buffer;
  }

  std::shared_ptr<PowerSGDState> state_;

 private:
  std::mutex scratch_mutex_;
  std::map<std::pair<size_t, int>, at::Tensor> scratch_;  // guarded by scratch_mutex_
};

// One bucket's compression, kept alive by the futures that finish it (the GradBucket itself is
// gone once runHook returns).
struct BucketRound {
  BucketRound(const std::shared_ptr<PowerSGDState>& owner, c10d::GradBucket& bucket)
      : state(owner),
        bucket_index(bucket.getIndex()),
        is_last(bucket.isLast()),
        input(bucket.getBufferRef()) {}

  // The last step: remembers the error of the compression (`before` - `after`) when asked, counts
  // the bucket, and gives the future's value.
  c10::IValue finish(const at::Tensor& before, const at::Tensor& after) const {
    const std::shared_ptr<PowerSGDState> live = live_state(state);
    PowerSGDStateAccess::Memory& memory = PowerSGDStateAccess::memory(*live);
    std::lock_guard<std::mutex> lock(memory.mutex);
    if (live->options().use_error_feedback()) {
      // Into last iteration's error, already added to this one's gradients: no fresh pages.
      auto error = memory.error_dict.find(bucket_index);
      if (error != memory.error_dict.end() && error->second.sizes() == before.sizes()) {
        at::sub_out(error->second, before, after);
      } else {
        memory.error_dict[bucket_index] = before - after;
      }
    }
    memory.count_bucket(is_last);
    return c10::IValue(input);
  }

  std::weak_ptr<PowerSGDState> state;
  size_t bucket_index;
  bool is_last;
  at::Tensor input;
};

// powerSGD_hook's round.
struct LayerwiseRound : BucketRound {
  using BucketRound::BucketRound;

  at::Tensor input_copy;  // before compression, for the error feedback
  std::vector<at::Tensor> uncompressed;
  at::Tensor uncompressed_memory;
  // Per shape (batched or not): batch x rows x columns, and its factors.
  std::vector<at::Tensor> tensors_to_compress;
  std::vector<at::Tensor> ps;
  std::vector<at::Tensor> qs;
  // For a stacked batch: the gradients it was stacked from (empty for views into the bucket).
  std::vector<std::vector<at::Tensor>> stacked_from;
  at::Tensor p_memory;
  at::Tensor q_memory;
};

class PowerSGDHook : public PowerSGDHookBase {
 public:
  using PowerSGDHookBase::PowerSGDHookBase;

 protected:
  FuturePtr compress(c10d::GradBucket& bucket) override {
    const PowerSGDOptions& options = state_->options();
    const comm::Group& group = state_->process_group();
    PowerSGDStateAccess::Memory& memory = PowerSGDStateAccess::memory(*state_);
    auto round = std::make_shared<LayerwiseRound>(state_, bucket);
    const at::Tensor& input = round->input;
    const size_t index = round->bucket_index;
    {
      std::lock_guard<std::mutex> lock(memory.mutex);
      memory.forget_if_relaid(index, bucket.getGradients());
    }

    if (options.use_error_feedback()) {
      {
        std::lock_guard<std::mutex> lock(memory.mutex);
        auto error = memory.error_dict.find(index);
        if (error != memory.error_dict.end() && error->second.numel() == input.numel()) {
          input.add_(error->second);
        } else {
          memory.error_dict[index] = at::zeros({input.numel()}, input.options());
        }
      }
      round->input_copy = scratch(index, kInputCopy, input.numel(), input).view_as(input);
      round->input_copy.copy_(input);
    }

    // Step I: which gradients are worth compressing, grouped by shape in order of first
    // appearance (PyTorch's shape_to_tensors, whose order fixes the layout of P and Q).
    std::vector<std::pair<std::vector<int64_t>, std::vector<at::Tensor>>> by_shape;
    int64_t total_ps = 0;
    int64_t total_qs = 0;
    int64_t numel_before = 0;
    int64_t numel_after = 0;
    for (const at::Tensor& tensor : bucket.getGradients()) {
      // A scalar or empty gradient (which PyTorch cannot view as a matrix) goes uncompressed.
      if (tensor.dim() == 0 || tensor.numel() == 0) {
        round->uncompressed.push_back(tensor);
        numel_before += tensor.numel();
        numel_after += tensor.numel();
        continue;
      }
      const at::Tensor matrix = tensor.view({tensor.size(0), -1});
      const int64_t n = matrix.size(0);
      const int64_t m = matrix.size(1);
      const int64_t rank = std::min({n, m, options.matrix_approximation_rank()});
      const int64_t compressed_size = (n + m) * rank;
      numel_before += n * m;
      if (static_cast<double>(compressed_size) * options.min_compression_rate() <
          static_cast<double>(n * m)) {
        const std::vector<int64_t> shape = matrix.sizes().vec();
        auto same = std::find_if(by_shape.begin(), by_shape.end(),
                                 [&](const auto& entry) { return entry.first == shape; });
        if (same == by_shape.end()) {
          by_shape.emplace_back(shape, std::vector<at::Tensor>{});
          same = std::prev(by_shape.end());
        }
        same->second.push_back(matrix);
        total_ps += n * rank;
        total_qs += m * rank;
        numel_after += compressed_size;
      } else {
        round->uncompressed.push_back(tensor);
        numel_after += n * m;
      }
    }

    // Step II: the uncompressed gradients, as one tensor.
    if (round->uncompressed.empty()) {
      round->uncompressed_memory = at::empty({0}, input.options());
    } else {
      std::vector<at::Tensor> flat;
      for (const at::Tensor& tensor : round->uncompressed) flat.push_back(tensor.reshape({-1}));
      round->uncompressed_memory = at::cat(flat);
    }

    // Step III: P and Q, warm-started from the previous iteration when asked.
    bool randomize_qs = false;
    uint64_t seed = 0;
    {
      std::lock_guard<std::mutex> lock(memory.mutex);
      memory.total_numel_before_compression += numel_before;
      memory.total_numel_after_compression += numel_after;
      auto p = memory.p_memory_dict.find(index);
      auto q = memory.q_memory_dict.find(index);
      if (!options.warm_start() || p == memory.p_memory_dict.end() ||
          q == memory.q_memory_dict.end() || p->second.numel() != total_ps ||
          q->second.numel() != total_qs) {
        randomize_qs = true;
        round->p_memory = at::empty({total_ps}, input.options());
        round->q_memory = at::empty({total_qs}, input.options());
        if (options.warm_start()) {
          memory.p_memory_dict[index] = round->p_memory;
          memory.q_memory_dict[index] = round->q_memory;
        }
        seed = memory.next_seed();
      } else {
        round->p_memory = p->second;
        round->q_memory = memory.q_memory_dict.at(index);
      }
    }

    int64_t p_offset = 0;
    int64_t q_offset = 0;
    for (auto& entry : by_shape) {
      std::vector<at::Tensor> batches;
      if (options.batch_tensors_with_same_shape() && entry.second.size() > 1) {
        batches.push_back(at::stack(entry.second));
        round->stacked_from.push_back(entry.second);
      } else {
        for (const at::Tensor& matrix : entry.second) {
          batches.push_back(matrix.unsqueeze(0));
          round->stacked_from.emplace_back();
        }
      }
      for (const at::Tensor& batch : batches) {
        const int64_t count = batch.size(0);
        const int64_t n = batch.size(1);
        const int64_t m = batch.size(2);
        const int64_t rank = std::min({n, m, options.matrix_approximation_rank()});
        round->tensors_to_compress.push_back(batch);
        round->ps.push_back(
            round->p_memory.narrow(0, p_offset, count * n * rank).view({count, n, rank}));
        round->qs.push_back(
            round->q_memory.narrow(0, q_offset, count * m * rank).view({count, m, rank}));
        p_offset += count * n * rank;
        q_offset += count * m * rank;
      }
    }

    const double epsilon = options.orthogonalization_epsilon();
    if (randomize_qs) fill_random(round->qs, seed);
    for (const at::Tensor& q : round->qs) orthogonalize(q, epsilon);
    for (size_t i = 0; i < round->tensors_to_compress.size(); ++i) {
      at::bmm_out(round->ps[i], round->tensors_to_compress[i], round->qs[i]);
    }

    // Each step starts the next collective from the callback of the one before, never waiting in
    // it: the callback may run on the only thread that could run that collective.
    const int world_size = group.size();
    auto after_uncompressed = allreduce_sum(group, round->uncompressed_memory);
    auto after_ps = after_uncompressed->thenAsync(
        [round, world_size](c10::ivalue::Future& done) {
          rethrow_if_failed(done);
          const std::shared_ptr<PowerSGDState> state = live_state(round->state);
          round->uncompressed_memory.div_(world_size);
          int64_t offset = 0;
          for (const at::Tensor& tensor : round->uncompressed) {
            tensor.copy_(
                round->uncompressed_memory.narrow(0, offset, tensor.numel()).view_as(tensor));
            offset += tensor.numel();
          }
          // No division: the Ps are orthogonalized next.
          return allreduce_sum(state->process_group(), round->p_memory);
        },
        c10::TensorType::get());
    auto after_qs = after_ps->thenAsync(
        [round, epsilon](c10::ivalue::Future& done) {
          rethrow_if_failed(done);
          const std::shared_ptr<PowerSGDState> state = live_state(round->state);
          for (const at::Tensor& p : round->ps) orthogonalize(p, epsilon);
          for (size_t i = 0; i < round->tensors_to_compress.size(); ++i) {
            at::bmm_out(round->qs[i], round->tensors_to_compress[i].transpose(1, 2), round->ps[i]);
          }
          return allreduce_sum(state->process_group(), round->q_memory);
        },
        c10::TensorType::get());
    return after_qs->then(
        [round, world_size](c10::ivalue::Future& done) {
          rethrow_if_failed(done);
          round->q_memory.div_(world_size);
          for (size_t i = 0; i < round->tensors_to_compress.size(); ++i) {
            at::bmm_out(round->tensors_to_compress[i], round->ps[i], round->qs[i].transpose(1, 2));
            const std::vector<at::Tensor>& originals = round->stacked_from[i];
            for (size_t k = 0; k < originals.size(); ++k) {
              originals[k].copy_(round->tensors_to_compress[i][static_cast<int64_t>(k)]);
            }
          }
          return round->finish(round->input_copy, round->input);
        },
        c10::TensorType::get());
  }
};

// batched_powerSGD_hook's round.
struct BatchedRound : BucketRound {
  using BucketRound::BucketRound;

  at::Tensor padded;      // the bucket, with zeros up to a square
  at::Tensor input_copy;  // `padded` before compression, for the error feedback
  at::Tensor matrix;      // `padded` as a square
  at::Tensor p;
  at::Tensor q;
};

class BatchedPowerSGDHook : public PowerSGDHookBase {
 public:
  using PowerSGDHookBase::PowerSGDHookBase;

 protected:
  FuturePtr compress(c10d::GradBucket& bucket) override {
    const PowerSGDOptions& options = state_->options();
    const comm::Group& group = state_->process_group();
    PowerSGDStateAccess::Memory& memory = PowerSGDStateAccess::memory(*state_);
    auto round = std::make_shared<BatchedRound>(state_, bucket);
    const size_t index = round->bucket_index;
    {
      std::lock_guard<std::mutex> lock(memory.mutex);
      memory.forget_if_relaid(index, bucket.getGradients());
    }

    // PyTorch resizes the bucket itself; a padded copy leaves the Reducer's memory alone.
    const int64_t total_length = round->input.numel();
    const auto side = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(total_length))));
    const int64_t padded_length = side * side;
    const int64_t rank = std::min(side, options.matrix_approximation_rank());
    round->padded = scratch(index, kPadded, padded_length, round->input);
    round->padded.narrow(0, 0, total_length).copy_(round->input.reshape({-1}));
    round->padded.narrow(0, total_length, padded_length - total_length).zero_();

    bool randomize_q = false;
    uint64_t seed = 0;
    {
      std::lock_guard<std::mutex> lock(memory.mutex);
      memory.total_numel_before_compression += total_length;
      memory.total_numel_after_compression += side * options.matrix_approximation_rank() * 2;
      if (options.use_error_feedback()) {
        auto error = memory.error_dict.find(index);
        if (error != memory.error_dict.end() && error->second.numel() == padded_length) {
          round->padded.add_(error->second);
        } else {
          memory.error_dict[index] = at::zeros({padded_length}, round->input.options());
        }
      }
      auto p = memory.p_memory_dict.find(index);
      auto q = memory.q_memory_dict.find(index);
      if (!options.warm_start() || p == memory.p_memory_dict.end() ||
          q == memory.q_memory_dict.end() || p->second.numel() != side * rank ||
          q->second.numel() != side * rank) {
        randomize_q = true;
        round->p = at::empty({side, rank}, round->input.options());
        round->q = at::empty({side, rank}, round->input.options());
        if (options.warm_start()) {
          memory.p_memory_dict[index] = round->p;
          memory.q_memory_dict[index] = round->q;
        }
        seed = memory.next_seed();
      } else {
        round->p = p->second;
        round->q = memory.q_memory_dict.at(index);
      }
    }
    if (options.use_error_feedback()) {
      round->input_copy = scratch(index, kInputCopy, padded_length, round->padded);
      round->input_copy.copy_(round->padded);
    }
    round->matrix = round->padded.view({side, side});

    if (randomize_q) fill_random({round->q}, seed);
    orthogonalize(round->q.unsqueeze(0), 0);
    at::matmul_out(round->p, round->matrix, round->q);

    const int world_size = group.size();
    auto after_p = allreduce_sum(group, round->p);
    auto after_q = after_p->thenAsync(
        [round](c10::ivalue::Future& done) {
          rethrow_if_failed(done);
          const std::shared_ptr<PowerSGDState> state = live_state(round->state);
          orthogonalize(round->p.unsqueeze(0), 0);
          at::matmul_out(round->q, round->matrix.t(), round->p);
          return allreduce_sum(state->process_group(), round->q);
        },
        c10::TensorType::get());
    return after_q->then(
        [round, world_size, total_length](c10::ivalue::Future& done) {
          rethrow_if_failed(done);
          round->q.div_(world_size);
          at::matmul_out(round->matrix, round->p, round->q.t());
          round->input.copy_(round->padded.narrow(0, 0, total_length).view_as(round->input));
          return round->finish(round->input_copy, round->padded);
        },
        c10::TensorType::get());
  }
};

}  // namespace

std::unique_ptr<c10d::CommHookInterface> power_sgd_hook(std::shared_ptr<PowerSGDState> state) {
  TORCH_CHECK_VALUE(state != nullptr, "power_sgd_hook: state is null");
  return std::make_unique<PowerSGDHook>(std::move(state));
}

std::unique_ptr<c10d::CommHookInterface> batched_power_sgd_hook(
    std::shared_ptr<PowerSGDState> state) {
  TORCH_CHECK_VALUE(state != nullptr, "batched_power_sgd_hook: state is null");
  return std::make_unique<BatchedPowerSGDHook>(std::move(state));
}

}  // namespace data_parallel
}  // namespace distoptim
