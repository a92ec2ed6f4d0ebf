// `kvbound eval` end to end on stories260K: every policy x budget lands in results.json with the
// documented metric names, the table is printed, plots are written, and config errors name the key.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "test_env.h"

namespace fs = std::filesystem;

namespace {

int run(const std::string& args, std::string* out, std::string* err) {
  return kvbound::test::run_kvbound("eval " + args, out, err);
}

class EvalCli : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = kvbound::test::asset("stories260K");
    text_ = kvbound::test::asset("text/tinystories_valid_first794KB_hf.txt");
    KVBOUND_REQUIRE_FILE(model_ + "/model.safetensors");
    KVBOUND_REQUIRE_FILE(text_);
    dir_ = fs::temp_directory_path() / ("kvbound_eval_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream(dir_ / "eval.yaml") << "model:\n  path: " << model_ << "\n  threads: 1\neval:\n  text: " << text_
                                      << "\n  budgets: [8, 16]\n  context_len: 48\n  prefill_len: 24\n"
                                         "  score_from: 24\n  chunk_size: 8\n  num_windows: 2\n"
                                         "  retrieval:\n    context_len: 256\n    depths: [0.5]\n    samples: 1\n";
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  std::string model_, text_;
  fs::path dir_;
};

TEST_F(EvalCli, WritesEveryPolicyAndBudget) {
  std::string out, err;
  const fs::path results = dir_ / "out";
  ASSERT_EQ(run((dir_ / "eval.yaml").string() + " --set eval.out_dir=" + results.string(), &out, &err), 0) << err;
  std::ifstream in(results / "results.json");
  const auto j = nlohmann::json::parse(in);
  std::map<std::string, int> rows_per_policy;
  for (const auto& row : j["rows"]) {
    ++rows_per_policy[row["policy"].get<std::string>()];
    for (const char* m : {"nll", "kl_to_full", "top1_agree", "retrieval_acc", "prefill_tok_s", "decode_tok_s", "peak_kv_bytes"})
      EXPECT_TRUE(row["metrics"].contains(m)) << row.dump();
    if (row["policy"] == "full") {
      EXPECT_NEAR(row["metrics"]["kl_to_full"].get<double>(), 0.0, 1e-6);
      EXPECT_DOUBLE_EQ(row["metrics"]["top1_agree"].get<double>(), 1.0);
    }
  }
  EXPECT_EQ(rows_per_policy.size(), 8u);
  EXPECT_EQ(rows_per_policy["full"], 1);
  EXPECT_EQ(rows_per_policy["h2o"], 2);
  EXPECT_NE(out.find("| h2o |"), std::string::npos) << out;
  for (const char* f : {"results.md", "config.yaml", "kl_to_full.png", "top1_agree.png", "nll.png", "retrieval_acc.png"})
    EXPECT_TRUE(fs::exists(results / f)) << f;
}

// The oracle through eval's two tasks, which hand it the full model's attention: a row per budget with every
// metric, and closer to the full cache than random eviction at each budget.
TEST_F(EvalCli, OracleRunsBothTasksCloserToTheFullCacheThanRandom) {
  std::string out, err;
  const fs::path results = dir_ / "out";
  ASSERT_EQ(run((dir_ / "eval.yaml").string() + " --set eval.policies=[random,oracle] --set eval.out_dir=" + results.string(),
                &out, &err),
            0)
      << err;
  std::ifstream in(results / "results.json");
  const auto j = nlohmann::json::parse(in);
  std::map<std::string, double> kl;
  for (const auto& row : j["rows"]) {
    EXPECT_TRUE(row["metrics"].contains("retrieval_acc")) << row.dump();
    kl[row["policy"].get<std::string>() + "@" + std::to_string(row["budget"].get<int>())] = row["metrics"]["kl_to_full"].get<double>();
  }
  ASSERT_EQ(kl.size(), 4u);
  for (const char* budget : {"8", "16"})
    EXPECT_LT(kl[std::string("oracle@") + budget], kl[std::string("random@") + budget]) << "M = " << budget;
}

TEST_F(EvalCli, UnknownKeyNamesTheClosestOne) {
  std::string out, err;
  EXPECT_NE(run((dir_ / "eval.yaml").string() + " --set eval.budgts=[8]", &out, &err), 0);
  EXPECT_NE(err.find("eval.budgts: unknown key (did you mean eval.budgets?)"), std::string::npos) << err;
  EXPECT_NE(run((dir_ / "eval.yaml").string() + " --set eval.policies=[h2o,lru]", &out, &err), 0);
  EXPECT_NE(err.find("lru: unknown policy"), std::string::npos) << err;
  EXPECT_NE(run((dir_ / "eval.yaml").string() + " --set eval.policies=[full,h2o,full]", &out, &err), 0);
  EXPECT_NE(err.find("eval.policies: 'full' is listed twice"), std::string::npos) << err;
  EXPECT_NE(run((dir_ / "eval.yaml").string() + " --set eval.budget_scope=global", &out, &err), 0);
  EXPECT_NE(err.find("eval.budget_scope: 'global' (head, layer, model)"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(dir_ / "runs"));
}

// The weights the repository ships (assets/weights/) serve the default model through the quickstart's own
// config: they load (backbone hash, shapes, metadata), run, and keep the cache far closer to the full one than
// random eviction at M = 64 — weights that load but were never trained, or belong to another model, fail here.
TEST(EvalShippedWeights, ServeTheDefaultModelFarBetterThanRandom) {
  KVBOUND_REQUIRE_FILE(kvbound::test::default_model());
  const fs::path out_dir = fs::temp_directory_path() / ("kvbound_shipped_" + std::to_string(::getpid()));
  const fs::path here = fs::current_path();
  fs::current_path(fs::path(KVBOUND_CONFIGS).parent_path());  // the config's paths are the repository's
  std::string out, err;
  const int code = run(std::string(KVBOUND_CONFIGS) + "/eval/quickstart.yaml --set model.path=" +
                           kvbound::test::default_model() +
                           " --set model.threads=1 --set eval.policies=[full,random,trimkv,trimkv+mem,indexmem,indexmem+mem]"
                           " --set eval.budgets=[64] --set eval.tasks=[continuation] --set eval.context_len=200"
                           " --set eval.prefill_len=176 --set eval.score_from=176 --set eval.num_windows=1"
                           " --set eval.out_dir=" + out_dir.string(),
                       &out, &err);
  fs::current_path(here);
  ASSERT_EQ(code, 0) << err;
  std::ifstream in(out_dir / "results.json");
  const auto j = nlohmann::json::parse(in);
  fs::remove_all(out_dir);
  std::map<std::string, double> kl;
  for (const auto& row : j["rows"]) kl[row["policy"].get<std::string>()] = row["metrics"]["kl_to_full"].get<double>();
  ASSERT_EQ(kl.size(), 6u);
  for (const char* learned : {"trimkv", "trimkv+mem", "indexmem", "indexmem+mem"}) {
    EXPECT_TRUE(std::isfinite(kl[learned])) << learned;
    EXPECT_LT(kl[learned], 0.5 * kl["random"]) << learned << " vs random " << kl["random"];
  }
}

}  // namespace
