#include "eval/plots.h"

#include <cairo.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <utility>

#include "base/atomic_file.h"
#include "base/errors.h"
#include "eval/plot_axis.h"

namespace kvbound {
namespace {

constexpr int kWidth = 900;
constexpr int kHeight = 600;
constexpr const char* kFontFamily = "sans-serif";

struct Rgb {
  double r, g, b;
};

Rgb hex(unsigned value) {
  return {((value >> 16) & 0xFF) / 255.0, ((value >> 8) & 0xFF) / 255.0, (value & 0xFF) / 255.0};
}

// Tableau's categorical colours without its grey (grey is the `full` reference) plus five darker ones
// that stay apart from them: 14 policies get distinct colours; beyond that the colours repeat with a
// different dash pattern.
const std::vector<Rgb>& palette() {
  static const std::vector<Rgb> colours = {
      hex(0x1F77B4), hex(0xFF7F0E), hex(0x2CA02C), hex(0xD62728), hex(0x9467BD), hex(0x8C564B), hex(0xE377C2),
      hex(0xBCBD22), hex(0x17BECF), hex(0x393B79), hex(0x637939), hex(0xAD494A), hex(0x7B4173), hex(0x8C6D31),
  };
  return colours;
}
const Rgb kFullColour = hex(0x444444);
const Rgb kTextColour = hex(0x222222);
const Rgb kAxisColour = hex(0x555555);
const Rgb kGridColour = hex(0xE3E3E3);
const std::vector<double> kReferenceDash = {7.0, 5.0};

enum class Marker { Circle, Square, Triangle, Diamond };

struct SeriesStyle {
  Rgb colour;
  Marker marker;
  std::vector<double> dash;  // empty = solid
};

SeriesStyle style_for_index(std::size_t index) {
  static const Marker markers[] = {Marker::Circle, Marker::Square, Marker::Triangle, Marker::Diamond};
  static const std::vector<std::vector<double>> dashes = {{}, {10.0, 4.0}, {2.0, 3.0}, {10.0, 3.0, 2.0, 3.0}};
  const std::size_t colours = palette().size();
  return {palette()[index % colours], markers[index % 4], dashes[(index / colours) % dashes.size()]};
}

struct MetricPlot {
  const char* metric;
  const char* quantity;  // the plot's title is "<quantity> vs <the x axis>"
  const char* y_label;    // the value and its unit
  const char* direction;  // "lower is better" or "higher is better", after the label
  double upper_bound;   // fractions never exceed 1, so the padded axis stops there
  bool log_when_wide;   // a log axis when the values span a factor of 10 or more (plot_axis.h)
};

const std::vector<MetricPlot>& metric_plots() {
  constexpr double kNoBound = std::numeric_limits<double>::infinity();
  static const std::vector<MetricPlot> plots = {
      {metric::kKlToFull, "KL divergence to the full cache",
       "KL(p_full \u2016 p_budgeted), nats/token", "lower is better", kNoBound, true},
      {metric::kTop1Agree, "Top-1 agreement with the full cache",
       "top-1 agreement with full cache", "higher is better", 1.0, false},
      {metric::kNll, "Next-token NLL", "NLL, nats/token", "lower is better", kNoBound, false},
      {metric::kRetrievalAcc, "Retrieval accuracy", "retrieval accuracy", "higher is better", 1.0, false},
  };
  return plots;
}

// What one policy (or one sweep series) contributes to one plot.
struct Series {
  std::string policy;
  SeriesStyle style;
  std::vector<std::pair<double, double>> points;  // (x position, value), x ascending
  double reference = std::numeric_limits<double>::quiet_NaN();  // the unbounded row's value, if any
  bool has_reference() const { return std::isfinite(reference); }
};

// The x axis: a tick and label at each position (budgets on a log2 scale, or a swept key's values in order).
struct XAxis {
  std::vector<double> ticks;
  std::vector<std::string> labels;
  std::string title;    // under the axis
  std::string against;  // in the plot title: "<quantity> vs <against>"
};

using CairoSurface = std::unique_ptr<cairo_surface_t, decltype(&cairo_surface_destroy)>;
using CairoContext = std::unique_ptr<cairo_t, decltype(&cairo_destroy)>;

class Canvas {
 public:
  explicit Canvas(cairo_t* cr) : cr_(cr) {}

  void colour(const Rgb& c) { cairo_set_source_rgb(cr_, c.r, c.g, c.b); }

  void font(double size, bool bold = false) {
    cairo_select_font_face(cr_, kFontFamily, CAIRO_FONT_SLANT_NORMAL,
                           bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
    cairo_set_font_size(cr_, size);
  }

  double text_width(const std::string& text) {
    cairo_text_extents_t extents;
    cairo_text_extents(cr_, text.c_str(), &extents);
    return extents.x_advance;
  }

  // Draws `text` with its horizontal anchor at x (align 0 = left, 0.5 = centre, 1 = right) and its
  // vertical centre at y, using the font's ascent/descent so labels of one size line up.
  void text(const std::string& text, double x, double y, double align) {
    cairo_font_extents_t font_extents;
    cairo_font_extents(cr_, &font_extents);
    cairo_move_to(cr_, x - align * text_width(text), y + (font_extents.ascent - font_extents.descent) / 2.0);
    cairo_show_text(cr_, text.c_str());
  }

  void vertical_text(const std::string& text, double x, double y) {
    cairo_save(cr_);
    cairo_translate(cr_, x, y);
    cairo_rotate(cr_, -M_PI / 2.0);
    this->text(text, 0.0, 0.0, 0.5);
    cairo_restore(cr_);
  }

  // A line of `width` px from (x0, y0) to (x1, y1); odd widths on integer coordinates are shifted half a
  // pixel so axis and grid lines stay sharp.
  void line(double x0, double y0, double x1, double y1, double width) {
    const double shift = std::fmod(width, 2.0) == 1.0 ? 0.5 : 0.0;
    cairo_set_line_width(cr_, width);
    cairo_move_to(cr_, std::round(x0) + shift, std::round(y0) + shift);
    cairo_line_to(cr_, std::round(x1) + shift, std::round(y1) + shift);
    cairo_stroke(cr_);
  }

  void dash(const std::vector<double>& pattern) {
    cairo_set_dash(cr_, pattern.empty() ? nullptr : pattern.data(), static_cast<int>(pattern.size()), 0.0);
  }

  void polyline(const std::vector<std::pair<double, double>>& points, double width) {
    cairo_set_line_width(cr_, width);
    cairo_set_line_join(cr_, CAIRO_LINE_JOIN_ROUND);
    cairo_set_line_cap(cr_, CAIRO_LINE_CAP_ROUND);
    cairo_move_to(cr_, points.front().first, points.front().second);
    for (std::size_t i = 1; i < points.size(); ++i) cairo_line_to(cr_, points[i].first, points[i].second);
    cairo_stroke(cr_);
  }

  // A filled marker with a white rim, so markers stay visible where lines cross them.
  void marker(Marker shape, double x, double y, double radius, const Rgb& fill) {
    switch (shape) {
      case Marker::Circle: cairo_arc(cr_, x, y, radius, 0.0, 2.0 * M_PI); break;
      case Marker::Square:
        cairo_rectangle(cr_, x - radius * 0.85, y - radius * 0.85, radius * 1.7, radius * 1.7);
        break;
      case Marker::Triangle:
        cairo_move_to(cr_, x, y - radius * 1.15);
        cairo_line_to(cr_, x + radius * 1.05, y + radius * 0.75);
        cairo_line_to(cr_, x - radius * 1.05, y + radius * 0.75);
        cairo_close_path(cr_);
        break;
      case Marker::Diamond:
        cairo_move_to(cr_, x, y - radius * 1.2);
        cairo_line_to(cr_, x + radius * 1.2, y);
        cairo_line_to(cr_, x, y + radius * 1.2);
        cairo_line_to(cr_, x - radius * 1.2, y);
        cairo_close_path(cr_);
        break;
    }
    colour(fill);
    cairo_fill_preserve(cr_);
    colour({1.0, 1.0, 1.0});
    cairo_set_line_width(cr_, 1.0);
    dash({});
    cairo_stroke(cr_);
  }

  cairo_t* raw() { return cr_; }

 private:
  cairo_t* cr_;
};

// Shortens `text` with a trailing ellipsis until it fits `max_width` in the current font.
std::string fit_text(Canvas& canvas, std::string text, double max_width) {
  if (canvas.text_width(text) <= max_width) return text;
  const std::string ellipsis = "\u2026";
  while (!text.empty() && canvas.text_width(text + ellipsis) > max_width) {
    text.pop_back();
    while (!text.empty() && (static_cast<unsigned char>(text.back()) & 0xC0) == 0x80) text.pop_back();
    if (!text.empty() && (static_cast<unsigned char>(text.back()) & 0xC0) == 0xC0) text.pop_back();
  }
  return text + ellipsis;
}

cairo_status_t append_png_bytes(void* closure, const unsigned char* data, unsigned int length) {
  static_cast<std::string*>(closure)->append(reinterpret_cast<const char*>(data), length);
  return CAIRO_STATUS_SUCCESS;
}

// Renders one metric's plot and returns the PNG bytes.
std::string render_plot(const MetricPlot& spec, const XAxis& x_axis, const std::vector<Series>& all_series,
                        const std::string& subtitle, const std::string& path) {
  CairoSurface surface(cairo_image_surface_create(CAIRO_FORMAT_ARGB32, kWidth, kHeight), cairo_surface_destroy);
  CairoContext context(cairo_create(surface.get()), cairo_destroy);
  Canvas canvas(context.get());
  cairo_t* cr = canvas.raw();
  cairo_set_antialias(cr, CAIRO_ANTIALIAS_GOOD);
  cairo_font_options_t* font_options = cairo_font_options_create();
  cairo_font_options_set_antialias(font_options, CAIRO_ANTIALIAS_GRAY);
  cairo_font_options_set_hint_metrics(font_options, CAIRO_HINT_METRICS_OFF);
  cairo_set_font_options(cr, font_options);
  cairo_font_options_destroy(font_options);

  canvas.colour({1.0, 1.0, 1.0});
  cairo_paint(cr);

  // A log axis is chosen on the lines alone; a reference line outside their range (the full cache's KL,
  // 0 up to rounding) is then left out, legend entry included. A linear axis covers the references too.
  std::vector<double> values, line_values;
  for (const Series& s : all_series) {
    for (const auto& [x, value] : s.points) line_values.push_back(value);
    if (s.has_reference()) values.push_back(s.reference);
  }
  values.insert(values.end(), line_values.begin(), line_values.end());
  ValueAxis y_axis = value_axis(line_values, spec.upper_bound, spec.log_when_wide);
  if (!y_axis.log_scale) y_axis = value_axis(values, spec.upper_bound, false);
  std::vector<Series> series;
  for (const Series& s : all_series)
    if (!s.points.empty() || y_axis.shows(s.reference)) series.push_back(s);
  const std::string y_label = std::string(spec.y_label) + (y_axis.log_scale ? ", log scale" : "") + "  (" +
                              spec.direction + ")";
  const double x_lo = x_axis.ticks.front(), x_hi = x_axis.ticks.back();
  const double x_pad = x_axis.ticks.size() == 1 ? 1.0 : std::max(0.25, 0.06 * (x_hi - x_lo));

  // Layout: the legend's width follows the longest policy name (within limits), the left margin the
  // widest y tick label.
  std::vector<std::string> legend_labels;
  for (const Series& s : series) legend_labels.push_back(s.points.empty() ? s.policy + " (unbounded)" : s.policy);
  const double legend_rows_height = kHeight - 72.0 - 62.0;
  const double row_height = std::min(22.0, legend_rows_height / static_cast<double>(series.size()));
  const double legend_font = std::clamp(row_height * 0.6, 7.0, 13.0);
  canvas.font(legend_font);
  double widest_label = 0.0;
  for (const std::string& label : legend_labels) widest_label = std::max(widest_label, canvas.text_width(label));
  const double legend_sample = 34.0;
  const double legend_width = std::clamp(widest_label + legend_sample + 22.0, 120.0, 0.4 * kWidth);

  canvas.font(12.0);
  double widest_tick = 0.0;
  for (const std::string& label : y_axis.labels) widest_tick = std::max(widest_tick, canvas.text_width(label));

  const double plot_left = std::round(18.0 + 16.0 + 10.0 + widest_tick + 8.0);
  const double plot_right = std::round(kWidth - 16.0 - legend_width - 18.0);
  const double plot_top = subtitle.empty() ? 54.0 : 72.0;
  const double plot_bottom = kHeight - 62.0;
  auto x_of = [&](double position) {
    const double t = (position - (x_lo - x_pad)) / ((x_hi + x_pad) - (x_lo - x_pad));
    return plot_left + t * (plot_right - plot_left);
  };
  auto y_of = [&](double value) {
    return plot_bottom - y_axis.fraction(value) * (plot_bottom - plot_top);
  };

  // Title and subtitle, centred over the plot area.
  const double centre = (plot_left + plot_right) / 2.0;
  canvas.colour(kTextColour);
  canvas.font(17.0, true);
  const std::string title = fit_text(canvas, std::string(spec.quantity) + " vs " + x_axis.against, kWidth - 32.0);
  const double title_half_width = canvas.text_width(title) / 2.0;
  canvas.text(title, std::clamp(centre, 16.0 + title_half_width, kWidth - 16.0 - title_half_width), 24.0, 0.5);
  if (!subtitle.empty()) {
    canvas.colour(kAxisColour);
    canvas.font(12.0);
    canvas.text(fit_text(canvas, subtitle, plot_right - plot_left), centre, 48.0, 0.5);
  }

  // Grid, ticks and tick labels.
  canvas.dash({});
  canvas.font(12.0);
  for (std::size_t i = 0; i < y_axis.ticks.size(); ++i) {
    const double y = y_of(y_axis.ticks[i]);
    canvas.colour(kGridColour);
    canvas.line(plot_left, y, plot_right, y, 1.0);
    canvas.colour(kAxisColour);
    canvas.line(plot_left - 5.0, y, plot_left, y, 1.0);
    canvas.colour(kTextColour);
    canvas.text(y_axis.labels[i], plot_left - 8.0, y, 1.0);
  }
  double last_label_right = -std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < x_axis.ticks.size(); ++i) {
    const double x = x_of(x_axis.ticks[i]);
    canvas.colour(kGridColour);
    canvas.line(x, plot_top, x, plot_bottom, 1.0);
    canvas.colour(kAxisColour);
    canvas.line(x, plot_bottom, x, plot_bottom + 5.0, 1.0);
    // Ticks close together (budgets on the log axis) would print on top of each other: skip a label
    // that would touch the previous one (its tick and grid line stay).
    const std::string label = fit_text(canvas, x_axis.labels[i], plot_right - plot_left);
    const double half_width = canvas.text_width(label) / 2.0;
    if (x - half_width < last_label_right + 6.0) continue;
    canvas.colour(kTextColour);
    canvas.text(label, x, plot_bottom + 16.0, 0.5);
    last_label_right = x + half_width;
  }

  // Axis labels.
  canvas.colour(kTextColour);
  canvas.font(13.0);
  canvas.text(fit_text(canvas, x_axis.title, plot_right - plot_left), centre, plot_bottom + 40.0, 0.5);
  canvas.vertical_text(fit_text(canvas, y_label, plot_bottom - plot_top), 22.0, (plot_top + plot_bottom) / 2.0);

  // Plot frame.
  canvas.colour(kAxisColour);
  cairo_set_line_width(cr, 1.0);
  cairo_rectangle(cr, plot_left + 0.5, plot_top + 0.5, plot_right - plot_left - 1.0, plot_bottom - plot_top - 1.0);
  cairo_stroke(cr);

  // Reference lines first, so the budgeted lines and their markers draw over them.
  for (const Series& s : series) {
    if (!y_axis.shows(s.reference)) continue;
    canvas.colour(s.style.colour);
    canvas.dash(kReferenceDash);
    canvas.line(plot_left + 1.0, y_of(s.reference), plot_right - 1.0, y_of(s.reference), 2.0);
  }
  for (const Series& s : series) {
    if (s.points.empty()) continue;
    std::vector<std::pair<double, double>> xy;
    for (const auto& [x, value] : s.points) xy.emplace_back(x_of(x), y_of(value));
    canvas.colour(s.style.colour);
    canvas.dash(s.style.dash);
    canvas.polyline(xy, 2.2);
    for (const auto& [x, y] : xy) canvas.marker(s.style.marker, x, y, 4.5, s.style.colour);
  }

  // Legend, right of the plot: a sample of each line and the policy name.
  const double legend_left = plot_right + 18.0;
  const double legend_top = plot_top;
  const double legend_height = row_height * static_cast<double>(series.size()) + 12.0;
  canvas.dash({});
  canvas.colour({0.98, 0.98, 0.98});
  cairo_rectangle(cr, legend_left + 0.5, legend_top + 0.5, legend_width - 1.0, legend_height - 1.0);
  cairo_fill_preserve(cr);
  canvas.colour(hex(0xBBBBBB));
  cairo_set_line_width(cr, 1.0);
  cairo_stroke(cr);
  canvas.font(legend_font);
  for (std::size_t i = 0; i < series.size(); ++i) {
    const Series& s = series[i];
    const double y = legend_top + 6.0 + row_height * (static_cast<double>(i) + 0.5);
    const double x0 = legend_left + 10.0;
    canvas.colour(s.style.colour);
    if (s.points.empty()) {
      canvas.dash(kReferenceDash);
      canvas.line(x0, y, x0 + legend_sample - 6.0, y, 2.0);
    } else {
      canvas.dash(s.style.dash);
      canvas.polyline({{x0, y}, {x0 + legend_sample - 6.0, y}}, 2.2);
      canvas.marker(s.style.marker, x0 + (legend_sample - 6.0) / 2.0, y, std::min(4.5, row_height * 0.25), s.style.colour);
    }
    canvas.colour(kTextColour);
    canvas.text(fit_text(canvas, legend_labels[i], legend_width - legend_sample - 18.0), x0 + legend_sample, y, 0.0);
  }

  cairo_surface_flush(surface.get());
  std::string png;
  const cairo_status_t status = cairo_surface_write_to_png_stream(surface.get(), append_png_bytes, &png);
  if (cairo_status(cr) != CAIRO_STATUS_SUCCESS) fail(path, "", std::string("cairo drawing failed: ") + cairo_status_to_string(cairo_status(cr)));
  if (status != CAIRO_STATUS_SUCCESS) fail(path, "", std::string("PNG encoding failed: ") + cairo_status_to_string(status));
  return png;
}

}  // namespace

std::vector<std::string> write_quality_plots(const EvalResults& results, const std::string& out_dir) {
  // Styles are assigned once over all rows, so a policy looks the same in every plot. `full` is the
  // reference every reader looks for: it keeps a neutral grey and uses up no palette colour.
  std::vector<std::string> policies;
  std::map<std::string, SeriesStyle> styles;
  std::size_t next_style = 0;
  for (const ResultRow& row : results.rows) {
    if (styles.count(row.policy) != 0) continue;
    policies.push_back(row.policy);
    styles.emplace(row.policy,
                   row.policy == "full" ? SeriesStyle{kFullColour, Marker::Circle, {}} : style_for_index(next_style++));
  }

  std::vector<std::string> written;
  for (const MetricPlot& spec : metric_plots()) {
    std::vector<Series> series;
    std::set<std::int64_t> budgets;
    bool any_bounded = false;
    for (const std::string& policy : policies) {
      Series s{policy, styles.at(policy), {}};
      for (const ResultRow& row : results.rows) {
        if (row.policy != policy) continue;
        const auto value = row.metrics.find(spec.metric);
        if (value == row.metrics.end() || !std::isfinite(value->second)) continue;
        if (row.budget == 0) {
          s.reference = value->second;
        } else {
          s.points.emplace_back(std::log2(static_cast<double>(row.budget)), value->second);
          budgets.insert(row.budget);
        }
      }
      if (s.points.empty() && !s.has_reference()) continue;
      std::sort(s.points.begin(), s.points.end());
      any_bounded = any_bounded || !s.points.empty();
      series.push_back(std::move(s));
    }
    // Without a single bounded value there is nothing to plot against the budget.
    if (!any_bounded) continue;

    const std::string path = (std::filesystem::path(out_dir) / (std::string(spec.metric) + ".png")).string();
    // The model's file or folder name: results.json keeps the resolved path, too long for a subtitle.
    std::string subtitle;
    if (results.meta.is_object() && results.meta.contains("model") && results.meta["model"].is_string()) {
      const std::filesystem::path model = std::filesystem::path(results.meta["model"].get<std::string>()).lexically_normal();
      subtitle = (model.has_filename() ? model.filename() : model.parent_path().filename()).string();
    }
    XAxis x_axis{{}, {}, "KV budget M (tokens per layer and KV head, log\u2082 scale)", "KV budget"};
    for (const std::int64_t budget : budgets) {
      x_axis.ticks.push_back(std::log2(static_cast<double>(budget)));
      x_axis.labels.push_back(std::to_string(budget));
    }
    write_file_atomic(path, render_plot(spec, x_axis, series, subtitle, path));
    written.push_back(path);
  }
  return written;
}

void write_sweep_plot(const std::string& path, const std::string& metric_name, const std::string& key,
                      const std::vector<std::string>& key_values, const std::vector<SweepSeries>& series,
                      const std::string& subtitle) {
  const auto spec = std::find_if(metric_plots().begin(), metric_plots().end(),
                                 [&](const MetricPlot& m) { return metric_name == m.metric; });
  if (spec == metric_plots().end()) fail(path, metric_name, "not a plotted quality metric");
  XAxis x_axis{{}, key_values, key + " (the swept values, in sweep order)", key};
  for (std::size_t i = 0; i < key_values.size(); ++i) x_axis.ticks.push_back(static_cast<double>(i));
  std::vector<Series> lines;
  for (std::size_t i = 0; i < series.size(); ++i) {
    Series s{series[i].name, style_for_index(i), {}};
    for (std::size_t x = 0; x < series[i].values.size() && x < key_values.size(); ++x)
      if (std::isfinite(series[i].values[x])) s.points.emplace_back(static_cast<double>(x), series[i].values[x]);
    if (!s.points.empty()) lines.push_back(std::move(s));
  }
  if (lines.empty() || key_values.empty()) fail(path, metric_name, "no finite value to plot");
  write_file_atomic(path, render_plot(*spec, x_axis, lines, subtitle, path));
}

}  // namespace kvbound
