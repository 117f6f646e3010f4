#pragma once

// The click-through example's measures of a predictor on labelled samples.

#include <ATen/core/Tensor.h>

namespace click_through {

/// The area under the ROC curve of `scores` (any real numbers, higher meaning "more likely 1")
/// for the 0/1 `labels` (same length): the probability that a random positive scores above a
/// random negative, a tie counting one half. Computed from ranks (Mann-Whitney U), tied scores
/// sharing their average rank, in O(n log n). NaN when all labels are equal. c10::ValueError for
/// tensors that are not 1-D, of different lengths, or labels other than 0 and 1.
double roc_auc(const at::Tensor& scores, const at::Tensor& labels);

/// The mean log loss (binary cross-entropy, natural log) of the logits for the 0/1 labels.
double log_loss(const at::Tensor& logits, const at::Tensor& labels);

/// The mean entropy of Bernoulli(probabilities): the expected log loss of a predictor that knows
/// the probabilities, the best any predictor can expect on labels drawn from them.
double mean_entropy(const at::Tensor& probabilities);

}  // namespace click_through
