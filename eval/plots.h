// Quality-vs-budget plots of evaluation results, and quality-vs-swept-key plots of a sweep, rendered with
// cairo into 900x600 PNGs.
#pragma once
#include <string>
#include <vector>

#include "eval/results.h"

namespace kvbound {

// Writes one PNG per quality metric (kl_to_full, top1_agree, nll, retrieval_acc) that at least one
// bounded row (budget > 0) carries as a finite value, as `out_dir/<metric>.png`, creating out_dir if
// needed. x = budget on a log2 axis with a tick at every budget; y = the metric on a linear axis, except
// the KL's, which is log10 when its lines span a factor of 10 or more (plot_axis.h; the full cache's KL,
// 0 up to rounding, is then below the axis and left out); one coloured line with markers per policy; each
// policy's unbounded row (budget 0, e.g. `full`) is a dashed horizontal reference line; the legend sits
// right of the plot. Policies keep the same colour, marker and dash in every plot. Non-finite values are
// left out of the lines. Each file is written atomically.
// Returns the paths written, in the metric order above. Throws kvbound::Error naming the file on failure.
std::vector<std::string> write_quality_plots(const EvalResults& results, const std::string& out_dir);

// One line of a sweep plot: its values at each of the swept key's values (NaN: no point there).
struct SweepSeries {
  std::string name;
  std::vector<double> values;
};

// A quality metric (kl_to_full, top1_agree, nll, retrieval_acc) against a swept config key (`kvbound
// sweep`): x = the key's values in sweep order, one line per series, in the style of the budget plots.
// Written atomically to `path`; kvbound::Error naming the file for an unknown metric or nothing to plot.
void write_sweep_plot(const std::string& path, const std::string& metric, const std::string& key,
                      const std::vector<std::string>& key_values, const std::vector<SweepSeries>& series,
                      const std::string& subtitle);

}  // namespace kvbound
