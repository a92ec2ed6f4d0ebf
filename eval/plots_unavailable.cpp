// The PNG writers in a build without cairo (KVBOUND_WITH_PLOTS=OFF). eval and sweep skip their plots with a line
// saying why and inspect refuses before any work (KVBOUND_WITH_PLOTS, base/build_options.h); these definitions
// fail in the same words for any other caller.
#include "base/errors.h"
#include "eval/heatmaps.h"
#include "eval/plots.h"

namespace kvbound {
namespace {

[[noreturn]] void without_cairo(const std::string& path) {
  fail(path, "", "PNG plots need cairo, and this kvbound was built without it (KVBOUND_WITH_PLOTS=OFF)");
}

}  // namespace

std::vector<std::string> write_quality_plots(const EvalResults&, const std::string& out_dir) { without_cairo(out_dir); }

void write_sweep_plot(const std::string& path, const std::string&, const std::string&, const std::vector<std::string>&,
                      const std::vector<SweepSeries>&, const std::string&) {
  without_cairo(path);
}

void write_heatmap(const std::string& path, const std::string&, const std::string&, const std::string&,
                   const std::string&, const std::vector<HeatmapRow>&, int, int) {
  without_cairo(path);
}

void write_occupancy(const std::string& path, const std::string&, const std::vector<OccupancyPanel>&, int) {
  without_cairo(path);
}

}  // namespace kvbound
