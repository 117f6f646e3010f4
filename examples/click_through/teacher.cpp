#include "teacher.h"

#include <cmath>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace click_through {

namespace {

constexpr int64_t kFactorDim = 4;
constexpr double kBias = -1.0;  // fewer clicks than not, as CTR data are skewed
constexpr double kWeightStd = 0.35, kDenseStd = 0.3, kFactorStd = 0.14;

// SplitMix64's finalizer: a bijection of 64-bit words whose output bits all depend on every
// input bit.
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace

int64_t vocabulary_size(int64_t feature) {
  return std::llround(10 * std::pow(10000.0, static_cast<double>(feature) / (kCategorical - 1)));
}

Teacher::Teacher(uint64_t seed) {
  auto generator = at::detail::createCPUGenerator(seed);
  for (int64_t f = 0; f < kCategorical; ++f) {
    const int64_t v = vocabulary_size(f);
    weights_.push_back(at::randn({v}, generator) * kWeightStd);
    factors_.push_back(at::randn({v, kFactorDim}, generator) * kFactorStd);
  }
  dense_weights_ = at::randn({kDense}, generator) * kDenseStd;
}

Batch Teacher::draw(int64_t n, at::Generator& generator) const {
  Batch batch;
  std::vector<at::Tensor> ids;
  at::Tensor logit = at::full({n}, kBias);
  at::Tensor factor_sum = at::zeros({n, kFactorDim});
  at::Tensor factor_squares = at::zeros({n});
  for (int64_t f = 0; f < kCategorical; ++f) {
    const auto v = static_cast<double>(vocabulary_size(f));
    const at::Tensor u = at::rand({n}, generator, at::kDouble);
    // (V + 1)^u - 1 is below V for u < 1; the clamp guards the rounding at u's top.
    const at::Tensor id = (at::pow(v + 1, u).floor() - 1).clamp(0, v - 1).to(at::kLong);
    ids.push_back(id);
    logit += weights_[f].index_select(0, id);
    const at::Tensor e = factors_[f].index_select(0, id);
    factor_sum += e;
    factor_squares += (e * e).sum(1);
  }
  // sum_{f<g} <e_f, e_g> = (|sum_f e_f|^2 - sum_f |e_f|^2) / 2, as a factorization machine.
  logit += ((factor_sum * factor_sum).sum(1) - factor_squares) / 2;
  batch.ids = at::stack(ids, 1);
  batch.dense = at::randn({n, kDense}, generator);
  logit += at::mv(batch.dense, dense_weights_);
  batch.probability = at::sigmoid(logit);
  batch.labels = at::bernoulli(batch.probability, generator);
  return batch;
}

at::Tensor hashed_rows(const at::Tensor& ids, int64_t rows) {
  TORCH_CHECK_VALUE(rows >= 1, "hashed_rows: rows ", rows);
  TORCH_CHECK_VALUE(ids.dim() == 2 && ids.size(1) == kCategorical && ids.scalar_type() == at::kLong,
                    "hashed_rows: ids must be int64 [n, ", kCategorical, "], got ", ids.sizes());
  const at::Tensor in = ids.contiguous();
  at::Tensor out = at::empty_like(in);
  const int64_t* id = in.data_ptr<int64_t>();
  int64_t* row = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < in.numel(); ++i) {
    const auto feature = static_cast<uint64_t>(i % kCategorical);
    row[i] = static_cast<int64_t>(mix((feature << 40) ^ static_cast<uint64_t>(id[i])) %
                                  static_cast<uint64_t>(rows));
  }
  return out;
}

}  // namespace click_through
