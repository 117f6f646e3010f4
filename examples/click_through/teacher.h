#pragma once

// The click-through example's data: samples drawn from a fixed random "teacher" model, so the
// best log loss any model can reach on them is known.
//
// A sample has 26 categorical features and 13 dense ones, as Criteo's click logs do. Each
// categorical value is a raw 64-bit id, as a click log's hashed user, ad or query ids are:
// raw_id(f, item) for item `item` of feature f, unrelated to any table's size. Feature f's items
// come from a catalogue of catalogue_size(f, time) items, drawn Zipf-like: a rank
// r = floor((C + 1)^u) - 1 for u uniform in [0, 1), so rank k comes with probability about
// 1 / ((k + 1) ln(C + 1)) and a few items make up most of the traffic.
// - The first half of the features (the smaller catalogues, 10 to 832 items) are static:
//   item = rank, over a catalogue of vocabulary_size(f) items.
// - The other half grow, as new ads, queries and users keep arriving: their catalogue starts at
//   vocabulary_size(f) items (1,202 to 100,000) and gains vocabulary_size(f) / 1000 new
//   items every step; the rank counts back from the newest item (item = C - 1 - r), so new items
//   are the popular ones and an item fades as newer ones arrive. Most items are seen rarely; the
//   id space is unbounded.
// `time` is the trainer's step (each trainer's step `s` draws at time s; the held-out set at the
// last step's time, the model's future traffic).
//
// Dense features are normal(0, 1). The teacher's logit is
//
//   bias + sum_f w(id_f) + <v, dense> + sum_{f < g} <e(id_f), e(id_g)>
//
// with w(id) ~ normal(0, 0.35^2) and 4-dimensional factors e(id) ~ normal(0, 0.14^2) per id (the
// pairwise part, as a factorization machine's), functions of the teacher's seed and the id alone
// (hashed, so that an unbounded id space needs no table), and v ~ normal(0, 0.3^2) per dense
// feature; the label is Bernoulli(sigmoid(logit)). Its probability is kept with each sample: the
// mean entropy of the labels given the features is the teacher's expected log loss, the floor
// for any model.

#include <cstdint>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

namespace click_through {

constexpr int64_t kCategorical = 26;
constexpr int64_t kDense = 13;
/// Features kGrowingFrom .. kCategorical - 1 have catalogues that grow with time.
constexpr int64_t kGrowingFrom = kCategorical / 2;

/// Samples, one per row.
struct Batch {
  at::Tensor ids;          // [n, kCategorical] int64: raw_id(f, items[., f])
  at::Tensor items;        // [n, kCategorical] int64: feature f's item, in [0, catalogue_size)
  at::Tensor dense;        // [n, kDense] float
  at::Tensor labels;       // [n] float, 0 or 1
  at::Tensor probability;  // [n] float: the teacher's probability of label 1
};

/// Feature `feature`'s catalogue at time 0: 10 to 100,000 items, growing geometrically with f.
int64_t vocabulary_size(int64_t feature);
/// Feature `feature`'s items at `time` (>= 0).
int64_t catalogue_size(int64_t feature, int64_t time);
/// The raw id of item `item` of feature `feature`: one to one, spread over all 64-bit values.
int64_t raw_id(int64_t feature, int64_t item);

class Teacher {
 public:
  explicit Teacher(uint64_t seed);
  /// `n` samples drawn at `time` with `generator` (items, dense features, then labels).
  Batch draw(int64_t n, int64_t time, at::Generator& generator) const;
  /// The example's batches, drawn from (run_seed, trainer, step) alone, so that a trainer
  /// started again draws its slot's batches and a benchmark of another implementation can read
  /// the same: trainer `trainer`'s (from 0) `n` samples of step `step` (from 1), at time `step`.
  Batch training_batch(int64_t run_seed, int64_t trainer, int64_t step, int64_t n) const;
  /// The held-out set of a run of `steps` steps: `n` samples at the last step's time.
  Batch held_out(int64_t run_seed, int64_t steps, int64_t n) const;

 private:
  uint64_t seed_;
  at::Tensor dense_weights_;  // [kDense]
};

/// Each raw id hashed to a row of one table of `rows` rows shared by every feature (the hashing
/// trick; the feature is part of the raw id, so features' ids spread independently over the
/// table). [n, kCategorical] int64 in [0, rows).
at::Tensor hashed_rows(const at::Tensor& ids, int64_t rows);

}  // namespace click_through
