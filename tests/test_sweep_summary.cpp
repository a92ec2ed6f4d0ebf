// The sweep summary's comparison of each non-heuristic policy with the best heuristic of its own seed: the
// heuristic is picked per seed and per budget (not from the means), the ratio (lower-is-better metrics) or
// difference (higher-is-better) is taken within a seed, and the Markdown table reports mean, min and max.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "eval/sweep_summary.h"

using namespace kvbound;

namespace {

SweepRun run(std::int64_t seed, double h2o, double snapkv, double trimkv, double top1_trimkv) {
  EvalResults r;
  r.rows = {{"full", 0, {{"kl_to_full", 0.0}, {"top1_agree", 1.0}}},
            {"h2o", 64, {{"kl_to_full", h2o}, {"top1_agree", 0.80}}},
            {"snapkv", 64, {{"kl_to_full", snapkv}, {"top1_agree", 0.70}}},
            {"trimkv", 64, {{"kl_to_full", trimkv}, {"top1_agree", top1_trimkv}}},
            {"oracle", 128, {{"kl_to_full", 0.01}, {"top1_agree", 0.99}}}};  // no heuristic at 128: not compared
  return {0, seed, r};
}

const std::vector<SweepRun> kRuns = {run(0, 0.10, 0.20, 0.05, 0.90), run(1, 0.30, 0.20, 0.10, 0.75)};

}  // namespace

TEST(SweepSummary, SetsEachPolicyAgainstTheBestHeuristicOfItsOwnSeed) {
  const SweepSummary s = summarize_sweep({}, {SweepPoint{}}, kRuns, "kl_to_full", {"h2o", "snapkv"});
  ASSERT_EQ(s.against_heuristics.size(), 1u);
  const HeuristicComparison& c = s.against_heuristics[0];
  EXPECT_EQ(c.policy, "trimkv");
  EXPECT_EQ(c.budget, 64);
  // Seed 0: h2o (0.10) is best, 0.05/0.10; seed 1: snapkv (0.20), 0.10/0.20. On the means (h2o 0.20, snapkv
  // 0.20) neither would be picked per seed.
  ASSERT_EQ(c.per_seed.size(), 2u);
  EXPECT_DOUBLE_EQ(c.per_seed[0], 0.5);
  EXPECT_DOUBLE_EQ(c.per_seed[1], 0.5);
  EXPECT_EQ(c.best_heuristic, (std::vector<std::string>{"h2o", "snapkv"}));

  const std::string md = sweep_markdown(s);
  EXPECT_NE(md.find("kl_to_full over that of the best heuristic in the same seed (h2o, snapkv)"), std::string::npos) << md;
  EXPECT_NE(md.find("| trimkv | 64 | 2 | 0.50× | 0.50× | 0.50× | h2o, snapkv |"), std::string::npos) << md;
  // The oracle at 128 had no heuristic beside it: it is in the main table only.
  const std::size_t oracle = md.find("| oracle |");
  ASSERT_NE(oracle, std::string::npos) << md;
  EXPECT_EQ(md.find("| oracle |", oracle + 1), std::string::npos) << md;
}

TEST(SweepSummary, HigherIsBetterMetricsAreComparedByDifference) {
  const SweepSummary s = summarize_sweep({}, {SweepPoint{}}, kRuns, "top1_agree", {"h2o", "snapkv"});
  ASSERT_EQ(s.against_heuristics.size(), 1u);
  const HeuristicComparison& c = s.against_heuristics[0];
  EXPECT_NEAR(c.per_seed[0], 0.10, 1e-12);
  EXPECT_NEAR(c.per_seed[1], -0.05, 1e-12);
  EXPECT_EQ(c.best_heuristic, (std::vector<std::string>{"h2o", "h2o"}));
  EXPECT_NE(sweep_markdown(s).find("| trimkv | 64 | 2 | 0.025 | -0.050 | 0.100 | h2o, h2o |"), std::string::npos)
      << sweep_markdown(s);
}

TEST(SweepSummary, WithoutHeuristicsThereIsNoComparisonTable) {
  const SweepSummary s = summarize_sweep({}, {SweepPoint{}}, kRuns, "kl_to_full", {});
  EXPECT_TRUE(s.against_heuristics.empty());
  EXPECT_EQ(sweep_markdown(s).find("best heuristic"), std::string::npos);
}
