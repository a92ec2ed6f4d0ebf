// A TensorBoard histogram's numbers (the HistogramProto fields), computed without protobuf.
#pragma once
#include <vector>

namespace kvbound {

struct Histogram {
  double min = 0, max = 0, num = 0, sum = 0, sum_squares = 0;
  std::vector<double> bucket_limit;  // right edge of each bucket
  std::vector<double> bucket;        // count per bucket
};

// `values` in `buckets` equal-width buckets between their min and max (one bucket when all are equal).
Histogram make_histogram(const std::vector<double>& values, int buckets = 30);

}  // namespace kvbound
