// The value (y) axis of the quality plots: where ticks go, how they read, and where a value lands. Kept
// apart from the cairo drawing so that the scale rules are tested without rendering.
#pragma once
#include <string>
#include <vector>

namespace kvbound {

struct ValueAxis {
  bool log_scale = false;
  std::vector<double> ticks;        // values, ascending, each with a grid line and a label
  std::vector<std::string> labels;  // one per tick
  double view_lo = 0.0, view_hi = 1.0;  // the range shown, in axis units (log10 of the value on a log axis)

  // Where `value` sits between the bottom (0) and the top (1) of the plot.
  double fraction(double value) const;
  // Whether `value` lies in the view (a log axis has no place for a value <= 0).
  bool shows(double value) const;
};

// A value below this is zero up to rounding, not a magnitude to spread decades for: the KL of a budget that
// holds the whole context comes out near 1e-9 in float32.
constexpr double kLogAxisFloor = 1e-6;

// The axis for a metric's `values`: log10 when the metric allows it (`log_when_wide`) and the values are all
// at least kLogAxisFloor and span at least a factor of 10 (the KL of learned policies and of heuristics lies
// decades apart: on a linear axis the small ones sit on top of each other), linear otherwise.
// Linear: ticks at whole multiples of a 1/2/5 x 10^k step covering the values with a little padding, kept
// within [0, upper_bound] (every quality metric is non-negative; fractions stop at 1).
// Log: ticks at 1, 2 and 5 x 10^k when the whole decades enclosing the values are at most three, at 10^k
// alone beyond that, from the largest tick at or below the smallest value to the smallest tick at or above
// the largest.
// Either way the view extends a little past the outer ticks, so that a line at a bound (agreement of 1)
// does not hide under the plot frame. `values` must not be empty.
ValueAxis value_axis(const std::vector<double>& values, double upper_bound, bool log_when_wide);

}  // namespace kvbound
