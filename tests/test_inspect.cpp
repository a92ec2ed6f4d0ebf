// `kvbound inspect`: the head patterns and token lifetimes of a cache timeline (computed here for a synthetic
// sliding window and a window with an attention sink), and the real CLI on freshly trained stories260K TRIM-KV
// gates and an IndexMem indexer: its pictures and its table.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

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
  // The weights say which backbone they were trained on: another one is refused.
  EXPECT_NE(test::run_kvbound("inspect " + (dir / "trimkv") + " --text " + cli.valid + " --model " + test::default_model() +
                                  " --out " + (dir / "x"), &out, &err), 0);
  EXPECT_NE(err.find("but the weights were trained on stories260K"), std::string::npos) << err;
}

}  // namespace
}  // namespace kvbound
