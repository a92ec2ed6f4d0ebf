#include "eval/results.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include "base/atomic_file.h"
#include "base/errors.h"

namespace kvbound {
namespace {

constexpr const char* kFormatName = "kvbound-eval-results";
constexpr int kFormatVersion = 1;

std::string errno_text() { return std::strerror(errno); }

std::string row_field(std::size_t index, const std::string& member = "") {
  std::string field = "rows[" + std::to_string(index) + "]";
  if (!member.empty()) field += "." + member;
  return field;
}

// Checks what both the writer and the reader require of the rows: a policy name, a budget >= 0, and
// each (policy, budget) pair once, so that a table cell or a plot point is never ambiguous.
void validate_rows(const std::vector<ResultRow>& rows, const std::string& path) {
  std::map<std::pair<std::string, std::int64_t>, std::size_t> seen;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const ResultRow& row = rows[i];
    if (row.policy.empty()) fail(path, row_field(i, "policy"), "must be a non-empty string");
    if (row.budget < 0) fail(path, row_field(i, "budget"), "must be >= 0 (0 = unbounded), got " + std::to_string(row.budget));
    for (const auto& entry : row.metrics) {
      if (entry.first.empty()) fail(path, row_field(i, "metrics"), "metric names must be non-empty");
    }
    const auto [it, inserted] = seen.emplace(std::make_pair(row.policy, row.budget), i);
    if (!inserted) {
      fail(path, row_field(i), "duplicate row for policy '" + row.policy + "' at budget " + std::to_string(row.budget) +
                                   " (first at " + row_field(it->second) + ")");
    }
  }
}

void reject_unknown_keys(const nlohmann::json& object, const std::set<std::string>& known, const std::string& path,
                         const std::string& where) {
  for (const auto& item : object.items()) {
    if (known.count(item.key()) == 0) {
      fail(path, where.empty() ? item.key() : where + "." + item.key(), "unknown field");
    }
  }
}

// ----- Markdown -----

enum class Better { Lower, Higher, Neither };

struct MetricColumn {
  std::string name;
  std::string header;
  Better better;
  std::function<std::string(double)> format;
};

std::string format_fixed(double value, int decimals) {
  if (!std::isfinite(value)) return "n/a";
  char buffer[64];
  // A positive value too small for the fixed precision (a KL of 3e-6) would print as 0.0000 and look
  // exact, so it switches to scientific notation instead.
  if (value != 0.0 && std::fabs(value) < 0.5 * std::pow(10.0, -decimals)) {
    std::snprintf(buffer, sizeof buffer, "%.1e", value);
  } else {
    std::snprintf(buffer, sizeof buffer, "%.*f", decimals, value);
  }
  return buffer;
}

std::string format_general(double value) {
  if (!std::isfinite(value)) return "n/a";
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.4g", value);
  return buffer;
}

// Three significant digits without scientific notation: throughputs and sizes span decades.
std::string format_significant(double value) {
  if (!std::isfinite(value)) return "n/a";
  if (value == 0.0) return "0";
  const int magnitude = static_cast<int>(std::floor(std::log10(std::fabs(value))));
  const int decimals = std::clamp(2 - magnitude, 0, 6);
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.*f", decimals, value);
  return buffer;
}

std::vector<MetricColumn> quality_columns() {
  return {
      {metric::kKlToFull, "KL", Better::Lower, [](double v) { return format_fixed(v, 4); }},
      {metric::kTop1Agree, "top-1", Better::Higher, [](double v) { return format_fixed(v, 3); }},
      {metric::kNll, "NLL", Better::Lower, [](double v) { return format_fixed(v, 4); }},
      {metric::kRetrievalAcc, "retrieval acc", Better::Higher, [](double v) { return format_fixed(v, 3); }},
  };
}

std::vector<MetricColumn> cost_columns() {
  return {
      {metric::kPrefillTokS, "prefill tok/s", Better::Higher, format_significant},
      {metric::kDecodeTokS, "decode tok/s", Better::Higher, format_significant},
      {metric::kPeakKvBytes, "peak KV MiB", Better::Lower,
       [](double v) { return format_significant(v / (1024.0 * 1024.0)); }},
  };
}

std::string escape_cell(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '|') out += '\\';
    out += c;
  }
  return out;
}

std::string budget_label(std::int64_t budget) { return budget == 0 ? "unbounded" : "M=" + std::to_string(budget); }

class ResultsIndex {
 public:
  explicit ResultsIndex(const EvalResults& results) {
    std::set<std::int64_t> budgets;
    for (const ResultRow& row : results.rows) {
      if (std::find(policies_.begin(), policies_.end(), row.policy) == policies_.end()) policies_.push_back(row.policy);
      if (row.budget > 0) budgets.insert(row.budget);
      rows_[{row.policy, row.budget}] = &row;
      for (const auto& entry : row.metrics) metric_names_.insert(entry.first);
    }
    budgets_.assign(budgets.begin(), budgets.end());
    // With no bounded run at all, the unbounded rows are the only column group.
    if (budgets_.empty()) budgets_.push_back(0);
  }

  const std::vector<std::string>& policies() const { return policies_; }
  const std::vector<std::int64_t>& budgets() const { return budgets_; }
  bool has_metric(const std::string& name) const { return metric_names_.count(name) != 0; }
  const std::set<std::string>& metric_names() const { return metric_names_; }

  // The value shown for (policy, budget, metric): the row at that budget, else the policy's unbounded
  // row as the reference (is_reference = true), else nothing.
  struct Cell {
    bool present = false;
    bool is_reference = false;
    double value = 0.0;
  };
  Cell cell(const std::string& policy, std::int64_t budget, const std::string& metric_name) const {
    for (const std::int64_t lookup : {budget, std::int64_t{0}}) {
      const auto row = rows_.find({policy, lookup});
      if (row == rows_.end()) continue;
      const auto value = row->second->metrics.find(metric_name);
      if (value == row->second->metrics.end()) continue;
      return {true, lookup != budget, value->second};
    }
    return {};
  }

 private:
  std::vector<std::string> policies_;  // in order of first appearance
  std::vector<std::int64_t> budgets_;
  std::map<std::pair<std::string, std::int64_t>, const ResultRow*> rows_;
  std::set<std::string> metric_names_;
};

// The formatted text of the best competing value in one (budget, metric) column. Cells are bolded by
// comparing their text with it, so values that tie at the shown precision are all bold. "" (nothing
// bold) when fewer than two different values compete: a column where every policy ties, such as the
// peak KV bytes of a fixed budget, has no winner to point out.
std::string best_text(const ResultsIndex& index, std::int64_t budget, const MetricColumn& column) {
  if (column.better == Better::Neither) return "";
  std::set<std::string> distinct;
  bool found = false;
  double best = 0.0;
  for (const std::string& policy : index.policies()) {
    const ResultsIndex::Cell cell = index.cell(policy, budget, column.name);
    if (!cell.present || cell.is_reference || !std::isfinite(cell.value)) continue;
    const bool better = column.better == Better::Lower ? cell.value < best : cell.value > best;
    if (!found || better) best = cell.value;
    found = true;
    distinct.insert(column.format(cell.value));
  }
  return distinct.size() >= 2 ? column.format(best) : "";
}

void append_table(std::ostringstream& out, const ResultsIndex& index, const std::string& title,
                  const std::vector<MetricColumn>& all_columns) {
  std::vector<MetricColumn> columns;
  for (const MetricColumn& column : all_columns) {
    if (index.has_metric(column.name)) columns.push_back(column);
  }
  if (columns.empty()) return;

  out << "\n## " << title << "\n\n| policy |";
  for (const std::int64_t budget : index.budgets()) {
    for (std::size_t c = 0; c < columns.size(); ++c) {
      out << ' ' << (c == 0 ? budget_label(budget) + " " : "") << escape_cell(columns[c].header) << " |";
    }
  }
  out << "\n|:---|";
  for (std::size_t i = 0; i < index.budgets().size() * columns.size(); ++i) out << "---:|";
  out << '\n';

  std::map<std::pair<std::int64_t, std::string>, std::string> best;
  for (const std::int64_t budget : index.budgets()) {
    for (const MetricColumn& column : columns) best[{budget, column.name}] = best_text(index, budget, column);
  }

  bool any_reference = false;
  for (const std::string& policy : index.policies()) {
    std::string line = "| " + escape_cell(policy) + " |";
    bool any_value = false;
    for (const std::int64_t budget : index.budgets()) {
      for (const MetricColumn& column : columns) {
        const ResultsIndex::Cell cell = index.cell(policy, budget, column.name);
        std::string text = "–";
        if (cell.present) {
          any_value = true;
          text = column.format(cell.value);
          if (cell.is_reference) {
            any_reference = true;
            text = "_" + text + "_";
          } else if (std::isfinite(cell.value) && text == best[{budget, column.name}]) {
            text = "**" + text + "**";
          }
        }
        line += " " + text + " |";
      }
    }
    // A policy without any of this table's metrics (e.g. no cost measured for it) gets no row.
    if (any_value) out << line << '\n';
  }

  std::vector<std::string> lower, higher;
  for (const MetricColumn& column : columns) {
    if (column.better == Better::Lower) lower.push_back(column.header);
    if (column.better == Better::Higher) higher.push_back(column.header);
  }
  auto join = [](const std::vector<std::string>& items) {
    std::string text;
    for (const std::string& item : items) text += (text.empty() ? "" : ", ") + item;
    return text;
  };
  out << '\n';
  if (!lower.empty()) out << "Lower is better: " << join(lower) << ". ";
  if (!higher.empty()) out << "Higher is better: " << join(higher) << ". ";
  if (!lower.empty() || !higher.empty()) out << "**Bold**: best at that budget.";
  if (any_reference) out << " _Italic_: unbounded cache (budget 0), shown under every budget as the reference.";
  out << '\n';
}

}  // namespace

void write_results_json(const EvalResults& results, const std::string& path) {
  if (!results.meta.is_object()) fail(path, "meta", "must be a JSON object, got " + std::string(results.meta.type_name()));
  validate_rows(results.rows, path);
  nlohmann::json rows = nlohmann::json::array();
  for (const ResultRow& row : results.rows) {
    nlohmann::json metrics = nlohmann::json::object();
    for (const auto& [name, value] : row.metrics) {
      metrics[name] = std::isfinite(value) ? nlohmann::json(value) : nlohmann::json(nullptr);
    }
    rows.push_back({{"policy", row.policy}, {"budget", row.budget}, {"metrics", std::move(metrics)}});
  }
  const nlohmann::json document = {
      {"format", kFormatName}, {"version", kFormatVersion}, {"meta", results.meta}, {"rows", std::move(rows)}};
  write_file_atomic(path, document.dump(2) + "\n");
}

EvalResults read_results_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "", "cannot open: " + errno_text());
  std::stringstream text;
  text << in.rdbuf();

  nlohmann::json document;
  try {
    document = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::parse_error& e) {
    // nlohmann prefixes "[json.exception.parse_error.101] "; the rest says where and why.
    std::string what = e.what();
    const std::size_t prefix_end = what.find("] ");
    if (prefix_end != std::string::npos) what = what.substr(prefix_end + 2);
    fail(path, "", "not valid JSON: " + what);
  }

  if (!document.is_object()) fail(path, "", "expected a JSON object at the top level, got " + std::string(document.type_name()));
  reject_unknown_keys(document, {"format", "version", "meta", "rows"}, path, "");
  for (const char* required : {"format", "version", "meta", "rows"}) {
    if (!document.contains(required)) fail(path, required, "missing");
  }
  if (document["format"] != kFormatName) {
    fail(path, "format", "expected \"" + std::string(kFormatName) + "\", got " + document["format"].dump());
  }
  if (document["version"] != kFormatVersion) {
    fail(path, "version", "unsupported version " + document["version"].dump() + " (this build reads version " +
                              std::to_string(kFormatVersion) + ")");
  }
  if (!document["meta"].is_object()) fail(path, "meta", "expected an object, got " + std::string(document["meta"].type_name()));
  if (!document["rows"].is_array()) fail(path, "rows", "expected an array, got " + std::string(document["rows"].type_name()));

  EvalResults results;
  results.meta = document["meta"];
  const nlohmann::json& rows = document["rows"];
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const nlohmann::json& row_json = rows[i];
    if (!row_json.is_object()) fail(path, row_field(i), "expected an object, got " + std::string(row_json.type_name()));
    reject_unknown_keys(row_json, {"policy", "budget", "metrics"}, path, row_field(i));
    for (const char* required : {"policy", "budget", "metrics"}) {
      if (!row_json.contains(required)) fail(path, row_field(i, required), "missing");
    }
    ResultRow row;
    const nlohmann::json& policy = row_json["policy"];
    if (!policy.is_string()) fail(path, row_field(i, "policy"), "expected a string, got " + std::string(policy.type_name()));
    row.policy = policy.get<std::string>();
    const nlohmann::json& budget = row_json["budget"];
    const bool budget_valid =
        budget.is_number_unsigned()
            ? budget.get<std::uint64_t>() <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())
            : budget.is_number_integer() && budget.get<std::int64_t>() >= 0;
    if (!budget_valid) {
      fail(path, row_field(i, "budget"), "expected a non-negative integer (0 = unbounded), got " + budget.dump());
    }
    row.budget = budget.get<std::int64_t>();
    const nlohmann::json& metrics = row_json["metrics"];
    if (!metrics.is_object()) fail(path, row_field(i, "metrics"), "expected an object, got " + std::string(metrics.type_name()));
    for (const auto& item : metrics.items()) {
      const nlohmann::json& value = item.value();
      if (value.is_null()) {
        row.metrics[item.key()] = std::numeric_limits<double>::quiet_NaN();
      } else if (value.is_number()) {
        row.metrics[item.key()] = value.get<double>();
      } else {
        fail(path, row_field(i, "metrics." + item.key()), "expected a number or null, got " + value.dump());
      }
    }
    results.rows.push_back(std::move(row));
  }
  validate_rows(results.rows, path);
  return results;
}

std::string results_markdown(const EvalResults& results) {
  const ResultsIndex index(results);
  std::ostringstream out;
  out << "# kvbound evaluation\n";
  if (results.meta.is_object() && !results.meta.empty()) {
    out << '\n';
    for (const auto& item : results.meta.items()) {
      const nlohmann::json& value = item.value();
      out << "- " << item.key() << ": ";
      if (value.is_string()) {
        out << value.get<std::string>();
      } else if (value.is_primitive()) {
        out << value.dump();
      } else {
        out << '`' << value.dump() << '`';
      }
      out << '\n';
    }
  }
  if (results.rows.empty()) {
    out << "\nNo results.\n";
    return out.str();
  }

  append_table(out, index, "Quality", quality_columns());
  append_table(out, index, "Cost", cost_columns());

  std::set<std::string> known;
  for (const auto& columns : {quality_columns(), cost_columns()}) {
    for (const MetricColumn& column : columns) known.insert(column.name);
  }
  std::vector<MetricColumn> other;
  for (const std::string& name : index.metric_names()) {
    if (known.count(name) == 0) other.push_back({name, name, Better::Neither, format_general});
  }
  append_table(out, index, "Other metrics", other);
  return out.str();
}

}  // namespace kvbound
