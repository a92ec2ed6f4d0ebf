// IndexMem stage 1: the streaming KL equals its formula, the indexer's score is the pooled op's (window 1)
// and round-trips through an export, the indexmem policy keeps exactly M entries with the recent window in
// place (and equals full when nothing is evicted) with and without pre-eviction, its running statistic is
// the mean / max of the indexer's scores over later queries, and the real CLI trains, exports and evaluates it.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "base/errors.h"
#include "train/run_checkpoint.h"
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
  // Groups of rows (a batched step's layers): each group's own mean.
  const at::Tensor grouped = losses::streaming_kl(a, z.detach(), valid, 2);
  ASSERT_EQ(grouped.sizes(), at::IntArrayRef({2}));
  for (std::int64_t g = 0; g < 2; ++g)
    EXPECT_NEAR(grouped[g].item<double>(),
                losses::streaming_kl(a.narrow(0, g, 1), z.detach().narrow(0, g, 1), valid).item<double>(), 1e-7);
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

// Every layer's W_b (zero at init) drawn from N(0, scale²), in place.
void draw_key_bias(const Indexer& ix, double scale) {
  const at::NoGradGuard no_grad;
  for (auto& [name, t] : ix.named_tensors())
    if (name.size() > 2 && name.substr(name.size() - 2) == "wb") t.normal_(0, scale);
}

// With a key bias the file holds wb per layer and says key_bias in its metadata; the two must agree.
TEST(Indexer, KeyBiasRoundTripsAndMustMatchTheMetadata) {
  const ModelConfig c = small_config();
  IndexerSettings s{8, "kv", true, false, 0.5};
  s.key_bias = true;
  const Indexer ix = Indexer::init(c, s, 11);
  const at::Tensor x = at::randn({2, 6, 24});
  EXPECT_EQ(ix.key_bias(1, x).abs().max().item<double>(), 0.0);  // W_b starts at 0: the plain indexer
  draw_key_bias(ix, 1);
  const at::Tensor b = ix.key_bias(1, x);
  ASSERT_EQ(b.sizes(), at::IntArrayRef({2, 2, 6}));  // [B, Hk, T]
  EXPECT_GT(b.abs().min().item<double>(), 0.0);
  EXPECT_TRUE(at::allclose(ix.key_biases({x.narrow(0, 0, 1), x}).narrow(0, 1, 2), b));  // batched over layers 0, 1

  test::TempDir dir("indexer_key_bias");
  const std::map<std::string, std::string> meta = indexer_metadata(s);
  EXPECT_EQ(meta.at("key_bias"), "true");
  write_safetensors(dir / "ix.safetensors", ix.named_tensors(), meta);
  const SafetensorsFile file = read_safetensors(dir / "ix.safetensors");
  EXPECT_EQ(file.tensors.size(), 2u * 5u);
  const Indexer back = Indexer::from_tensors(file.tensors, c, indexer_settings(file.metadata, "x"), "x");
  EXPECT_TRUE(back.settings().key_bias);
  EXPECT_TRUE(at::equal(back.key_bias(1, x), b));

  auto expect_error = [&](const std::map<std::string, at::Tensor>& tensors, const IndexerSettings& settings) {
    try {
      Indexer::from_tensors(tensors, c, settings, "g.safetensors");
      FAIL() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("g.safetensors: model.layers.0.self_attn.indexer.wb"), std::string::npos)
          << e.what();
    }
  };
  expect_error(file.tensors, IndexerSettings{8, "kv", true, false, 0.5});  // metadata without key_bias
  std::map<std::string, at::Tensor> missing = file.tensors;
  missing.erase("model.layers.0.self_attn.indexer.wb");
  expect_error(missing, s);
}

using test::tiny_model;

std::shared_ptr<const Indexer> random_indexer() {
  static const auto indexer =
      std::make_shared<const Indexer>(Indexer::init(tiny_model().model->config(), {8, "kv", true, false, 0.5}, 3));
  return indexer;
}

// A random indexer with a key bias W_b ~ N(0, scale²) (one key per KV head, or one shared key).
std::shared_ptr<const Indexer> indexer_with_key_bias(const std::string& key_heads, double scale) {
  IndexerSettings s{8, key_heads, true, false, 0.5};
  s.key_bias = true;
  auto ix = std::make_shared<Indexer>(Indexer::init(tiny_model().model->config(), s, 3));
  draw_key_bias(*ix, scale);
  return ix;
}

std::shared_ptr<const Indexer> random_indexer_with_key_bias() {
  static const auto indexer = indexer_with_key_bias("kv", 1);
  return indexer;
}

TrainedModules with_indexer(std::shared_ptr<const Indexer> indexer = random_indexer()) {
  TrainedModules m;
  m.add<Indexer>(std::move(indexer));
  return m;
}

Config indexmem_config(std::int64_t recent, const std::string& stat, bool pre_evict, std::int64_t horizon = 16,
                       double attention_weight = 0) {
  return policy_config({"indexmem.recent=" + std::to_string(recent), "indexmem.stat=" + stat,
                        std::string("indexmem.pre_evict=") + (pre_evict ? "true" : "false"),
                        "indexmem.horizon=" + std::to_string(horizon),
                        "indexmem.attention_weight=" + std::to_string(attention_weight)});
}

// Around the budgeted cache: a pre-evicting policy must have cut the older entries to `budget` (the
// `recent` tokens just before the chunk in every head) before the chunk enters the cache, and hold budget +
// chunk after attention; a post-attention one exactly `budget` (the newest `recent` up to the chunk's end).
struct KeepCheck : AttentionHook {
  BudgetedCache* inner;
  std::int64_t budget, recent;
  bool pre_evict;
  void expect_kept(const KVCache& cache, std::int64_t layer, std::int64_t from, std::int64_t to) {
    const at::Tensor pos = cache.positions(layer);
    for (std::int64_t p = std::max<std::int64_t>(0, from); p <= to; ++p)
      EXPECT_TRUE((pos == p).any(-1).all().item<bool>()) << "position " << p << " evicted by " << to;
  }
  void before_attention(AttentionCall& call, KVCache& cache) override {
    inner->before_attention(call, cache);
    const std::int64_t first = call.positions[0].item<std::int64_t>();
    if (!pre_evict) {
      EXPECT_EQ(cache.size(call.layer), std::min(budget, first));  // cut after the previous chunk
      return;
    }
    EXPECT_EQ(cache.size(call.layer), std::min(budget, first));
    expect_kept(cache, call.layer, first - recent, first - 1);
  }
  void after_attention(AttentionCall& call, KVCache& cache) override {
    inner->after_attention(call, cache);
    const std::int64_t first = call.positions[0].item<std::int64_t>(), newest = call.positions[-1].item<std::int64_t>();
    if (pre_evict) {
      EXPECT_EQ(cache.size(call.layer), std::min(budget, first) + call.q.size(2));
      return;
    }
    EXPECT_EQ(cache.size(call.layer), std::min(budget, newest + 1));
    expect_kept(cache, call.layer, newest - recent + 1, newest);
  }
};

// Prefill in chunks of 5, then decode one token at a time: every step checked by KeepCheck.
at::Tensor run_engine(const std::string& policy_name, std::int64_t budget, const Config& o,
                      std::shared_ptr<const Indexer> indexer = random_indexer()) {
  const test::TinyModel& f = tiny_model();
  auto policy = make_policy(policy_name, o, with_indexer(std::move(indexer)));
  BudgetedCache budgeted(*policy, budget);
  KeepCheck check;
  check.inner = &budgeted;
  check.budget = policy->bounded() ? budget : 1 << 20;
  check.recent = o.get_int("indexmem.recent");
  check.pre_evict = policy->pre_evicts();
  KVCache cache = f.model->make_cache();
  std::vector<at::Tensor> out;
  for (std::int64_t s = 0; s < 30; s += 5) out.push_back(f.model->forward(f.tokens.narrow(1, s, 5), cache, &check));
  for (std::int64_t t = 30; t < 60; ++t) out.push_back(f.model->forward(f.tokens.narrow(1, t, 1), cache, &check));
  return at::cat(out, 1);
}

TEST(IndexMemPolicy, KeepsExactlyTheBudgetWithTheRecentWindowInEveryMode) {
  KVBOUND_REQUIRE_FILE(test::test_data("tiny/llama_tied/logits.f32"));
  const at::NoGradGuard no_grad;
  const at::Tensor full = run_engine("full", 1000, indexmem_config(0, "mean", true));
  for (const bool pre_evict : {true, false}) {
    for (const std::string stat : {"mean", "max"}) {
      for (const double attention_weight : {0.0, 1.0}) {
        SCOPED_TRACE(std::string(pre_evict ? "pre-evict " : "post-attention ") + stat +
                     " attention_weight " + std::to_string(attention_weight));
        const Config o = indexmem_config(8, stat, pre_evict, 16, attention_weight);
        const at::Tensor budgeted = run_engine("indexmem", 12, o);
        EXPECT_GT((budgeted - full).abs().max().item<double>(), 1e-3);
        EXPECT_TRUE(at::equal(run_engine("indexmem", 60, o), full));
        // With a key bias: the same guarantees, and other evictions than without it.
        const at::Tensor biased = run_engine("indexmem", 12, o, random_indexer_with_key_bias());
        EXPECT_GT((biased - budgeted).abs().max().item<double>(), 1e-3);
        EXPECT_TRUE(at::equal(run_engine("indexmem", 60, o, random_indexer_with_key_bias()), full));
      }
    }
  }
}

// Captures layer 0's call of every chunk and, after the last one, the policy's keep-scores.
struct ScoreProbe : AttentionHook {
  EvictionPolicy* policy;
  std::vector<AttentionCall> calls;
  at::Tensor scores;
  void before_attention(AttentionCall& call, KVCache& cache) override {
    if (call.layer != 0 || cache.size(0) == 0 || !policy->pre_evicts()) return;
    PolicyView v{0, &call, &cache, {}};
    policy->observe_before(v);
  }
  void after_attention(AttentionCall& call, KVCache& cache) override {
    if (call.layer != 0) return;
    PolicyView v{0, &call, &cache, {}};
    policy->observe(v);
    calls.push_back(call);
    scores = policy->score(v);
  }
};

// With nothing evicted, each key's statistic is the mean (plain, or decayed by a^(age) with a = 1 − 1/H) or
// the max of I_g[s,t] over every query s >= t (plus the key's b_g[t] where the indexer has a key bias, per KV head
// or shared), the chunks' split (before/after attention) notwithstanding: computed here from whole-sequence scores.
TEST(IndexMemPolicy, RunningStatisticIsThePooledScoreOverEveryLaterQuery) {
  KVBOUND_REQUIRE_FILE(test::test_data("tiny/llama_tied/logits.f32"));
  const at::NoGradGuard no_grad;
  const test::TinyModel& f = tiny_model();
  const std::shared_ptr<const Indexer> shared_key_biased = indexer_with_key_bias("1", 1);
  for (const char* variant : {"plain", "key bias", "shared key bias"}) {
    const bool key_bias = std::string(variant) != "plain";
    for (const bool pre_evict : {true, false}) {
      for (const std::string stat : {"mean", "max", "decayed"}) {
        SCOPED_TRACE(std::string(pre_evict ? "pre-evict " : "post-attention ") + stat + " " + variant);
        const Config o = indexmem_config(0, stat == "max" ? "max" : "mean", pre_evict, stat == "decayed" ? 5 : 0);
        const std::shared_ptr<const Indexer> indexer =
            !key_bias ? random_indexer()
                      : (std::string(variant) == "key bias" ? random_indexer_with_key_bias() : shared_key_biased);
        auto policy = make_policy("indexmem", o, with_indexer(indexer));
        ScoreProbe probe;
        probe.policy = policy.get();
        KVCache cache = f.model->make_cache();
        for (std::int64_t s = 0; s < 24; s += 6) f.model->forward(f.tokens.narrow(1, s, 6), cache, &probe);
        auto whole = [&](auto member) {
          std::vector<at::Tensor> parts;
          for (const AttentionCall& c : probe.calls) parts.push_back(c.*member);
          const int dim = member == &AttentionCall::positions ? 0 : (member == &AttentionCall::normed_input ? 1 : 2);
          return at::cat(parts, dim);
        };
        const at::Tensor x = whole(&AttentionCall::normed_input), q = whole(&AttentionCall::q_pre_rope);
        const at::Tensor pos = whole(&AttentionCall::positions);
        const Indexer& ix = *indexer;
        const std::int64_t hkv = f.model->config().num_kv_heads;
        const at::Tensor keys = ix.key(0, x, pos).expand({-1, hkv, -1, -1});
        const at::Tensor I = ix.score(ix.query(0, q, pos), ix.head_weights(0, x), keys).to(at::kDouble);  // [1, Hkv, S, T]
        const at::Tensor later = (pos.view({-1, 1}) >= pos.view({1, -1})).view({1, 1, 24, 24});
        const double a = stat == "decayed" ? 1.0 - 1.0 / 5 : 1.0;
        const at::Tensor age = at::arange(23, -1, -1, at::kDouble);
        const at::Tensor w = later.to(at::kDouble) * at::pow(a, age).view({1, 1, 24, 1});
        at::Tensor want = stat == "max"
                              ? I.masked_fill(later.logical_not(), -std::numeric_limits<double>::infinity()).amax(2)
                              : (I * w).sum(2) / w.sum(2);
        if (key_bias) want = want + ix.key_bias(0, x).expand({-1, hkv, -1}).to(at::kDouble);
        const at::Tensor got = probe.scores.to(at::kDouble);  // float32 statistics against a float64 reference
        EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-6)) << (got - want).abs().max();
      }
    }
  }
}

// Records every layer's normalised input, chunk by chunk, around the budgeted cache.
struct InputCapture : AttentionHook {
  AttentionHook* inner;
  std::map<std::int64_t, std::vector<at::Tensor>> inputs;
  void before_attention(AttentionCall& call, KVCache& cache) override {
    inputs[call.layer].push_back(call.normed_input);
    inner->before_attention(call, cache);
  }
  void after_attention(AttentionCall& call, KVCache& cache) override { inner->after_attention(call, cache); }
};

// A key bias ~10^4 times the indexer scores ranks the keys by b alone, a score that never changes: however the
// evictions went, the kept older keys must be the top M − R of b among every non-recent key, in every layer and KV
// head. Holds only if each entry's bias follows its key through every cut. Compared by value within 10^-3 of b's
// range: two keys whose b differ by less than the indexer scores (or the rounding of b formed per chunk rather than
// over the whole sequence) may trade places, which a misplaced bias would not explain.
TEST(IndexMemPolicy, KeyBiasFollowsItsKeyThroughEveryEviction) {
  KVBOUND_REQUIRE_FILE(test::test_data("tiny/llama_tied/logits.f32"));
  const at::NoGradGuard no_grad;
  const test::TinyModel& f = tiny_model();
  const std::int64_t budget = 12, recent = 4, hkv = f.model->config().num_kv_heads;
  for (const char* key_heads : {"kv", "1"}) {
    SCOPED_TRACE(key_heads);
    const std::shared_ptr<const Indexer> ix = indexer_with_key_bias(key_heads, 1e4);
    auto policy = make_policy("indexmem", indexmem_config(recent, "mean", true), with_indexer(ix));
    BudgetedCache budgeted(*policy, budget);
    InputCapture capture;
    capture.inner = &budgeted;
    KVCache cache = f.model->make_cache();
    for (std::int64_t s = 0; s < 30; s += 5) f.model->forward(f.tokens.narrow(1, s, 5), cache, &capture);
    for (std::int64_t t = 30; t < 60; ++t) f.model->forward(f.tokens.narrow(1, t, 1), cache, &capture);
    // The last cut came before token 59: it kept 55..58 (recent) and the top M − R of positions 0..54.
    for (const auto& [layer, parts] : capture.inputs) {
      const at::Tensor b = ix->key_bias(layer, at::cat(parts, 1)).expand({-1, hkv, -1});  // [1, Hkv, 60]
      const at::Tensor kept = std::get<0>(cache.positions(layer).sort(-1));                 // [1, Hkv, M + 1]
      const std::int64_t older = budget - recent;
      EXPECT_TRUE(at::equal(kept.narrow(-1, older, recent + 1), at::arange(55, 60, kept.options()).expand({1, hkv, 5})))
          << "layer " << layer << ": kept " << kept;
      const at::Tensor kept_b = std::get<0>(b.gather(-1, kept.narrow(-1, 0, older)).sort(-1));
      const at::Tensor top_b = std::get<0>(std::get<0>(b.narrow(-1, 0, 55).topk(older, -1)).sort(-1));
      const double tol = 1e-3 * (b.max() - b.min()).item<double>();
      EXPECT_TRUE(at::allclose(kept_b, top_b, 0, tol)) << "layer " << layer << ": kept " << kept << " b " << kept_b
                                                       << " top b " << top_b;
    }
  }
}

TEST(IndexMemPolicy, NeedsAnIndexer) {
  try {
    make_policy("indexmem", policy_config(), {});
    FAIL() << "indexmem without an indexer accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("indexmem.weights"), std::string::npos) << e.what();
  }
}

// The real CLI on stories260K: 3 steps of 2 rows of 32 tokens, one thread; export; evaluate.
TEST(IndexMemCli, TrainsExportsAndEvaluates) {
  const auto cli = test::stories260k_cli();
  test::TempDir dir("indexmem_cli");
  std::ofstream(dir / "train.yaml") << test::tiny_train_yaml(cli, "  method: indexmem\n  steps: 3\n",
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
  ASSERT_EQ(test::tiny_eval(cli, dir / "eval", "--set eval.policies=[indexmem,h2o] --set indexmem.weights=" + (dir / "ix.safetensors"),
                            &policies, &err), 0) << err;
  EXPECT_EQ(policies, (std::set<std::string>{"indexmem", "h2o"}));
}

// indexmem.key_bias through the real CLI: W_b starts at 0, so only the loss's gradient through the pooled score
// makes it move; the export carries it and says so, and the policy serves it.
TEST(IndexMemCli, KeyBiasTrainsExportsAndEvaluates) {
  const auto cli = test::stories260k_cli();
  test::TempDir dir("indexmem_key_bias");
  std::ofstream(dir / "train.yaml") << test::tiny_train_yaml(
      cli, "  method: indexmem\n  steps: 3\n",
      "indexmem:\n  d_index: 8\n  window: 8\n  key_bias: true\nrun:\n  out_dir: " + (dir / "run") + "\n");
  std::string out, err;
  ASSERT_EQ(test::run_kvbound("train " + (dir / "train.yaml"), &out, &err), 0) << err;
  ASSERT_EQ(test::run_kvbound("export " + (dir / "run") + " --out " + (dir / "ix.safetensors"), &out, &err), 0) << err;
  const auto ix = read_safetensors(dir / "ix.safetensors");
  EXPECT_EQ(ix.tensors.size(), 5u * 5u);  // 5 layers x (wq, wk, ww, bw, wb)
  EXPECT_EQ(ix.metadata.at("key_bias"), "true");
  for (std::int64_t l = 0; l < 5; ++l) {
    const at::Tensor wb = ix.tensors.at(Indexer::tensor_prefix(l) + "wb");
    EXPECT_GT(wb.abs().max().item<double>(), 0.0) << "layer " << l;
  }
  std::set<std::string> policies;
  ASSERT_EQ(test::tiny_eval(cli, dir / "eval", "--set eval.policies=[indexmem] --set indexmem.weights=" + (dir / "ix.safetensors"),
                            &policies, &err), 0) << err;
  EXPECT_EQ(policies, (std::set<std::string>{"indexmem"}));
}

// Stage 2 from stage 1's run folder (train.init_from): the memory under the frozen indexer, then jointly
// with it (train.method joint: L_KL + lambda_mse · L_MSE, resumable bit for bit); both export, and the joint file serves as
// indexer and memory in eval.
TEST(IndexMemCli, StageTwoStartsFromStageOneFrozenOrJoint) {
  const auto cli = test::stories260k_cli();
  test::TempDir dir("indexmem_stage2");
  const std::string indexer_keys = "indexmem:\n  d_index: 8\n  window: 8\n";
  std::ofstream(dir / "stage1.yaml") << test::tiny_train_yaml(cli, "  method: indexmem\n  steps: 2\n",
                                                              indexer_keys + "run:\n  out_dir: " + (dir / "stage1") + "\n");
  std::string out, err;
  ASSERT_EQ(test::run_kvbound("train " + (dir / "stage1.yaml"), &out, &err), 0) << err;
  const auto stage1 = read_safetensors(latest_checkpoint_path(dir / "stage1"));

  auto stage2_yaml = [&](const std::string& name, const std::string& method) {
    std::ofstream(dir / (name + ".yaml")) << test::tiny_train_yaml(
        cli, "  method: " + method + "\n  steps: 2\n  init_from: " + (dir / "stage1") + "\n",
        indexer_keys + "joint:\n  lambda_mse: 0.5\n  indexer_lr: 1.0e-3\nmemory:\n  dim: 8\n  policy: indexmem\n"
                       "  budgets: [8, 12]\n  chunk: 4\nrun:\n  out_dir: " + (dir / name) + "\n");
    return "train " + (dir / (name + ".yaml"));
  };
  ASSERT_EQ(test::run_kvbound(stage2_yaml("frozen", "memory"), &out, &err), 0) << err;
  for (const auto& j : test::read_jsonl(dir / "frozen/metrics.jsonl")) {
    EXPECT_GT(j["mse"].get<double>(), 0.0) << j.dump();
    EXPECT_FALSE(j.contains("kl")) << j.dump();
  }
  ASSERT_EQ(test::run_kvbound("export " + (dir / "frozen") + " --out " + (dir / "frozen.safetensors"), &out, &err), 0) << err;
  const auto frozen = read_safetensors(dir / "frozen.safetensors");
  EXPECT_EQ(frozen.tensors.size(), 5u * 5u);  // the memory only: the indexer stayed stage 1's
  EXPECT_EQ(frozen.metadata.at("memory_policy"), "indexmem");

  // memory.loss kl: the same memory trained end to end; each step logs the KL per budget, no per-layer MSE.
  ASSERT_EQ(test::run_kvbound(stage2_yaml("frozen_kl", "memory") + " --set memory.loss=kl", &out, &err), 0) << err;
  for (const auto& j : test::read_jsonl(dir / "frozen_kl/metrics.jsonl")) {
    EXPECT_GT(j["kl"].get<double>(), 0.0) << j.dump();
    EXPECT_NEAR(j["kl"].get<double>(), (j["kl_M8"].get<double>() + j["kl_M12"].get<double>()) / 2, 1e-6) << j.dump();
    EXPECT_FALSE(j.contains("mse") || j.contains("mse_per_layer")) << j.dump();
  }
  // Joint's objective is the indexer's KL + lambda · the memory's MSE: an end-to-end memory loss is refused.
  EXPECT_EQ(test::run_kvbound(stage2_yaml("joint_kl", "joint") + " --set memory.loss=kl", &out, &err), 1);
  EXPECT_NE(err.find("config: memory.loss: "), std::string::npos) << err;

  ASSERT_EQ(test::run_kvbound(stage2_yaml("joint", "joint"), &out, &err), 0) << err;
  const auto lines = test::read_jsonl(dir / "joint/metrics.jsonl");
  ASSERT_EQ(lines.size(), 2u);
  for (const auto& j : lines) {
    EXPECT_GT(j["kl"].get<double>(), 0.0) << j.dump();
    EXPECT_GT(j["mse"].get<double>(), 0.0) << j.dump();
    EXPECT_NEAR(j["loss"].get<double>(), j["kl"].get<double>() + 0.5 * j["mse"].get<double>(), 1e-6) << j.dump();
  }
  // Stopped after one update and resumed: the same indexer, memory and AdamW moments, bit for bit.
  ASSERT_EQ(test::run_kvbound(stage2_yaml("joint_resumed", "joint") + " --stop-after 1", &out, &err), 0) << err;
  ASSERT_EQ(test::run_kvbound(stage2_yaml("joint_resumed", "joint") + " --resume", &out, &err), 0) << err;
  const auto straight = read_safetensors(latest_checkpoint_path(dir / "joint"));
  const auto resumed = read_safetensors(latest_checkpoint_path(dir / "joint_resumed"));
  ASSERT_EQ(straight.tensors.size(), resumed.tensors.size());
  for (const auto& [name, t] : straight.tensors) EXPECT_TRUE(at::equal(resumed.tensors.at(name), t)) << name;

  ASSERT_EQ(test::run_kvbound("export " + (dir / "joint") + " --out " + (dir / "joint.safetensors"), &out, &err), 0) << err;
  const auto joint = read_safetensors(dir / "joint.safetensors");
  EXPECT_EQ(joint.tensors.size(), 5u * 4u + 5u * 5u);  // indexer and memory
  EXPECT_EQ(joint.metadata.at("method"), "joint");
  EXPECT_EQ(joint.metadata.at("d_index"), "8");
  EXPECT_DOUBLE_EQ(std::stod(joint.metadata.at("indexer_lr_scale")), 0.5);  // joint.indexer_lr 1e-3 / train.lr 2e-3
  const std::string wk = "model.layers.0.self_attn.indexer.wk";
  EXPECT_FALSE(at::equal(joint.tensors.at(wk), stage1.tensors.at(wk))) << "the joint stage did not train the indexer";

  std::set<std::string> policies;
  const std::string file = dir / "joint.safetensors";
  ASSERT_EQ(test::tiny_eval(cli, dir / "eval", "--set eval.policies=[indexmem+mem,indexmem] --set indexmem.weights=" + file +
                                                    " --set memory.weights_for=[indexmem=" + file + "]", &policies, &err), 0) << err;
  EXPECT_EQ(policies, (std::set<std::string>{"indexmem+mem", "indexmem"}));
  EXPECT_NE(test::tiny_eval(cli, dir / "eval_bad", "--set eval.policies=[h2o+mem] --set memory.weights_for=[h20=" + file + "]",
                            &policies, &err), 0);
  EXPECT_NE(err.find("memory.weights_for"), std::string::npos) << err;

  // A memory serves the policy it was trained under.
  EXPECT_NE(test::tiny_eval(cli, dir / "eval_other", "--set eval.policies=[h2o+mem] --set memory.weights_for=[h2o=" +
                                                         (dir / "frozen.safetensors") + "]", &policies, &err), 0);
  EXPECT_NE(err.find("memory.weights_for: " + (dir / "frozen.safetensors") + ": memory_policy"), std::string::npos) << err;

  // Resuming under other stage-1 weights than the run started from is refused.
  const std::string stage1_file = dir / "stage1.safetensors";
  ASSERT_EQ(test::run_kvbound("export " + (dir / "stage1") + " --out " + stage1_file, &out, &err), 0) << err;
  const std::string moved = stage2_yaml("moved", "memory") + " --set train.init_from=" + stage1_file;
  ASSERT_EQ(test::run_kvbound(moved + " --stop-after 1", &out, &err), 0) << err;
  fs::copy_file(file, stage1_file, fs::copy_options::overwrite_existing);  // another indexer (the joint one)
  EXPECT_NE(test::run_kvbound(moved + " --resume", &out, &err), 0);
  EXPECT_NE(err.find("train.init_from: init_from_config_hash is now"), std::string::npos) << err;

  // What stage 2 needs is named when it is missing or does not fit.
  const std::pair<std::string, std::string> bad[] = {
      {"--set train.init_from=", "train.init_from"},  // a learned base policy without stage 1
      {"--set train.method=joint --set train.init_from=", "train.init_from"},  // joint starts from stage 1 too
      {"--set train.method=indexmem", "train.init_from"},  // init_from is stage 2's
      {"--set train.init_from=" + (dir / "nope"), "train.init_from: " + (dir / "nope")}};
  for (const auto& [sets, key] : bad) {
    EXPECT_NE(test::run_kvbound(stage2_yaml("bad", "memory") + " " + sets, &out, &err), 0) << sets;
    EXPECT_NE(err.find(key), std::string::npos) << sets << ": " << err;
  }
}

}  // namespace
}  // namespace kvbound
