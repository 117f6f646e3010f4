// examples/click_through's measures: the rank-based AUC against the definition (every
// positive-negative pair, ties one half) on random scores with many ties, its edge cases, and the
// teacher's data (raw ids of items within their catalogues, growing ones growing, labels drawn
// from the probabilities kept with them, hashed rows in range).

#include <cmath>
#include <cstdint>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "metrics.h"
#include "teacher.h"

namespace click_through {
namespace {

// The AUC by its definition, over every pair: O(n^2).
double pairwise_auc(const at::Tensor& scores, const at::Tensor& labels) {
  const auto s = scores.accessor<float, 1>();
  const auto y = labels.accessor<float, 1>();
  double wins = 0;
  int64_t pairs = 0;
  for (int64_t i = 0; i < s.size(0); ++i) {
    for (int64_t j = 0; j < s.size(0); ++j) {
      if (y[i] == 1 && y[j] == 0) {
        wins += s[i] > s[j] ? 1 : s[i] == s[j] ? 0.5 : 0;
        ++pairs;
      }
    }
  }
  return wins / static_cast<double>(pairs);
}

TEST(ClickThroughMetrics, AucIsThePairwiseDefinitionWithTiesAsHalves) {
  auto generator = at::detail::createCPUGenerator(11);
  for (int64_t n : {2, 3, 17, 500}) {
    // Scores from 6 values only: many ties, within and across the labels.
    const at::Tensor scores = at::randint(0, 6, {n}, generator, at::kFloat) / 5;
    at::Tensor labels = at::bernoulli(at::full({n}, 0.4), generator);
    labels[0] = 1;
    labels[1] = 0;
    EXPECT_NEAR(roc_auc(scores, labels), pairwise_auc(scores, labels), 1e-12) << "n " << n;
  }
}

TEST(ClickThroughMetrics, AucEdgeCases) {
  const at::Tensor labels = at::tensor({0.f, 0.f, 1.f, 1.f});
  EXPECT_EQ(roc_auc(at::tensor({0.1f, 0.2f, 0.3f, 0.4f}), labels), 1.0);
  EXPECT_EQ(roc_auc(at::tensor({0.4f, 0.3f, 0.2f, 0.1f}), labels), 0.0);
  EXPECT_EQ(roc_auc(at::zeros({4}), labels), 0.5);
  EXPECT_EQ(roc_auc(at::tensor({0.1f, 0.3f, 0.3f, 0.4f}), labels), 0.875);
  EXPECT_TRUE(std::isnan(roc_auc(at::tensor({0.1f, 0.2f}), at::ones({2}))));
  EXPECT_THROW(roc_auc(at::zeros({3}), labels), c10::ValueError);
  EXPECT_THROW(roc_auc(at::zeros({4}), at::full({4}, 2.f)), c10::ValueError);
}

TEST(ClickThroughMetrics, LogLossAndEntropy) {
  // log(2) for a logit of 0, whatever the label; the entropy of a fair coin is log(2) too, of a
  // certain one 0.
  EXPECT_NEAR(log_loss(at::zeros({3}), at::tensor({0.f, 1.f, 1.f})), std::log(2.0), 1e-12);
  EXPECT_NEAR(log_loss(at::tensor({2.f}), at::tensor({1.f})), std::log1p(std::exp(-2.0)), 1e-7);
  EXPECT_NEAR(mean_entropy(at::tensor({0.5f, 0.f, 1.f})), std::log(2.0) / 3, 1e-12);
}

TEST(ClickThroughMetrics, TeacherLabelsFollowItsProbabilities) {
  const Teacher teacher(1);
  auto generator = at::detail::createCPUGenerator(5);
  constexpr int64_t kTime = 2000;
  const Batch batch = teacher.draw(20000, kTime, generator);
  ASSERT_EQ(batch.ids.sizes(), (at::IntArrayRef{20000, kCategorical}));
  ASSERT_EQ(batch.items.sizes(), (at::IntArrayRef{20000, kCategorical}));
  for (int64_t f = 0; f < kCategorical; ++f) {
    const at::Tensor items = batch.items.select(1, f);
    EXPECT_GE(items.min().item<int64_t>(), 0);
    EXPECT_LT(items.max().item<int64_t>(), catalogue_size(f, kTime));
    // Static catalogues keep their size; growing ones gain vocabulary_size / 1000 items a step.
    EXPECT_EQ(catalogue_size(f, kTime),
              vocabulary_size(f) + (f < kGrowingFrom ? 0 : kTime * (vocabulary_size(f) / 1000)))
        << "feature " << f;
  }
  // Each id is its item's raw id: one to one over a sample's features.
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t f = 0; f < kCategorical; ++f) {
      EXPECT_EQ(batch.ids[i][f].item<int64_t>(), raw_id(f, batch.items[i][f].item<int64_t>()));
    }
  }
  // The labels' mean is the probabilities' mean, within 4 standard errors.
  const double p = batch.probability.mean().item<double>();
  EXPECT_NEAR(batch.labels.mean().item<double>(), p, 4 * std::sqrt(p * (1 - p) / 20000));
  // The teacher's own probabilities score its labels far better than chance; its log loss on
  // them is its entropy, within sampling error.
  EXPECT_GT(roc_auc(batch.probability, batch.labels), 0.75);
  EXPECT_NEAR(log_loss(at::logit(batch.probability), batch.labels), mean_entropy(batch.probability),
              0.02);
  // Zipf-like: item 0 of the largest static catalogue, and the newest item of the largest
  // growing one, are drawn far more often than uniform would.
  const auto share_of = [&](int64_t f, int64_t item) {
    return (batch.items.select(1, f) == item).to(at::kDouble).mean().item<double>();
  };
  EXPECT_GT(share_of(kGrowingFrom - 1, 0), 0.05);
  EXPECT_GT(share_of(kCategorical - 1, catalogue_size(kCategorical - 1, kTime) - 1), 0.03);

  const at::Tensor rows = hashed_rows(batch.ids, 1000);
  EXPECT_GE(rows.min().item<int64_t>(), 0);
  EXPECT_LT(rows.max().item<int64_t>(), 1000);
  // Feature 0's and feature 1's item 0 are different ids, on different rows.
  const at::Tensor first_items = at::tensor({raw_id(0, 0), raw_id(1, 0)}, at::kLong);
  const at::Tensor hashed =
      hashed_rows(first_items.repeat({kCategorical / 2}).reshape({1, -1}), 1 << 20);
  EXPECT_NE(hashed[0][0].item<int64_t>(), hashed[0][1].item<int64_t>());
}

}  // namespace
}  // namespace click_through
