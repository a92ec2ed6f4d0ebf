// IndexMem stage 1: the streaming KL equals its formula, the indexer's score is the pooled op's (window 1)
// and round-trips through an export, the indexmem policy keeps exactly M entries with the recent window in
// place (and equals full when nothing is evicted), and the real CLI trains, exports and evaluates it.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "checkpoints/errors.h"
#include "checkpoints/safetensors_io.h"
#include "golden_reader.h"
#include "losses/streaming_kl.h"
#include "modules/budgeted_cache.h"
#include "modules/indexer.h"
#include "modules/policies/registry.h"
#include "ops/pooled_index_score.h"
#include "test_env.h"
#include "tiny_model.h"
#include "tiny_cli_runs.h"

namespace kvbound {
namespace {

namespace fs = std::filesystem;

ModelConfig small_config() {
  ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 24;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  return c;
}

TEST(IndexMemLoss, StreamingKLEqualsTheFormula) {
  const std::int64_t B = 2, H = 2, T = 5;
  at::Tensor a = at::randn({B, H, T}).abs();
  a.select(2, T - 1).zero_();  // the invalid key
  a[0][1][2] = 0.0;            // a valid key the teacher ignores: contributes 0
  at::Tensor z = at::randn({B, 1, T});
  z.select(2, T - 1).fill_(-std::numeric_limits<float>::infinity());
  z.set_requires_grad(true);
  const at::Tensor valid = at::arange(T) < T - 1;
  const at::Tensor kl = losses::streaming_kl(a, z, valid);
  double want = 0;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      double sa = 0, sz = 0;
      for (std::int64_t t = 0; t < T - 1; ++t) {
        sa += a[b][h][t].item<double>();
        sz += std::exp(z[b][0][t].item<double>());
      }
      for (std::int64_t t = 0; t < T - 1; ++t) {
        const double p = a[b][h][t].item<double>() / sa, log_q = z[b][0][t].item<double>() - std::log(sz);
        if (p > 0) want += p * (std::log(p) - log_q);
      }
    }
  EXPECT_NEAR(kl.item<double>(), want / (B * H), 1e-5);
  kl.backward();
  EXPECT_TRUE(z.grad().isfinite().all().item<bool>());
  EXPECT_EQ(z.grad().select(2, T - 1).abs().sum().item<double>(), 0.0);
}

// The policy's I_g[s,t] and the training op agree: with a window of one query, z(t) = I_g[T−1, t].
TEST(Indexer, ScoreIsThePooledOpsLastQuery) {
  const ModelConfig c = small_config();
  for (const char* heads : {"kv", "1"}) {
    const Indexer ix = Indexer::init(c, {8, heads, true, std::string(heads) == "1", 0.5}, 5);
    const at::NoGradGuard no_grad;
    const at::Tensor x = at::randn({2, 7, 24}), q = at::randn({2, 4, 7, 8}), pos = at::arange(3, 10);
    const at::Tensor qI = ix.query(1, q, pos), kI = ix.key(1, x, pos), w = ix.head_weights(1, x);
    EXPECT_EQ(kI.size(1), std::string(heads) == "kv" ? 2 : 1);
    const at::Tensor z = ops::pooled_index_score(qI, kI, w, ops::PoolMode::Mean, 1, 0, ix.settings().relu);
    const at::Tensor I = ix.score(qI, w, kI);  // [2, Hk, 7, 7]
    EXPECT_TRUE(at::allclose(I.select(2, 6), z, 1e-5, 1e-6)) << heads;
  }
}

TEST(Indexer, ExportRoundTripGivesIdenticalScores) {
  ModelConfig c = small_config();
  const IndexerSettings s{8, "kv", true, false, 0.5};
  const Indexer ix = Indexer::init(c, s, 11);
  test::TempDir dir("indexer");
  write_safetensors(dir / "ix.safetensors", ix.named_tensors(), indexer_metadata(s));
  const SafetensorsFile file = read_safetensors(dir / "ix.safetensors");
  const Indexer back = Indexer::from_tensors(file.tensors, c, indexer_settings(file.metadata, "x"), "x");
  EXPECT_EQ(ix.named_tensors().size(), 2u * 4u);
  EXPECT_EQ(ix.named_tensors().count("model.layers.1.self_attn.indexer.bw"), 1u);
  const at::Tensor x = at::randn({2, 6, 24}), q = at::randn({2, 4, 6, 8}), pos = at::arange(6);
  for (std::int64_t l = 0; l < 2; ++l)
    EXPECT_TRUE(at::equal(ix.score(ix.query(l, q, pos), ix.head_weights(l, x), ix.key(l, x, pos)),
                          back.score(back.query(l, q, pos), back.head_weights(l, x), back.key(l, x, pos))));
  c.num_kv_heads = 4;  // another model: the error names the file and the tensor
  try {
    Indexer::from_tensors(file.tensors, c, s, "g.safetensors");
    FAIL() << "shape mismatch accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("g.safetensors: model.layers.0.self_attn.indexer.wk"), std::string::npos) << e.what();
  }
}

using test::tiny_model;

// After every layer's eviction: exactly `budget` entries once the layer has seen more, the newest `recent`
// positions in every head.
struct KeepCheck : AttentionHook {
  BudgetedCache* inner;
  std::int64_t budget, recent;
  void after_attention(AttentionCall& call, KVCache& cache) override {
    inner->after_attention(call, cache);
    const std::int64_t newest = call.positions[-1].item<std::int64_t>();
    EXPECT_EQ(cache.size(call.layer), std::min(budget, newest + 1));
    const at::Tensor pos = cache.positions(call.layer);
    for (std::int64_t p = std::max<std::int64_t>(0, newest - recent + 1); p <= newest; ++p)
      EXPECT_TRUE((pos == p).any(-1).all().item<bool>()) << "position " << p << " evicted at " << newest;
  }
};

at::Tensor run_engine(const std::string& policy_name, std::int64_t budget, std::int64_t recent) {
  const test::TinyModel& f = tiny_model();
  PolicyOptions o;
  o.indexer = std::make_shared<const Indexer>(Indexer::init(f.model->config(), {8, "kv", true, false, 0.5}, 3));
  o.indexmem_recent = recent;
  auto policy = make_policy(policy_name, o);
  BudgetedCache budgeted(*policy, budget);
  KeepCheck check;
  check.inner = &budgeted;
  check.budget = policy->bounded() ? budget : 1 << 20;
  check.recent = recent;
  KVCache cache = f.model->make_cache();
  std::vector<at::Tensor> out;
  for (std::int64_t s = 0; s < 30; s += 5) out.push_back(f.model->forward(f.tokens.narrow(1, s, 5), cache, &check));
  for (std::int64_t t = 30; t < 60; ++t) out.push_back(f.model->forward(f.tokens.narrow(1, t, 1), cache, &check));
  return at::cat(out, 1);
}

TEST(IndexMemPolicy, KeepsExactlyTheBudgetWithTheRecentWindow) {
  KVBOUND_REQUIRE_FILE(test::test_data("tiny/llama_tied/logits.f32"));
  const at::NoGradGuard no_grad;
  const at::Tensor full = run_engine("full", 1000, 0);
  EXPECT_GT((run_engine("indexmem", 12, 8) - full).abs().max().item<double>(), 1e-3);
  EXPECT_TRUE(at::equal(run_engine("indexmem", 60, 8), full));
}

TEST(IndexMemPolicy, NeedsAnIndexer) {
  try {
    make_policy("indexmem", PolicyOptions{});
    FAIL() << "indexmem without an indexer accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("indexmem.weights"), std::string::npos) << e.what();
  }
}

// The real CLI on stories260K: 3 steps of 2 rows of 32 tokens, one thread; export; evaluate.
TEST(IndexMemCli, TrainsExportsAndEvaluates) {
  const auto cli = test::stories260k_cli();
  if (!cli) GTEST_SKIP() << "missing " << test::shared_data("stories260K");
  test::TempDir dir("indexmem_cli");
  std::ofstream(dir / "train.yaml") << test::tiny_train_yaml(*cli, "  method: indexmem\n  steps: 3\n",
                                                             "indexmem:\n  d_index: 8\n  window: 8\nrun:\n  out_dir: " +
                                                                 (dir / "run") + "\n");
  std::string out, err;
  ASSERT_EQ(test::run_kvbound("train " + (dir / "train.yaml"), &out, &err), 0) << err;
  const auto lines = test::read_jsonl(dir / "run/metrics.jsonl");
  ASSERT_EQ(lines.size(), 3u);
  for (const auto& j : lines) {
    EXPECT_TRUE(std::isfinite(j["loss"].get<double>())) << j.dump();
    EXPECT_GT(j["kl"].get<double>(), 0.0) << j.dump();
    EXPECT_EQ(j["kl_per_layer"].size(), 5u) << j.dump();
  }

  ASSERT_EQ(test::run_kvbound("export " + (dir / "run") + " --out " + (dir / "ix.safetensors"), &out, &err), 0) << err;
  const auto ix = read_safetensors(dir / "ix.safetensors");
  EXPECT_EQ(ix.tensors.size(), 5u * 4u);  // 5 layers x (wq, wk, ww, bw)
  EXPECT_EQ(ix.tensors.count("model.layers.4.self_attn.indexer.wk"), 1u);
  EXPECT_EQ(ix.metadata.at("method"), "indexmem");
  EXPECT_EQ(ix.metadata.at("d_index"), "8");
  EXPECT_EQ(ix.metadata.at("key_heads"), "kv");
  EXPECT_EQ(ix.metadata.at("window"), "8");

  std::set<std::string> policies;
  ASSERT_EQ(test::tiny_eval(*cli, dir / "eval", "--set eval.policies=[indexmem,h2o] --set indexmem.weights=" + (dir / "ix.safetensors"),
                            &policies, &err), 0) << err;
  EXPECT_EQ(policies, (std::set<std::string>{"indexmem", "h2o"}));
}

}  // namespace
}  // namespace kvbound
