#include "train/tensorboard/histogram.h"

#include <algorithm>
#include <cmath>

namespace kvbound {

Histogram make_histogram(const std::vector<double>& values, int buckets) {
  Histogram h;
  if (values.empty()) return h;
  h.min = *std::min_element(values.begin(), values.end());
  h.max = *std::max_element(values.begin(), values.end());
  h.num = static_cast<double>(values.size());
  for (double v : values) {
    h.sum += v;
    h.sum_squares += v * v;
  }
  const int n = h.max > h.min ? buckets : 1;
  const double width = (h.max - h.min) / n;
  h.bucket.assign(static_cast<std::size_t>(n), 0.0);
  for (int i = 0; i < n; ++i) h.bucket_limit.push_back(i + 1 == n ? h.max : h.min + width * (i + 1));
  for (double v : values) {
    const int i = n == 1 ? 0 : std::min(n - 1, static_cast<int>(std::floor((v - h.min) / width)));
    h.bucket[static_cast<std::size_t>(i)] += 1;
  }
  return h;
}

}  // namespace kvbound
