#include "eval/plot_axis.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace kvbound {
namespace {

// The fraction of the ticks' span the view adds beyond each outer tick.
constexpr double kViewMargin = 0.03;

// `value` printed with the fewest decimals that show its leading digit: 0.005, 0.02, 0.5, 2, 10.
int decimals_for(double value) {
  return std::max(0, static_cast<int>(-std::floor(std::log10(value) + 1e-9)));
}

std::string tick_label(double value, int decimals) {
  char buffer[48];
  std::snprintf(buffer, sizeof buffer, "%.*f", decimals, value);
  return buffer;
}

ValueAxis linear_value_axis(double lo, double hi, double upper_bound) {
  double span = hi - lo;
  if (span <= 0.0) span = std::max(std::fabs(hi) * 0.1, 1e-3);
  lo = std::max(0.0, lo - 0.06 * span);
  hi = std::min(upper_bound, hi + 0.06 * span);
  if (hi <= lo) hi = lo + span;
  const double raw_step = (hi - lo) / 5.0;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw_step)));
  const double normalised = raw_step / magnitude;
  const double step = (normalised < 1.5 ? 1.0 : normalised < 3.0 ? 2.0 : normalised < 7.0 ? 5.0 : 10.0) * magnitude;
  // The small tolerance keeps a bound that is already a multiple of the step from growing a tick.
  const double axis_lo = std::floor(lo / step + 1e-9) * step;
  const double axis_hi = std::ceil(hi / step - 1e-9) * step;
  const int decimals = decimals_for(step);
  ValueAxis axis;
  const int tick_count = static_cast<int>(std::llround((axis_hi - axis_lo) / step)) + 1;
  for (int i = 0; i < tick_count; ++i) {
    const double tick = axis_lo + i * step;
    axis.ticks.push_back(std::fabs(tick) < 1e-9 * step ? 0.0 : tick);  // never print "-0.00"
    axis.labels.push_back(tick_label(axis.ticks.back(), decimals));
  }
  const double margin = kViewMargin * (axis_hi - axis_lo);
  axis.view_lo = axis_lo - margin;
  axis.view_hi = axis_hi + margin;
  return axis;
}

ValueAxis log_value_axis(double lo, double hi) {
  const int first_decade = static_cast<int>(std::floor(std::log10(lo) + 1e-9));
  const int last_decade = static_cast<int>(std::ceil(std::log10(hi) - 1e-9));
  const std::vector<double> mantissas =
      last_decade - first_decade <= 3 ? std::vector<double>{1.0, 2.0, 5.0} : std::vector<double>{1.0};
  std::vector<double> candidates;
  for (int decade = first_decade; decade <= last_decade; ++decade)
    for (double mantissa : mantissas) candidates.push_back(mantissa * std::pow(10.0, decade));
  // The outer ticks enclose the values; the relative tolerance keeps a value that is a tick from growing one.
  double axis_lo = candidates.front(), axis_hi = candidates.back();
  for (double tick : candidates)
    if (tick <= lo * (1.0 + 1e-9)) axis_lo = tick;
  for (auto it = candidates.rbegin(); it != candidates.rend(); ++it)
    if (*it >= hi * (1.0 - 1e-9)) axis_hi = *it;
  ValueAxis axis;
  axis.log_scale = true;
  for (double tick : candidates) {
    if (tick < axis_lo || tick > axis_hi) continue;
    axis.ticks.push_back(tick);
    axis.labels.push_back(tick_label(tick, decimals_for(tick)));
  }
  const double log_lo = std::log10(axis_lo), log_hi = std::log10(axis_hi);
  const double margin = kViewMargin * std::max(log_hi - log_lo, 1.0);
  axis.view_lo = log_lo - margin;
  axis.view_hi = log_hi + margin;
  return axis;
}

}  // namespace

double ValueAxis::fraction(double value) const {
  const double position = log_scale ? std::log10(value) : value;
  return (position - view_lo) / (view_hi - view_lo);
}

bool ValueAxis::shows(double value) const {
  if (!std::isfinite(value) || (log_scale && value <= 0.0)) return false;
  const double at = fraction(value);
  return at >= 0.0 && at <= 1.0;
}

ValueAxis value_axis(const std::vector<double>& values, double upper_bound, bool log_when_wide) {
  const double lo = *std::min_element(values.begin(), values.end());
  const double hi = *std::max_element(values.begin(), values.end());
  if (log_when_wide && lo >= kLogAxisFloor && hi >= 10.0 * lo) return log_value_axis(lo, hi);
  return linear_value_axis(lo, hi, upper_bound);
}

}  // namespace kvbound
