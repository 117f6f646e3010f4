#include "metrics.h"

#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace click_through {

double roc_auc(const at::Tensor& scores, const at::Tensor& labels) {
  TORCH_CHECK_VALUE(scores.dim() == 1 && labels.dim() == 1 && scores.numel() == labels.numel(),
                    "roc_auc: scores ", scores.sizes(), " and labels ", labels.sizes(),
                    " must be 1-D of one length");
  const at::Tensor s = scores.to(at::kDouble).contiguous();
  const at::Tensor y = labels.to(at::kDouble).contiguous();
  TORCH_CHECK_VALUE(((y == 0) | (y == 1)).all().item<bool>(), "roc_auc: labels must be 0 or 1");
  const int64_t n = s.numel();
  const at::Tensor order = s.argsort();
  const double* score = s.data_ptr<double>();
  const double* label = y.data_ptr<double>();
  const int64_t* index = order.data_ptr<int64_t>();
  // Ranks from 1; a run of equal scores gets the mean of its ranks.
  double positive_rank_sum = 0;
  int64_t positives = 0;
  for (int64_t first = 0; first < n;) {
    int64_t end = first + 1;
    while (end < n && score[index[end]] == score[index[first]]) ++end;
    const double rank = (static_cast<double>(first + 1) + static_cast<double>(end)) / 2;
    for (int64_t i = first; i < end; ++i) {
      if (label[index[i]] == 1) {
        positive_rank_sum += rank;
        ++positives;
      }
    }
    first = end;
  }
  const int64_t negatives = n - positives;
  if (positives == 0 || negatives == 0) return NAN;
  const double p = static_cast<double>(positives);
  return (positive_rank_sum - p * (p + 1) / 2) / (p * static_cast<double>(negatives));
}

double log_loss(const at::Tensor& logits, const at::Tensor& labels) {
  return at::binary_cross_entropy_with_logits(logits.to(at::kDouble), labels.to(at::kDouble))
      .item<double>();
}

double mean_entropy(const at::Tensor& probabilities) {
  const at::Tensor p = probabilities.to(at::kDouble);
  // xlogy: 0 log 0 = 0.
  return -(at::xlogy(p, p) + at::xlogy(1 - p, 1 - p)).mean().item<double>();
}

}  // namespace click_through
