#include "eval/heatmaps.h"

#include <cairo.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "base/atomic_file.h"
#include "base/errors.h"

namespace kvbound {
namespace {

using Surface = std::unique_ptr<cairo_surface_t, decltype(&cairo_surface_destroy)>;
using Context = std::unique_ptr<cairo_t, decltype(&cairo_destroy)>;

constexpr double kMargin = 16.0, kTitleHeight = 34.0;

cairo_status_t append_png(void* closure, const unsigned char* data, unsigned int length) {
  static_cast<std::string*>(closure)->append(reinterpret_cast<const char*>(data), length);
  return CAIRO_STATUS_SUCCESS;
}

void text(cairo_t* cr, const std::string& s, double x, double y, double size, double align = 0.0, bool bold = false) {
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, size);
  cairo_text_extents_t e;
  cairo_text_extents(cr, s.c_str(), &e);
  cairo_move_to(cr, x - align * e.x_advance, y);
  cairo_show_text(cr, s.c_str());
}

double text_width(cairo_t* cr, const std::string& s, double size) {
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, size);
  cairo_text_extents_t e;
  cairo_text_extents(cr, s.c_str(), &e);
  return e.x_advance;
}

// White to dark blue.
void shade(cairo_t* cr, double v) {
  v = std::clamp(v, 0.0, 1.0);
  cairo_set_source_rgb(cr, 1.0 - 0.92 * v, 1.0 - 0.75 * v, 1.0 - 0.45 * v);
}

void write_png(const std::string& path, cairo_surface_t* surface, cairo_t* cr) {
  cairo_surface_flush(surface);
  std::string png;
  const cairo_status_t status = cairo_surface_write_to_png_stream(surface, append_png, &png);
  if (cairo_status(cr) != CAIRO_STATUS_SUCCESS || status != CAIRO_STATUS_SUCCESS)
    fail(path, "", std::string("cairo failed: ") + cairo_status_to_string(status));
  write_file_atomic(path, png);
}

Context white_canvas(cairo_surface_t* surface) {
  Context cr(cairo_create(surface), cairo_destroy);
  cairo_set_source_rgb(cr.get(), 1, 1, 1);
  cairo_paint(cr.get());
  return cr;
}

}  // namespace

void write_heatmap(const std::string& path, const std::string& title, const std::string& x_label,
                   const std::string& low_label, const std::string& high_label, const std::vector<HeatmapRow>& rows,
                   int cell_width, int cell_height) {
  if (rows.empty() || rows.front().values.empty()) fail(path, "", "nothing to draw");
  const std::size_t columns = rows.front().values.size();
  Surface probe(cairo_image_surface_create(CAIRO_FORMAT_ARGB32, 1, 1), cairo_surface_destroy);
  Context measure(cairo_create(probe.get()), cairo_destroy);
  double label_width = 0;
  for (const HeatmapRow& r : rows) label_width = std::max(label_width, text_width(measure.get(), r.label, 11.0));
  const double left = kMargin + label_width + 8.0, top = kTitleHeight + 8.0;
  const double grid_w = static_cast<double>(columns) * cell_width, grid_h = static_cast<double>(rows.size()) * cell_height;
  const int width = static_cast<int>(std::ceil(left + grid_w + kMargin));
  const int height = static_cast<int>(std::ceil(top + grid_h + 70.0));
  Surface surface(cairo_image_surface_create(CAIRO_FORMAT_ARGB32, width, height), cairo_surface_destroy);
  Context owned = white_canvas(surface.get());
  cairo_t* cr = owned.get();
  cairo_set_source_rgb(cr, 0.13, 0.13, 0.13);
  text(cr, title, kMargin, 24.0, 15.0, 0.0, true);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    const double y = top + static_cast<double>(r) * cell_height;
    cairo_set_source_rgb(cr, 0.13, 0.13, 0.13);
    text(cr, rows[r].label, left - 6.0, y + cell_height / 2.0 + 4.0, 11.0, 1.0);
    for (std::size_t c = 0; c < columns && c < rows[r].values.size(); ++c) {
      const double v = rows[r].values[c];
      if (!std::isfinite(v)) continue;
      shade(cr, v);
      cairo_rectangle(cr, left + static_cast<double>(c) * cell_width, y, cell_width, cell_height);
      cairo_fill(cr);
    }
  }
  cairo_set_source_rgb(cr, 0.33, 0.33, 0.33);
  cairo_set_line_width(cr, 1.0);
  cairo_rectangle(cr, left - 0.5, top - 0.5, grid_w + 1.0, grid_h + 1.0);
  cairo_stroke(cr);
  cairo_set_source_rgb(cr, 0.13, 0.13, 0.13);
  for (std::size_t c = 0; c < columns; c += std::max<std::size_t>(1, columns / 8))
    text(cr, std::to_string(c), left + (static_cast<double>(c) + 0.5) * cell_width, top + grid_h + 14.0, 10.0, 0.5);
  text(cr, x_label, left + grid_w / 2.0, top + grid_h + 32.0, 12.0, 0.5);
  // Colour bar from low to high, its labels at both ends.
  const double bar_x = left + text_width(cr, low_label, 10.0) + 6.0, bar_y = top + grid_h + 44.0;
  for (int i = 0; i < 200; ++i) {
    shade(cr, i / 199.0);
    cairo_rectangle(cr, bar_x + i, bar_y, 1.0, 10.0);
    cairo_fill(cr);
  }
  cairo_set_source_rgb(cr, 0.13, 0.13, 0.13);
  text(cr, low_label, bar_x - 6.0, bar_y + 9.0, 10.0, 1.0);
  text(cr, high_label, bar_x + 206.0, bar_y + 9.0, 10.0);
  write_png(path, surface.get(), cr);
}

void write_occupancy(const std::string& path, const std::string& title, const std::vector<OccupancyPanel>& panels,
                     int pixel) {
  if (panels.empty() || panels.front().held.empty()) fail(path, "", "nothing to draw");
  const std::size_t steps = panels.front().held.size(), positions = panels.front().held.front().size();
  const double panel_w = static_cast<double>(positions * pixel), panel_h = static_cast<double>(steps * pixel), gap = 18.0;
  const double top = kTitleHeight + 22.0;
  const int width = static_cast<int>(std::ceil(2 * kMargin + static_cast<double>(panels.size()) * (panel_w + gap)));
  const int height = static_cast<int>(std::ceil(top + panel_h + 40.0));
  Surface surface(cairo_image_surface_create(CAIRO_FORMAT_ARGB32, width, height), cairo_surface_destroy);
  Context owned = white_canvas(surface.get());
  cairo_t* cr = owned.get();
  cairo_set_source_rgb(cr, 0.13, 0.13, 0.13);
  text(cr, title, kMargin, 24.0, 15.0, 0.0, true);
  for (std::size_t p = 0; p < panels.size(); ++p) {
    const double x0 = kMargin + static_cast<double>(p) * (panel_w + gap);
    cairo_set_source_rgb(cr, 0.13, 0.13, 0.13);
    text(cr, panels[p].label, x0 + panel_w / 2.0, top - 6.0, 11.0, 0.5);
    for (std::size_t t = 0; t < steps; ++t)
      for (std::size_t i = 0; i < positions && i <= t; ++i) {
        if (panels[p].held[t][i]) cairo_set_source_rgb(cr, 0.08, 0.25, 0.55);
        else cairo_set_source_rgb(cr, 0.88, 0.88, 0.88);
        cairo_rectangle(cr, x0 + static_cast<double>(i * pixel), top + static_cast<double>(t * pixel), pixel, pixel);
        cairo_fill(cr);
      }
    cairo_set_source_rgb(cr, 0.33, 0.33, 0.33);
    cairo_set_line_width(cr, 1.0);
    cairo_rectangle(cr, x0 - 0.5, top - 0.5, panel_w + 1.0, panel_h + 1.0);
    cairo_stroke(cr);
  }
  cairo_set_source_rgb(cr, 0.13, 0.13, 0.13);
  text(cr, "x: token position, y: decode step (time runs down); dark: held in the cache, grey: evicted", kMargin,
       top + panel_h + 24.0, 11.0);
  write_png(path, surface.get(), cr);
}

}  // namespace kvbound
