#include "eval/sweep_summary.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <iomanip>
#include <set>
#include <sstream>
#include <tuple>

#include "base/errors.h"
#include "eval/plots.h"

namespace kvbound {
namespace {

const std::vector<std::string>& quality_metrics() {
  static const std::vector<std::string> all = {metric::kKlToFull, metric::kTop1Agree, metric::kNll, metric::kRetrievalAcc};
  return all;
}

bool higher_is_better(const std::string& name) { return name == metric::kTop1Agree || name == metric::kRetrievalAcc; }

std::pair<double, double> mean_std(const std::vector<double>& values) {
  double mean = 0;
  for (double v : values) mean += v;
  mean /= static_cast<double>(values.size());
  double var = 0;
  for (double v : values) var += (v - mean) * (v - mean);
  const double std = values.size() > 1 ? std::sqrt(var / static_cast<double>(values.size() - 1)) : 0.0;
  return {mean, std};
}

std::string number(double v, int digits) {
  if (!std::isfinite(v)) return "n/a";
  std::ostringstream out;
  out << std::fixed << std::setprecision(digits) << v;
  return out.str();
}

int digits_of(const std::string& name) { return name == metric::kKlToFull ? 4 : name == metric::kNll ? 4 : 3; }

// The metrics some row carries, in quality_metrics() order.
std::vector<std::string> present_metrics(const SweepSummary& s) {
  std::vector<std::string> out;
  for (const std::string& m : quality_metrics())
    for (const SweepSummaryRow& r : s.rows)
      if (r.metrics.count(m)) {
        out.push_back(m);
        break;
      }
  return out;
}

std::string csv_field(const std::string& text) {
  if (text.find_first_of(",\"\n") == std::string::npos) return text;
  std::string quoted = "\"";
  for (char c : text) quoted += c == '"' ? std::string("\"\"") : std::string(1, c);
  return quoted + "\"";
}

std::string budget_name(std::int64_t budget) { return budget == 0 ? std::string("full") : std::to_string(budget); }

// Fills s.against_heuristics: within each run (one point, one seed), each bounded non-heuristic row against
// the best heuristic row of its budget.
void compare_with_heuristics(const std::vector<SweepRun>& runs, SweepSummary& s) {
  const bool higher = higher_is_better(s.metric);
  const auto is_heuristic = [&](const std::string& policy) {
    return std::find(s.heuristics.begin(), s.heuristics.end(), policy) != s.heuristics.end();
  };
  std::map<std::tuple<std::size_t, std::string, std::int64_t>, std::size_t> index;
  for (const SweepRun& run : runs) {
    std::map<std::int64_t, std::pair<double, std::string>> best;  // budget -> best heuristic value, its name
    for (const ResultRow& row : run.results.rows) {
      const auto it = row.metrics.find(s.metric);
      if (!is_heuristic(row.policy) || row.budget == 0 || it == row.metrics.end() || !std::isfinite(it->second)) continue;
      const auto held = best.find(row.budget);
      if (held == best.end() || (higher ? it->second > held->second.first : it->second < held->second.first))
        best[row.budget] = {it->second, row.policy};
    }
    for (const ResultRow& row : run.results.rows) {
      const auto it = row.metrics.find(s.metric);
      const auto heuristic = best.find(row.budget);
      if (is_heuristic(row.policy) || row.budget == 0 || it == row.metrics.end() || heuristic == best.end()) continue;
      const auto key = std::make_tuple(run.point, row.policy, row.budget);
      if (!index.count(key)) {
        index[key] = s.against_heuristics.size();
        s.against_heuristics.push_back({run.point, row.policy, row.budget, {}, {}});
      }
      HeuristicComparison& c = s.against_heuristics[index[key]];
      c.per_seed.push_back(higher ? it->second - heuristic->second.first : it->second / heuristic->second.first);
      c.best_heuristic.push_back(heuristic->second.second);
    }
  }
  std::stable_sort(s.against_heuristics.begin(), s.against_heuristics.end(),
                   [](const HeuristicComparison& a, const HeuristicComparison& b) { return a.point < b.point; });
}

}  // namespace

std::string sweep_point_name(const std::vector<std::pair<std::string, std::string>>& values) {
  std::string name;
  for (const auto& [k, v] : values) name += (name.empty() ? "" : ",") + k + "=" + v;
  if (name.empty()) return "base";
  for (char& c : name)
    if (!std::isalnum(static_cast<unsigned char>(c)) && std::string("._=,+-").find(c) == std::string::npos) c = '_';
  return name;
}

SweepSummary summarize_sweep(std::vector<std::string> keys, std::vector<SweepPoint> points,
                             const std::vector<SweepRun>& runs, const std::string& metric_name,
                             std::vector<std::string> heuristics) {
  const auto& known = quality_metrics();
  if (std::find(known.begin(), known.end(), metric_name) == known.end())
    fail("sweep", "metric", "'" + metric_name + "' (kl_to_full, top1_agree, nll, retrieval_acc)");
  SweepSummary s{std::move(keys), std::move(points), metric_name, {}, std::move(heuristics), {}};
  // (point, policy, budget) -> metric -> values over seeds, in first-seen order.
  std::vector<std::tuple<std::size_t, std::string, std::int64_t>> order;
  std::map<std::tuple<std::size_t, std::string, std::int64_t>, std::pair<std::int64_t, std::map<std::string, std::vector<double>>>> values;
  for (const SweepRun& run : runs) {
    for (const ResultRow& row : run.results.rows) {
      const auto key = std::make_tuple(run.point, row.policy, row.budget);
      if (!values.count(key)) order.push_back(key);
      auto& entry = values[key];
      ++entry.first;
      for (const std::string& m : known) {
        const auto it = row.metrics.find(m);
        if (it != row.metrics.end()) entry.second[m].push_back(it->second);
      }
    }
  }
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return std::get<0>(a) < std::get<0>(b); });
  for (const auto& key : order) {
    SweepSummaryRow row{std::get<0>(key), std::get<1>(key), std::get<2>(key), values[key].first, {}, false};
    for (const auto& [m, vs] : values[key].second) row.metrics[m] = mean_std(vs);
    s.rows.push_back(std::move(row));
  }
  std::map<std::int64_t, std::size_t> best;
  for (std::size_t i = 0; i < s.rows.size(); ++i) {
    const SweepSummaryRow& r = s.rows[i];
    const auto it = r.metrics.find(metric_name);
    if (r.budget == 0 || it == r.metrics.end() || !std::isfinite(it->second.first)) continue;
    const auto current = best.find(r.budget);
    if (current == best.end()) {
      best[r.budget] = i;
      continue;
    }
    const double held = s.rows[current->second].metrics.at(metric_name).first, now = it->second.first;
    if (higher_is_better(metric_name) ? now > held : now < held) current->second = i;
  }
  for (const auto& [budget, i] : best) s.rows[i].best = true;
  compare_with_heuristics(runs, s);
  return s;
}

std::string sweep_markdown(const SweepSummary& s) {
  const std::vector<std::string> metrics = present_metrics(s);
  std::ostringstream out;
  out << "| ";
  for (const std::string& k : s.keys) out << k << " | ";
  out << "policy | M | seeds |";
  for (const std::string& m : metrics) out << " " << m << " |";
  out << " best " << s.metric << " at M |\n|";
  for (std::size_t i = 0; i < s.keys.size() + 3 + metrics.size(); ++i) out << (i < s.keys.size() + 1 ? ":---|" : "---:|");
  out << ":---:|\n";
  for (const SweepSummaryRow& r : s.rows) {
    out << "| ";
    for (const auto& [k, v] : s.points.at(r.point).values) out << v << " | ";
    out << r.policy << " | " << budget_name(r.budget) << " | " << r.seeds << " |";
    for (const std::string& m : metrics) {
      const auto it = r.metrics.find(m);
      if (it == r.metrics.end()) {
        out << " |";
        continue;
      }
      const std::string cell = number(it->second.first, digits_of(m)) + " ± " + number(it->second.second, digits_of(m));
      out << " " << (r.best && m == s.metric ? "**" + cell + "**" : cell) << " |";
    }
    out << (r.best ? " ✔ |" : " |") << "\n";
  }
  if (s.against_heuristics.empty()) return out.str();
  const bool higher = higher_is_better(s.metric);
  std::string listed;
  for (const std::string& h : s.heuristics) listed += (listed.empty() ? "" : ", ") + h;
  out << "\n" << s.metric << (higher ? " minus" : " over") << " that of the best heuristic in the same seed (" << listed
      << "):\n\n| ";
  for (const std::string& k : s.keys) out << k << " | ";
  out << "policy | M | seeds | mean | min | max | best heuristic per seed |\n|";
  for (std::size_t i = 0; i < s.keys.size() + 6; ++i) out << (i < s.keys.size() + 1 ? ":---|" : "---:|");
  out << ":---|\n";
  const int digits = higher ? 3 : 2;
  const std::string unit = higher ? "" : "×";
  for (const HeuristicComparison& c : s.against_heuristics) {
    out << "| ";
    for (const auto& [k, v] : s.points.at(c.point).values) out << v << " | ";
    const auto [lowest, highest] = std::minmax_element(c.per_seed.begin(), c.per_seed.end());
    out << c.policy << " | " << budget_name(c.budget) << " | " << c.per_seed.size() << " | "
        << number(mean_std(c.per_seed).first, digits) << unit << " | " << number(*lowest, digits) << unit << " | "
        << number(*highest, digits) << unit << " | ";
    for (std::size_t i = 0; i < c.best_heuristic.size(); ++i) out << (i ? ", " : "") << c.best_heuristic[i];
    out << " |\n";
  }
  return out.str();
}

std::string sweep_csv(const SweepSummary& s) {
  const std::vector<std::string> metrics = present_metrics(s);
  std::ostringstream out;
  for (const std::string& k : s.keys) out << csv_field(k) << ",";
  out << "policy,budget,seeds";
  for (const std::string& m : metrics) out << "," << m << "_mean," << m << "_std";
  out << ",best\n";
  out << std::setprecision(10);
  for (const SweepSummaryRow& r : s.rows) {
    for (const auto& [k, v] : s.points.at(r.point).values) out << csv_field(v) << ",";
    out << csv_field(r.policy) << "," << r.budget << "," << r.seeds;
    for (const std::string& m : metrics) {
      const auto it = r.metrics.find(m);
      if (it == r.metrics.end()) out << ",,";
      else out << "," << it->second.first << "," << it->second.second;
    }
    out << "," << (r.best ? 1 : 0) << "\n";
  }
  return out.str();
}

std::vector<std::string> write_sweep_plots(const SweepSummary& s, const std::string& out_dir, const std::string& subtitle) {
  std::vector<std::string> written;
  std::set<std::int64_t> budgets;
  for (const SweepSummaryRow& r : s.rows)
    if (r.budget > 0 && r.metrics.count(s.metric)) budgets.insert(r.budget);
  for (std::size_t k = 0; k < s.keys.size(); ++k) {
    std::vector<std::string> key_values;  // in sweep order
    for (const SweepPoint& p : s.points)
      if (std::find(key_values.begin(), key_values.end(), p.values[k].second) == key_values.end())
        key_values.push_back(p.values[k].second);
    if (key_values.size() < 2) continue;
    for (const std::int64_t budget : budgets) {
      // One series per policy and combination of the other keys' values.
      std::vector<SweepSeries> series;
      std::map<std::string, std::size_t> index;
      for (const SweepSummaryRow& r : s.rows) {
        const auto it = r.metrics.find(s.metric);
        if (r.budget != budget || it == r.metrics.end()) continue;
        // "<policy> <key>=<value> ...", each key by its last dotted part (the legend has little room).
        std::string name = r.policy;
        for (std::size_t j = 0; j < s.keys.size(); ++j)
          if (j != k)
            name += " " + s.keys[j].substr(s.keys[j].rfind('.') + 1) + "=" + s.points[r.point].values[j].second;
        if (!index.count(name)) {
          index[name] = series.size();
          series.push_back({name, std::vector<double>(key_values.size(), std::nan(""))});
        }
        const auto x = std::find(key_values.begin(), key_values.end(), s.points[r.point].values[k].second) - key_values.begin();
        series[index[name]].values[static_cast<std::size_t>(x)] = it->second.first;
      }
      if (series.empty()) continue;
      const std::string path =
          (std::filesystem::path(out_dir) / (s.metric + "_vs_" + s.keys[k] + "_M" + std::to_string(budget) + ".png")).string();
      write_sweep_plot(path, s.metric, s.keys[k], key_values, series, subtitle + (subtitle.empty() ? "" : ", ") + "M = " +
                                                                       std::to_string(budget) + ", mean over seeds");
      written.push_back(path);
    }
  }
  // Each point's seed means against the budget, as the plots of one evaluation.
  for (std::size_t p = 0; p < s.points.size(); ++p) {
    EvalResults means;
    means.meta = {{"model", subtitle + (subtitle.empty() ? "" : ", ") + "mean over seeds"}};
    std::set<std::int64_t> point_budgets;
    for (const SweepSummaryRow& r : s.rows) {
      if (r.point != p) continue;
      ResultRow row{r.policy, r.budget, {}};
      for (const auto& [name, mean_and_std] : r.metrics) row.metrics[name] = mean_and_std.first;
      means.rows.push_back(row);
      if (r.budget > 0) point_budgets.insert(r.budget);
    }
    if (point_budgets.size() < 2) continue;
    const std::vector<std::string> files =
        write_quality_plots(means, (std::filesystem::path(out_dir) / "vs_budget" / sweep_point_name(s.points[p].values)).string());
    written.insert(written.end(), files.begin(), files.end());
  }
  return written;
}

}  // namespace kvbound
