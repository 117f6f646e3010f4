#include "teacher.h"

#include <array>
#include <cmath>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace click_through {

namespace {

constexpr int64_t kFactorDim = 4;
constexpr double kBias = -1.0;  // fewer clicks than not, as CTR data are skewed
constexpr double kWeightStd = 0.35, kDenseStd = 0.3, kFactorStd = 0.14;
// A growing catalogue gains vocabulary_size / kGrowthDivisor items a step.
constexpr int64_t kGrowthDivisor = 1000;

// SplitMix64's finalizer: a bijection of 64-bit words whose output bits all depend on every
// input bit.
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// A uniform number in (0, 1] from a hash's top 53 bits.
double unit_interval(uint64_t hash) { return (static_cast<double>(hash >> 11) + 1) * 0x1p-53; }

// The teacher's 1 + kFactorDim standard normal numbers of `id`: Box-Muller over hashes of the
// seed and the id, so that any id of an unbounded space has them without a table.
std::array<double, 1 + kFactorDim> standard_normals(uint64_t seed, uint64_t id) {
  std::array<double, 1 + kFactorDim> out{};
  const uint64_t key = mix(id ^ seed);
  for (size_t i = 0; i < out.size(); i += 2) {
    const double radius = std::sqrt(-2 * std::log(unit_interval(mix(key + 2 * i))));
    const double angle = 2 * M_PI * unit_interval(mix(key + 2 * i + 1));
    out[i] = radius * std::cos(angle);
    if (i + 1 < out.size()) out[i + 1] = radius * std::sin(angle);
  }
  return out;
}

}  // namespace

int64_t vocabulary_size(int64_t feature) {
  return std::llround(10 * std::pow(10000.0, static_cast<double>(feature) / (kCategorical - 1)));
}

int64_t catalogue_size(int64_t feature, int64_t time) {
  const int64_t start = vocabulary_size(feature);
  return feature < kGrowingFrom ? start : start + time * (start / kGrowthDivisor);
}

int64_t raw_id(int64_t feature, int64_t item) {
  return static_cast<int64_t>(
      mix((static_cast<uint64_t>(feature) << 40) ^ static_cast<uint64_t>(item)));
}

Teacher::Teacher(uint64_t seed) : seed_(mix(seed)) {
  auto generator = at::detail::createCPUGenerator(seed);
  dense_weights_ = at::randn({kDense}, generator) * kDenseStd;
}

Batch Teacher::draw(int64_t n, int64_t time, at::Generator& generator) const {
  TORCH_CHECK_VALUE(n >= 1 && time >= 0, "Teacher::draw: n ", n, ", time ", time);
  Batch batch;
  batch.items = at::empty({n, kCategorical}, at::kLong);
  for (int64_t f = 0; f < kCategorical; ++f) {
    const auto catalogue = static_cast<double>(catalogue_size(f, time));
    const at::Tensor u = at::rand({n}, generator, at::kDouble);
    // (C + 1)^u - 1 is below C for u < 1; the clamp guards the rounding at u's top.
    const at::Tensor rank = (at::pow(catalogue + 1, u).floor() - 1).clamp(0, catalogue - 1);
    batch.items.select(1, f).copy_(f < kGrowingFrom ? rank : (catalogue - 1) - rank);
  }
  batch.ids = at::empty_like(batch.items);
  at::Tensor logit = at::empty({n}, at::kDouble);
  const int64_t* item = batch.items.data_ptr<int64_t>();
  int64_t* id = batch.ids.data_ptr<int64_t>();
  double* out = logit.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    // sum_{f<g} <e_f, e_g> = (|sum_f e_f|^2 - sum_f |e_f|^2) / 2, as a factorization machine.
    std::array<double, kFactorDim> factor_sum{};
    double sum = kBias, factor_squares = 0;
    for (int64_t f = 0; f < kCategorical; ++f) {
      const int64_t k = i * kCategorical + f;
      id[k] = raw_id(f, item[k]);
      const auto z = standard_normals(seed_, static_cast<uint64_t>(id[k]));
      sum += kWeightStd * z[0];
      for (int64_t d = 0; d < kFactorDim; ++d) {
        const double e = kFactorStd * z[1 + d];
        factor_sum[d] += e;
        factor_squares += e * e;
      }
    }
    double pairs = -factor_squares;
    for (const double s : factor_sum) pairs += s * s;
    out[i] = sum + pairs / 2;
  }
  batch.dense = at::randn({n, kDense}, generator);
  logit += at::mv(batch.dense, dense_weights_).to(at::kDouble);
  batch.probability = at::sigmoid(logit).to(at::kFloat);
  batch.labels = at::bernoulli(batch.probability, generator);
  return batch;
}

Batch Teacher::training_batch(int64_t run_seed, int64_t trainer, int64_t step, int64_t n) const {
  // The generator keeps only the low 32 bits of its seed: the trainer and the step move those.
  auto generator = at::detail::createCPUGenerator(static_cast<uint64_t>(run_seed) * 0x9E3779B1u +
                                                  static_cast<uint64_t>(trainer + 1) * 0x85EBCA77u +
                                                  static_cast<uint64_t>(step));
  return draw(n, step, generator);
}

Batch Teacher::held_out(int64_t run_seed, int64_t steps, int64_t n) const {
  auto generator = at::detail::createCPUGenerator(static_cast<uint64_t>(run_seed * 1000));
  return draw(n, steps, generator);
}

at::Tensor hashed_rows(const at::Tensor& ids, int64_t rows) {
  TORCH_CHECK_VALUE(rows >= 1, "hashed_rows: rows ", rows);
  TORCH_CHECK_VALUE(ids.dim() == 2 && ids.size(1) == kCategorical && ids.scalar_type() == at::kLong,
                    "hashed_rows: ids must be int64 [n, ", kCategorical, "], got ", ids.sizes());
  // Raw ids are spread over all 64-bit values already: their remainder is the row.
  return ids.contiguous().view(at::kLong).remainder(rows);
}

}  // namespace click_through
