// `kvbound inspect`: the head patterns and token lifetimes of a cache timeline (computed here for a synthetic
// sliding window and a window with an attention sink), and the real CLI on freshly trained stories260K TRIM-KV
// gates and an IndexMem indexer: its pictures and its table.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>

#include "eval/cache_inspection.h"
#include "test_env.h"
#include "tiny_cli_runs.h"

namespace kvbound {
namespace {

namespace fs = std::filesystem;

// Head 0 holds the `budget` newest positions (a sliding window); head 1 holds position 0 and the budget − 1 newest.
CacheTimeline synthetic(std::size_t T, std::size_t budget) {
  CacheTimeline tl;
  tl.layers = 1;
  tl.heads = 2;
  tl.tokens = static_cast<std::int64_t>(T);
  tl.held.assign(1, std::vector<std::vector<std::vector<bool>>>(2, std::vector<std::vector<bool>>(T, std::vector<bool>(T, false))));
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t i = 0; i <= t; ++i) {
      tl.held[0][0][t][i] = i + budget > t;
      tl.held[0][1][t][i] = i == 0 || i + budget - 1 > t;
    }
  return tl;
}

TEST(CacheInspection, FindsASlidingWindowAndAnAttentionSink) {
  const CacheTimeline tl = synthetic(40, 8);
  const std::vector<HeadPattern> p = head_patterns(tl, 8, at::Tensor());
  ASSERT_EQ(p.size(), 2u);
  EXPECT_DOUBLE_EQ(p[0].recent_share, 1.0);
  EXPECT_DOUBLE_EQ(p[0].sink_held, 0.0);
  EXPECT_DOUBLE_EQ(p[1].sink_held, 1.0);
  EXPECT_DOUBLE_EQ(p[1].recent_share, 7.0 / 8.0);
  EXPECT_TRUE(std::isnan(p[0].mean_beta));
  const std::vector<double> life = token_lifetimes(tl);
  EXPECT_DOUBLE_EQ(life[0], (8.0 + 40.0) / 2.0);  // the window holds it 8 steps, the sink head all 40
  EXPECT_DOUBLE_EQ(life[20], (8.0 + 7.0) / 2.0);
}

// Shares from gates: a layer whose tokens are forgotten slowly (log β −0.01) would hold most of a cross-layer
// top-k; one that forgets fast (−1) holds its newest few; equal gates share equally. Mean 1 either way.
TEST(CacheInspection, GateLayerSharesFollowTheGatesScores) {
  const at::Tensor slow = at::full({1, 2, 40}, -0.01), fast = at::full({1, 2, 40}, -1.0);
  const std::vector<double> uneven = gate_layer_shares({at::cat({fast, slow, fast})}, 8);
  ASSERT_EQ(uneven.size(), 3u);
  EXPECT_GT(uneven[1], 3 * uneven[0]);
  EXPECT_DOUBLE_EQ(uneven[0], uneven[2]);
  EXPECT_NEAR((uneven[0] + uneven[1] + uneven[2]) / 3, 1.0, 1e-12);
  for (const double share : gate_layer_shares({at::cat({slow, slow}), at::cat({fast, fast})}, 8)) EXPECT_DOUBLE_EQ(share, 1.0);
}

TEST(InspectCli, DrawsAndSummarisesTrainedTrimKVAndIndexMem) {
  const test::TinyCli cli = test::stories260k_cli();
  test::TempDir dir("inspect_cli");
  std::string out, err;
  for (const std::string method : {"trimkv", "indexmem"}) {
    SCOPED_TRACE(method);
    std::ofstream(dir / (method + ".yaml")) << test::tiny_train_yaml(
        cli, "  method: " + method + "\n  steps: 3\n",
        "trimkv:\n  gate_hidden: 16\nindexmem:\n  d_index: 8\nrun:\n  out_dir: " + (dir / method) + "\n");
    ASSERT_EQ(test::run_kvbound("train " + (dir / (method + ".yaml")), &out, &err), 0) << err;
    const std::string folder = dir / (method + "_inspect");
    out.clear();  // run_kvbound appends
    ASSERT_EQ(test::run_kvbound("inspect " + (dir / method) + " --text " + cli.valid + " --budget 16 --tokens 64 --threads 1 --out " +
                                    folder, &out, &err), 0) << err;
    EXPECT_EQ(fs::exists(folder + "/retention.png"), method == "trimkv");
    for (int l = 0; l < 5; ++l) EXPECT_TRUE(fs::exists(folder + "/cache_layer" + std::to_string(l) + ".png")) << l;
    std::ifstream in(folder + "/summary.md");
    std::stringstream md;
    md << in.rdbuf();
    EXPECT_EQ(md.str(), out);
    std::size_t head_rows = 0;
    for (std::size_t at = md.str().find("\n| ", 0); at != std::string::npos; at = md.str().find("\n| ", at + 1))
      head_rows += std::isdigit(static_cast<unsigned char>(md.str()[at + 3])) ? 1 : 0;
    EXPECT_EQ(head_rows, 5u * 4u) << md.str();  // one row per layer and KV head
    EXPECT_NE(md.str().find("Longest-lived tokens"), std::string::npos);
  }
  // --layer-shares: one share per layer from the gates, mean 1, printed and written as YAML that eval reads; an
  // indexer has no gates to derive them from.
  out.clear();
  ASSERT_EQ(test::run_kvbound("inspect " + (dir / "trimkv") + " --text " + cli.valid + " --layer-shares --budget 8 --tokens 64 " +
                                  "--windows 3 --text-part 0,0.5 --threads 1 --out " + (dir / "shares"), &out, &err), 0) << err;
  std::ifstream yaml(dir / "shares/layer_shares.yaml");
  std::stringstream written;
  written << yaml.rdbuf();
  EXPECT_EQ(written.str(), out);
  const std::size_t open = out.find("layer_budget_shares: [");
  ASSERT_NE(open, std::string::npos) << out;
  const std::string listed = out.substr(open + 22, out.find(']', open) - open - 22);
  std::stringstream list(listed);
  std::vector<double> shares;
  for (std::string item; std::getline(list, item, ',');) shares.push_back(std::stod(item));
  ASSERT_EQ(shares.size(), 5u) << out;
  double sum = 0;
  for (const double share : shares) {
    EXPECT_GT(share, 0);
    sum += share;
  }
  EXPECT_NEAR(sum / 5, 1.0, 0.01);
  ASSERT_EQ(test::run_kvbound("export " + (dir / "trimkv") + " --out " + (dir / "gates.safetensors"), &out, &err), 0) << err;
  EXPECT_EQ(test::run_kvbound("eval --set model.path=" + cli.model + " --set eval.text=" + cli.valid + " --set eval.tasks=[continuation] " +
                                  "--set eval.policies=[trimkv] --set trimkv.gates=" + (dir / "gates.safetensors") + " --set eval.budgets=[8] " +
                                  "--set eval.num_windows=1 --set eval.context_len=48 --set eval.prefill_len=32 --set eval.score_from=32 " +
                                  "--set eval.chunk_size=8 --set model.threads=1 --set eval.out_dir=" + (dir / "shares_eval") + " --set " +
                                  "'eval.layer_budget_shares=[" + listed + "]'", &out, &err), 0) << err;
  EXPECT_NE(test::run_kvbound("inspect " + (dir / "indexmem") + " --text " + cli.valid + " --layer-shares --out " + (dir / "x"), &out, &err), 0);
  EXPECT_NE(err.find("--layer-shares needs TRIM-KV gates"), std::string::npos) << err;
  // The weights say which backbone they were trained on: another one is refused.
  EXPECT_NE(test::run_kvbound("inspect " + (dir / "trimkv") + " --text " + cli.valid + " --model " + test::default_model() +
                                  " --out " + (dir / "x"), &out, &err), 0);
  EXPECT_NE(err.find("but the weights were trained on stories260K"), std::string::npos) << err;
}

}  // namespace
}  // namespace kvbound
