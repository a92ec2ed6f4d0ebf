// Evaluation reports: results JSON round trip and validation, the Markdown tables, the quality plots
// (real PNGs of the right size whose pixels follow the data) and the progress bar's log format.
#include <cairo.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "base/errors.h"
#include "eval/plot_axis.h"
#include "eval/plots.h"
#include "base/progress.h"
#include "eval/results.h"

using namespace kvbound;
namespace fs = std::filesystem;

namespace {

class ReportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string name_template = (fs::temp_directory_path() / "kvbound_report_XXXXXX").string();
    ASSERT_NE(::mkdtemp(name_template.data()), nullptr);
    dir_ = name_template;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& rel) const { return (dir_ / rel).string(); }

  void write_text(const std::string& file, const std::string& text) const {
    std::ofstream out(file, std::ios::binary);
    out << text;
  }

  // Expects reading `text` as a results file to fail with a message naming the file and `field`.
  void expect_read_error(const std::string& text, const std::string& field) const {
    const std::string file = path("bad.json");
    write_text(file, text);
    try {
      read_results_json(file);
      ADD_FAILURE() << "no error for field " << field << " in " << text;
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(file), std::string::npos) << message;
      EXPECT_NE(message.find(field), std::string::npos) << message;
    }
  }

  fs::path dir_;
};

// Numbers in the range of the stories260K prototype (assets/REFERENCE_RESULTS.md), budgets 64/128/256.
EvalResults sample_results(double kl_scale = 1.0) {
  EvalResults results;
  results.meta = {{"model", "SmolLM2-135M"}, {"config_hash", "3f9a1c2e"}, {"settings", {{"windows", 64}}}};
  results.rows.push_back({"full", 0, {{"nll", 1.3046}, {"kl_to_full", 0.0}, {"top1_agree", 1.0},
                                      {"retrieval_acc", 0.97}, {"decode_tok_s", 140.0}}});
  const std::vector<std::int64_t> budgets = {64, 128, 256};
  const std::vector<std::pair<std::string, std::vector<double>>> kl = {
      {"streaming_llm", {0.224, 0.125, 0.049}}, {"h2o", {0.154, 0.082, 0.030}}, {"trimkv", {0.101, 0.032, 0.007}}};
  for (std::size_t p = 0; p < kl.size(); ++p) {
    const auto& [policy, values] = kl[p];
    for (std::size_t b = 0; b < budgets.size(); ++b) {
      const double v = values[b] * kl_scale;
      results.rows.push_back({policy, budgets[b],
                              {{"kl_to_full", v}, {"top1_agree", 1.0 - v}, {"nll", 1.3046 + v},
                               {"retrieval_acc", 0.9 - 2.0 * v}, {"decode_tok_s", 150.0 - 10.0 * p - b},
                               {"peak_kv_bytes", 1048576.0 * static_cast<double>(budgets[b])}}});
    }
  }
  return results;
}

std::string read_bytes(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

}  // namespace

TEST_F(ReportTest, ResultsJsonRoundTrip) {
  EvalResults results = sample_results();
  results.rows.push_back({"tova", 64, {{"kl_to_full", std::numeric_limits<double>::quiet_NaN()}}});
  const std::string file = path("nested/run/results.json");  // the directories do not exist yet
  write_results_json(results, file);

  const EvalResults back = read_results_json(file);
  EXPECT_EQ(back.meta, results.meta);
  ASSERT_EQ(back.rows.size(), results.rows.size());
  for (std::size_t i = 0; i < results.rows.size(); ++i) {
    EXPECT_EQ(back.rows[i].policy, results.rows[i].policy);
    EXPECT_EQ(back.rows[i].budget, results.rows[i].budget);
    ASSERT_EQ(back.rows[i].metrics.size(), results.rows[i].metrics.size()) << i;
    for (const auto& [name, value] : results.rows[i].metrics) {
      const double read = back.rows[i].metrics.at(name);
      if (std::isnan(value)) {
        EXPECT_TRUE(std::isnan(read)) << name;
      } else {
        EXPECT_EQ(read, value) << results.rows[i].policy << " " << name;
      }
    }
  }
  // Only the published file remains: the temporary one was renamed, not left behind.
  EXPECT_EQ(std::distance(fs::directory_iterator(path("nested/run")), fs::directory_iterator()), 1);
  // Rewriting replaces the file whole.
  results.rows.resize(2);
  write_results_json(results, file);
  EXPECT_EQ(read_results_json(file).rows.size(), 2u);
}

TEST_F(ReportTest, WriteRejectsInvalidRowsAndWritesNothing) {
  EvalResults results = sample_results();
  results.rows.push_back({"h2o", 64, {}});
  const std::string file = path("dup.json");
  try {
    write_results_json(results, file);
    ADD_FAILURE() << "duplicate row accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rows[" + std::to_string(results.rows.size() - 1) + "]"), std::string::npos)
        << e.what();
  }
  results.rows.back() = {"h2o", -1, {}};
  EXPECT_THROW(write_results_json(results, file), Error);
  EXPECT_FALSE(fs::exists(file));
}

TEST_F(ReportTest, BadResultsJsonNamesFileAndField) {
  const std::string head = R"({"format": "kvbound-eval-results", "version": 1, "meta": {}, "rows": )";
  expect_read_error("{not json", "not valid JSON");
  expect_read_error("[]", "top level");
  expect_read_error(R"({"format": "something-else", "version": 1, "meta": {}, "rows": []})", "format");
  expect_read_error(R"({"format": "kvbound-eval-results", "version": 2, "meta": {}, "rows": []})", "version");
  expect_read_error(R"({"format": "kvbound-eval-results", "version": 1, "meta": {}})", "rows");
  expect_read_error(R"({"format": "kvbound-eval-results", "version": 1, "meta": [], "rows": []})", "meta");
  expect_read_error(head + R"({}})", "rows");
  expect_read_error(head + R"([{"policy": "h2o", "budget": 64, "metrics": {}}, {"policy": "h2o", "budget": "64", "metrics": {}}]})",
                    "rows[1].budget");
  expect_read_error(head + R"([{"policy": "h2o", "budget": -64, "metrics": {}}]})", "rows[0].budget");
  expect_read_error(head + R"([{"policy": "h2o", "budget": 64.5, "metrics": {}}]})", "rows[0].budget");
  expect_read_error(head + R"([{"policy": "", "budget": 64, "metrics": {}}]})", "rows[0].policy");
  expect_read_error(head + R"([{"policy": 3, "budget": 64, "metrics": {}}]})", "rows[0].policy");
  expect_read_error(head + R"([{"policy": "h2o", "metrics": {}}]})", "rows[0].budget");
  expect_read_error(head + R"([{"policy": "h2o", "budget": 64, "metrics": {"nll": "low"}}]})", "rows[0].metrics.nll");
  expect_read_error(head + R"([{"policy": "h2o", "budget": 64, "metrics": {}, "colour": "red"}]})", "rows[0].colour");
  expect_read_error(head + R"([{"policy": "h2o", "budget": 64, "metrics": {}}, {"policy": "h2o", "budget": 64, "metrics": {}}]})",
                    "rows[1]");

  const std::string missing = path("missing.json");
  try {
    read_results_json(missing);
    ADD_FAILURE() << "missing file accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
}

TEST(ResultsMarkdown, ListsEveryPolicyAndBudgetAndBoldsTheBest) {
  EvalResults results = sample_results();
  results.rows.push_back({"tova", 64, {{"kl_to_full", std::numeric_limits<double>::quiet_NaN()}}});
  const std::string markdown = results_markdown(results);

  for (const char* policy : {"full", "streaming_llm", "h2o", "trimkv", "tova"}) {
    EXPECT_NE(markdown.find(std::string("| ") + policy + " |"), std::string::npos) << policy;
  }
  for (const char* budget : {"M=64 KL", "M=128 KL", "M=256 KL", "M=64 decode tok/s", "M=256 decode tok/s"}) {
    EXPECT_NE(markdown.find(budget), std::string::npos) << budget;
  }
  EXPECT_NE(markdown.find("- model: SmolLM2-135M"), std::string::npos);

  // trimkv has the lowest KL/NLL and the highest agreement/accuracy at every budget.
  const std::vector<std::string> lines = lines_of(markdown);
  auto row_of = [&](const std::string& policy, const std::string& table) {
    bool in_table = false;
    for (const std::string& line : lines) {
      if (line.rfind("## ", 0) == 0) in_table = line == "## " + table;
      if (in_table && line.rfind("| " + policy + " |", 0) == 0) return line;
    }
    return std::string();
  };
  const std::string trimkv = row_of("trimkv", "Quality");
  EXPECT_EQ(trimkv,
            "| trimkv | **0.1010** | **0.899** | **1.4056** | **0.698** | **0.0320** | **0.968** | **1.3366** | **0.836** |"
            " **0.0070** | **0.993** | **1.3116** | **0.886** |");
  const std::string h2o = row_of("h2o", "Quality");
  EXPECT_EQ(h2o.find("**"), std::string::npos) << h2o;
  EXPECT_EQ(h2o.rfind("| h2o | 0.1540 | 0.846 | 1.4586 | 0.592 |", 0), 0u) << h2o;
  // The unbounded reference shows in italics under every budget and never takes the bold.
  const std::string full = row_of("full", "Quality");
  EXPECT_EQ(full.find("**"), std::string::npos) << full;
  EXPECT_NE(full.find("_1.3046_ | _0.970_ | _0.0000_"), std::string::npos) << full;
  // A metric that came out NaN reads n/a; a metric the row lacks reads as a dash.
  EXPECT_EQ(row_of("tova", "Quality").rfind("| tova | n/a | – |", 0), 0u) << row_of("tova", "Quality");

  // Cost: the fastest decode is bold; peak KV is equal for every policy at a budget, so nothing is bold.
  const std::string cost = row_of("streaming_llm", "Cost");
  EXPECT_EQ(cost, "| streaming_llm | **150** | 64.0 | **149** | 128 | **148** | 256 |");
  EXPECT_NE(row_of("full", "Cost").find("_140_"), std::string::npos);
}

TEST(PlotAxis, KlSpanningDecadesGetsALogAxisWithEvenlySpacedDecades) {
  // The README table's range: trimkv+mem at M = 256 to streaming_llm at M = 64, and random beyond.
  const ValueAxis axis = value_axis({0.0055, 0.076, 0.27, 2.5}, std::numeric_limits<double>::infinity(), true);
  ASSERT_TRUE(axis.log_scale);
  // Four decades and more: a tick per decade only.
  EXPECT_EQ(axis.labels, (std::vector<std::string>{"0.001", "0.01", "0.1", "1", "10"}));
  ASSERT_EQ(axis.ticks.size(), 5u);
  const double decade = axis.fraction(0.01) - axis.fraction(0.001);
  EXPECT_GT(decade, 0.15);
  for (std::size_t i = 1; i < axis.ticks.size(); ++i)
    EXPECT_NEAR(axis.fraction(axis.ticks[i]) - axis.fraction(axis.ticks[i - 1]), decade, 1e-12);
  EXPECT_NEAR(axis.fraction(0.02) - axis.fraction(0.01), decade * std::log10(2.0), 1e-12);
  for (double value : {0.0055, 0.076, 0.27, 2.5}) {
    EXPECT_GT(axis.fraction(value), 0.0);
    EXPECT_LT(axis.fraction(value), 1.0);
  }
  // The full cache's KL, 0 or a rounding error away from it, has no place on it.
  EXPECT_FALSE(axis.shows(0.0));
  EXPECT_FALSE(axis.shows(2e-9));
  EXPECT_TRUE(axis.shows(0.002));
}

TEST(PlotAxis, LogAxisOverFewDecadesTicksAtOneTwoFive) {
  const ValueAxis axis = value_axis({0.007, 0.03, 0.224}, std::numeric_limits<double>::infinity(), true);
  ASSERT_TRUE(axis.log_scale);
  // From the largest tick at or below 0.007 to the smallest at or above 0.224.
  EXPECT_EQ(axis.labels, (std::vector<std::string>{"0.005", "0.01", "0.02", "0.05", "0.1", "0.2", "0.5"}));
  EXPECT_LT(axis.fraction(0.005), axis.fraction(0.007));
  EXPECT_GT(axis.fraction(0.5), axis.fraction(0.224));
  // A value that is a tick does not grow another one.
  EXPECT_EQ(value_axis({0.01, 0.2}, 1.0, true).labels, (std::vector<std::string>{"0.01", "0.02", "0.05", "0.1", "0.2"}));
}

TEST(PlotAxis, LinearWhenNarrowNotAllowedOrTouchingZero) {
  const double unbounded = std::numeric_limits<double>::infinity();
  // Less than a factor of 10: linear, 1/2/5 steps, clipped at the bound of a fraction.
  const ValueAxis agreement = value_axis({0.8, 0.95}, 1.0, true);
  EXPECT_FALSE(agreement.log_scale);
  EXPECT_EQ(agreement.labels, (std::vector<std::string>{"0.75", "0.80", "0.85", "0.90", "0.95", "1.00"}));
  EXPECT_NEAR(agreement.fraction(0.9) - agreement.fraction(0.8), 2.0 * (agreement.fraction(0.85) - agreement.fraction(0.8)), 1e-12);
  // The metric does not allow a log axis, however wide.
  EXPECT_FALSE(value_axis({0.01, 5.0}, unbounded, false).log_scale);
  // A zero among the values (a bounded row as good as the full cache) keeps the axis linear, from 0.
  const ValueAxis with_zero = value_axis({0.0, 0.1, 2.0}, unbounded, true);
  EXPECT_FALSE(with_zero.log_scale);
  EXPECT_EQ(with_zero.labels.front(), "0.0");
  EXPECT_TRUE(with_zero.shows(0.0));
  // So does a float rounding error away from zero: ten decades of axis for it would squash the real values.
  EXPECT_FALSE(value_axis({2e-9, 0.1, 0.3}, unbounded, true).log_scale);
}

TEST_F(ReportTest, QualityPlotsAreRealPngsThatFollowTheData) {
  const std::vector<std::string> written = write_quality_plots(sample_results(), path("plots/a"));
  const std::vector<std::string> expected = {path("plots/a/kl_to_full.png"), path("plots/a/top1_agree.png"),
                                             path("plots/a/nll.png"), path("plots/a/retrieval_acc.png")};
  ASSERT_EQ(written, expected);
  EXPECT_EQ(std::distance(fs::directory_iterator(path("plots/a")), fs::directory_iterator()), 4);

  const std::vector<std::string> other = write_quality_plots(sample_results(1.5), path("plots/b"));
  ASSERT_EQ(other.size(), 4u);

  for (std::size_t i = 0; i < written.size(); ++i) {
    EXPECT_EQ(read_bytes(written[i]).substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8)) << written[i];
    cairo_surface_t* a = cairo_image_surface_create_from_png(written[i].c_str());
    cairo_surface_t* b = cairo_image_surface_create_from_png(other[i].c_str());
    ASSERT_EQ(cairo_surface_status(a), CAIRO_STATUS_SUCCESS) << written[i];
    ASSERT_EQ(cairo_surface_status(b), CAIRO_STATUS_SUCCESS) << other[i];
    EXPECT_EQ(cairo_image_surface_get_width(a), 900);
    EXPECT_EQ(cairo_image_surface_get_height(a), 600);

    const int stride = cairo_image_surface_get_stride(a);
    const unsigned char* pixels_a = cairo_image_surface_get_data(a);
    const unsigned char* pixels_b = cairo_image_surface_get_data(b);
    std::size_t not_white = 0, different = 0;
    for (int y = 0; y < 600; ++y) {
      const auto* row_a = reinterpret_cast<const std::uint32_t*>(pixels_a + y * stride);
      const auto* row_b = reinterpret_cast<const std::uint32_t*>(pixels_b + y * stride);
      for (int x = 0; x < 900; ++x) {
        not_white += (row_a[x] & 0xFFFFFFu) != 0xFFFFFFu;
        different += row_a[x] != row_b[x];
      }
    }
    // Axes, text and the lines cover a few percent of the canvas; other numbers move the lines.
    EXPECT_GT(not_white, 900u * 600u / 50u) << written[i];
    EXPECT_GT(different, 500u) << written[i];
    cairo_surface_destroy(a);
    cairo_surface_destroy(b);
  }
}

// Rows of a PNG holding at least `count` pixels of exactly `rgb`: a drawn horizontal line (dashed or not),
// never text, whose antialiased strokes hit an exact colour at a few pixels of a row.
int rows_with_pixels_of(const std::string& png, std::uint32_t rgb, int count) {
  cairo_surface_t* image = cairo_image_surface_create_from_png(png.c_str());
  EXPECT_EQ(cairo_surface_status(image), CAIRO_STATUS_SUCCESS) << png;
  const int stride = cairo_image_surface_get_stride(image);
  const unsigned char* pixels = cairo_image_surface_get_data(image);
  int rows = 0;
  for (int y = 0; y < cairo_image_surface_get_height(image); ++y) {
    const auto* row = reinterpret_cast<const std::uint32_t*>(pixels + y * stride);
    int found = 0;
    for (int x = 0; x < cairo_image_surface_get_width(image); ++x) found += (row[x] & 0xFFFFFFu) == rgb;
    rows += found >= count;
  }
  cairo_surface_destroy(image);
  return rows;
}

// The full cache's dashed grey reference: drawn on the linear agreement axis (at 1), left out of the log KL axis
// (its KL of 0 has no place there), legend sample included.
TEST_F(ReportTest, LogKlPlotLeavesOutTheFullCacheReference) {
  write_quality_plots(sample_results(), dir_.string());
  constexpr std::uint32_t kFullGrey = 0x444444;
  EXPECT_GT(rows_with_pixels_of(path("top1_agree.png"), kFullGrey, 100), 0);
  EXPECT_EQ(rows_with_pixels_of(path("kl_to_full.png"), kFullGrey, 100), 0);
}

TEST_F(ReportTest, QualityPlotsOnlyForMetricsWithBoundedValues) {
  EvalResults results;
  results.rows.push_back({"full", 0, {{"nll", 1.3}, {"top1_agree", 1.0}}});
  results.rows.push_back({"h2o", 64, {{"nll", 1.5}, {"decode_tok_s", 100.0}}});
  results.rows.push_back({"h2o", 128, {{"nll", 1.4}}});
  EXPECT_EQ(write_quality_plots(results, dir_.string()), std::vector<std::string>{path("nll.png")});

  EvalResults only_full;
  only_full.rows.push_back({"full", 0, {{"nll", 1.3}}});
  EXPECT_TRUE(write_quality_plots(only_full, path("none")).empty());
}

TEST(ProgressBar, LogModePrintsALineEveryTenPercent) {
  std::ostringstream out;
  {
    ProgressBar bar("eval h2o", 200, out);
    EXPECT_FALSE(bar.interactive());
    for (int i = 0; i < 200; ++i) bar.advance(1, "window " + std::to_string(i));
    bar.finish();
  }
  const std::vector<std::string> lines = lines_of(out.str());
  ASSERT_EQ(lines.size(), 10u) << out.str();
  const std::regex format(
      R"(eval h2o  (\d+)/200  (\d+\.\d)%  (\d+(\.\d+)? it/s|\d+\.\d\d s/it)  elapsed \d+:\d\d:\d\d  ETA \d+:\d\d:\d\d  window \d+)");
  for (std::size_t i = 0; i < lines.size(); ++i) {
    std::smatch match;
    ASSERT_TRUE(std::regex_match(lines[i], match, format)) << lines[i];
    EXPECT_EQ(std::stoi(match[1]), 20 * static_cast<int>(i + 1)) << lines[i];
    EXPECT_EQ(match[2], std::to_string(10 * (i + 1)) + ".0") << lines[i];
  }
  EXPECT_NE(lines.back().find("ETA 0:00:00"), std::string::npos) << lines.back();
}

TEST(ProgressBar, LogModeFinishPrintsWhereItStopped) {
  std::ostringstream out;
  ProgressBar bar("train", 1000, out, ProgressBar::Mode::Log);
  bar.advance(250);  // crosses 10% and 20% at once: one line
  bar.advance(50);
  bar.advance(40);  // inside the 30% step: no line
  bar.finish();
  bar.finish();
  bar.advance(10);  // after finish: ignored
  const std::vector<std::string> lines = lines_of(out.str());
  ASSERT_EQ(lines.size(), 3u) << out.str();
  EXPECT_EQ(lines[0].rfind("train  250/1000  25.0%", 0), 0u) << lines[0];
  EXPECT_EQ(lines[1].rfind("train  300/1000  30.0%", 0), 0u) << lines[1];
  EXPECT_EQ(lines[2].rfind("train  340/1000  34.0%", 0), 0u) << lines[2];
  EXPECT_NE(lines[2].find("ETA "), std::string::npos) << lines[2];
  EXPECT_THROW(ProgressBar("bad", -1, out), std::invalid_argument);
}

TEST(ProgressBar, InteractiveModeRedrawsOneLine) {
  std::ostringstream out;
  {
    ProgressBar bar("decode", 1000, out, ProgressBar::Mode::Interactive);
    for (int i = 0; i < 1000; ++i) bar.advance();
  }  // the destructor finishes the line
  const std::string text = out.str();
  ASSERT_FALSE(text.empty());
  EXPECT_EQ(text.front(), '\r');
  EXPECT_EQ(text.back(), '\n');
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 1);
  // Redraws are rate-limited: a thousand quick advances draw a handful of times, not a thousand.
  EXPECT_LT(std::count(text.begin(), text.end(), '\r'), 50);
  const std::string last = text.substr(text.rfind('\r'));
  EXPECT_NE(last.find("decode [####################]  1000/1000  100.0%"), std::string::npos) << last;
}

TEST(ProgressBar, DurationsAreHoursMinutesSeconds) {
  EXPECT_EQ(format_duration_hms(0.0), "0:00:00");
  EXPECT_EQ(format_duration_hms(65.4), "0:01:05");
  EXPECT_EQ(format_duration_hms(3725.0), "1:02:05");
  EXPECT_EQ(format_duration_hms(45296.0), "12:34:56");
  EXPECT_EQ(format_duration_hms(-1.0), "-:--:--");
  EXPECT_EQ(format_duration_hms(std::numeric_limits<double>::infinity()), "-:--:--");
}
