// The summary of a sweep (`kvbound sweep`): every point's evaluation results, averaged over the seeds it ran
// with, as one table (Markdown and CSV) with the best point per budget marked, plots of a metric against
// each swept key, plots of each point's means against the budget, and every non-heuristic policy set against
// the best heuristic of its own seed (the claim "beats every heuristic" is per sample, not only on the means).
// Torch-free.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "eval/results.h"

namespace kvbound {

// One point of the grid: the swept keys' values there, in the sweep's key order.
struct SweepPoint {
  std::vector<std::pair<std::string, std::string>> values;
};

// The evaluation of one point with one seed.
struct SweepRun {
  std::size_t point = 0;
  std::int64_t seed = 0;
  EvalResults results;
};

struct SweepSummaryRow {
  std::size_t point = 0;
  std::string policy;
  std::int64_t budget = 0;  // 0: unbounded (full)
  std::int64_t seeds = 0;   // runs averaged
  std::map<std::string, std::pair<double, double>> metrics;  // name -> (mean, sample std over seeds; 0 for one)
  bool best = false;  // the best mean of the sweep's metric among all rows of this budget
};

// A bounded policy that is not a heuristic against, in each seed, the best heuristic of that seed's run at the
// same point and budget: the sweep's metric over the heuristic's (kl_to_full, nll: lower is better) or minus it
// (top1_agree, retrieval_acc: higher is better).
struct HeuristicComparison {
  std::size_t point = 0;
  std::string policy;
  std::int64_t budget = 0;
  std::vector<double> per_seed;                 // in the order of the runs
  std::vector<std::string> best_heuristic;      // per seed: which heuristic it was set against
};

struct SweepSummary {
  std::vector<std::string> keys;  // the swept keys, in order
  std::vector<SweepPoint> points;
  std::string metric;             // what "best" means: kl_to_full, nll (lower) or top1_agree, retrieval_acc (higher)
  std::vector<SweepSummaryRow> rows;  // point-major, then policy and budget as the runs listed them
  std::vector<std::string> heuristics;  // the policies counted as heuristics
  std::vector<HeuristicComparison> against_heuristics;  // point-major, in the rows' order; empty without heuristics
};

// "key=value,key=value" with characters that do not belong in a file name replaced; "base" for no keys: the
// folder of a point in the sweep's output.
std::string sweep_point_name(const std::vector<std::pair<std::string, std::string>>& values);

// Averages the runs of each (point, policy, budget), and sets every bounded policy outside `heuristics` against
// the best of `heuristics` in each of its runs (a seed whose run has no heuristic at that budget is left out).
// kvbound::Error when `metric` is not a quality metric.
SweepSummary summarize_sweep(std::vector<std::string> keys, std::vector<SweepPoint> points,
                             const std::vector<SweepRun>& runs, const std::string& metric,
                             std::vector<std::string> heuristics);

// One row per (point, policy, budget): the swept values, policy, budget, seeds, then mean ± std of each quality
// metric present; the best row per budget marked. Then, when any policy was set against the heuristics, a
// second table: per (point, policy, budget) the mean, min and max over seeds of the ratio (or difference) to
// the seed's best heuristic, and which heuristic that was in each seed.
std::string sweep_markdown(const SweepSummary& summary);
// The same rows as CSV: the values, then <metric>_mean and <metric>_std columns, and best (0/1).
std::string sweep_csv(const SweepSummary& summary);
// For each swept key with two or more values and each budget: `out_dir/<metric>_vs_<key>_M<budget>.png`, one
// line per policy and combination of the other keys' values. For each point whose rows span two or more
// budgets: `out_dir/vs_budget/<point name>/<quality metric>.png`, the seed means against the budget, one line
// per policy (write_quality_plots; "base" is the one point of a sweep with neither grid nor eval_grid).
// Returns the files written.
std::vector<std::string> write_sweep_plots(const SweepSummary& summary, const std::string& out_dir,
                                           const std::string& subtitle);

}  // namespace kvbound
