// Pictures of per-token quantities for `kvbound inspect`, rendered with cairo into PNGs: a heatmap (one row
// per labelled series, one column per token) and occupancy panels (which positions a cache holds at every
// step). Each file is written atomically; kvbound::Error names the file on failure.
#pragma once
#include <string>
#include <vector>

namespace kvbound {

struct HeatmapRow {
  std::string label;
  std::vector<double> values;  // one per column, in [0, 1] (clamped); NaN leaves the cell blank
};

// Cells of cell_width x cell_height pixels, white (0) to dark blue (1), row labels on the left, a colour bar
// labelled low_label .. high_label, the title and x_label around it.
void write_heatmap(const std::string& path, const std::string& title, const std::string& x_label,
                   const std::string& low_label, const std::string& high_label, const std::vector<HeatmapRow>& rows,
                   int cell_width, int cell_height);

struct OccupancyPanel {
  std::string label;
  std::vector<std::vector<bool>> held;  // [step][position]: the position is in the cache after that step
};

// The panels side by side, each with one pixel row per step (time runs down) and one column per position:
// dark where the position is held, light grey where it was written but is gone, white before it exists.
void write_occupancy(const std::string& path, const std::string& title, const std::vector<OccupancyPanel>& panels,
                     int pixel);

}  // namespace kvbound
