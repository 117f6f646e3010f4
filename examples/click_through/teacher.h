#pragma once

// The click-through example's data: samples drawn from a fixed random "teacher" model, so the
// best log loss any model can reach on them is known.
//
// A sample has 26 categorical features and 13 dense ones, as Criteo's click logs do. Feature f's
// ids come from a vocabulary of vocabulary_size(f) ids (10 to 100,000, growing geometrically with
// f), drawn Zipf-like: id = floor((V + 1)^u) - 1 for u uniform in [0, 1), so id k comes with
// probability about 1 / ((k + 1) ln(V + 1)) and a few ids make up most of the traffic. Dense
// features are normal(0, 1). The teacher's logit is
//
//   bias + sum_f w_f[id_f] + <v, dense> + sum_{f < g} <e_f[id_f], e_g[id_g]>
//
// with w_f[k] ~ normal(0, 0.35^2), v ~ normal(0, 0.3^2) per dense feature, 4-dimensional factors
// e_f[k] ~ normal(0, 0.14^2) (the pairwise part, as a factorization machine's), all drawn once
// from the seed; the label is Bernoulli(sigmoid(logit)). Its probability is kept with each
// sample: the mean entropy of the labels given the features is the teacher's expected log loss,
// the floor for any model.

#include <cstdint>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

namespace click_through {

constexpr int64_t kCategorical = 26;
constexpr int64_t kDense = 13;

/// Samples, one per row.
struct Batch {
  at::Tensor ids;          // [n, kCategorical] int64: feature f's id in [0, vocabulary_size(f))
  at::Tensor dense;        // [n, kDense] float
  at::Tensor labels;       // [n] float, 0 or 1
  at::Tensor probability;  // [n] float: the teacher's probability of label 1
};

/// Ids of feature `feature` are in [0, vocabulary_size(feature)).
int64_t vocabulary_size(int64_t feature);

class Teacher {
 public:
  /// The teacher drawn from `seed` (about 1.6 million numbers; a fraction of a second).
  explicit Teacher(uint64_t seed);
  /// `n` samples drawn with `generator` (ids, dense features, then labels).
  Batch draw(int64_t n, at::Generator& generator) const;

 private:
  std::vector<at::Tensor> weights_;  // per feature: [vocabulary] first-order weights
  std::vector<at::Tensor> factors_;  // per feature: [vocabulary, 4] pairwise factors
  at::Tensor dense_weights_;         // [kDense]
};

/// Each (sample, feature) id hashed to a row of one table of `rows` rows shared by every feature
/// (the hashing trick: the feature takes part in the hash, so features' ids spread independently
/// over the table). [n, kCategorical] int64 in [0, rows).
at::Tensor hashed_rows(const at::Tensor& ids, int64_t rows);

}  // namespace click_through
