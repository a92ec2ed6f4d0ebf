// Every eviction policy over one shared matrix (kvpress style): the cache never exceeds budget + chunk,
// positions stay sorted, the same seed gives the same logits, and a budget >= the length equals `full`.
// The attention-based policies' scores equal a brute-force reference from the full attention matrix.
#include <ATen/ops/arange.h>
#include <ATen/ops/log.h>
#include <ATen/ops/expm1.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/fmod.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/avg_pool1d.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/triu.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>

#include "base/errors.h"
#include "golden_reader.h"
#include "modules/backbone.h"
#include "modules/budgeted_cache.h"
#include "modules/hindsight_attention.h"
#include "modules/memory_cache.h"
#include "modules/indexer.h"
#include "modules/retention_gate.h"
#include "modules/policies/registry.h"
#include "test_env.h"
#include "tiny_model.h"

using namespace kvbound;

namespace {

using test::tiny_model;

// Checks the invariants after every layer's eviction (the peak, M + C, is checked via peak_entries): the
// cache is back to M after every chunk, or for a pre-evicting policy before every chunk (M + chunk after it).
struct InvariantCheck : AttentionHook {
  AttentionHook* inner;
  std::int64_t budget, chunk;
  bool bounded, pre_evicts;
  void before_attention(AttentionCall& call, KVCache& cache) override {
    inner->before_attention(call, cache);
    if (bounded) EXPECT_LE(cache.size(call.layer), budget);
  }
  void after_attention(AttentionCall& call, KVCache& cache) override {
    inner->after_attention(call, cache);
    if (bounded) EXPECT_LE(cache.size(call.layer), budget + (pre_evicts ? call.q.size(2) : 0));
    const at::Tensor pos = cache.positions(call.layer);
    if (pos.size(-1) > 1) EXPECT_TRUE((pos.narrow(-1, 1, pos.size(-1) - 1) > pos.narrow(-1, 0, pos.size(-1) - 1)).all().item<bool>());
  }
};

// A random latent memory with an open gate (bias 2), so "+mem" changes the output once something is evicted.
std::shared_ptr<const LatentMemory> open_memory() {
  LatentMemorySettings s;
  s.gate_bias_init = 2;
  static const auto memory = std::make_shared<const LatentMemory>(LatentMemory::init(tiny_model().model->config(), s, 4));
  return memory;
}

// A fresh policy of the matrix; the oracle is handed the full model's attention over the tiny model's tokens, the
// last 8 rows scored, as eval's engine would.
std::unique_ptr<EvictionPolicy> matrix_policy(const std::string& name, std::uint64_t seed) {
  auto policy = make_policy(name, policy_config({"snapkv.window=6"}), test::tiny_learned_modules(open_memory()), seed);
  const test::TinyModel& f = tiny_model();
  if (policy->needs_hindsight()) policy->set_hindsight(hindsight_attention(*f.model, f.tokens, f.tokens.size(1) - 8));
  return policy;
}

// Chunked prefill of the first `prefill` tokens, then token-by-token decode; returns every logit.
at::Tensor run_policy(const std::string& name, std::int64_t budget, std::int64_t chunk, std::int64_t prefill,
                      std::uint64_t seed, std::int64_t* peak = nullptr) {
  const test::TinyModel& f = tiny_model();
  auto policy = matrix_policy(name, seed);
  BudgetedHook hook(*policy, budget);  // with the latent memory for "+mem"
  InvariantCheck check;
  check.inner = hook.get();
  check.budget = budget;
  check.chunk = chunk;
  check.bounded = policy->bounded();
  check.pre_evicts = policy->pre_evicts();
  KVCache cache = f.model->make_cache();
  std::vector<at::Tensor> out;
  const std::int64_t T = f.tokens.size(1);
  for (std::int64_t s = 0; s < prefill; s += chunk)
    out.push_back(f.model->forward(f.tokens.narrow(1, s, std::min(chunk, prefill - s)), cache, &check));
  for (std::int64_t t = prefill; t < T; ++t) out.push_back(f.model->forward(f.tokens.narrow(1, t, 1), cache, &check));
  if (peak) *peak = hook.budgeted().peak_entries();
  return at::cat(out, 1);
}

class EveryPolicy : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    KVBOUND_REQUIRE_FILE(test::test_data("tiny/llama_tied/logits.f32"));
  }
};

TEST_P(EveryPolicy, StaysWithinBudgetPlusChunkWithSortedPositions) {
  std::int64_t peak = 0;
  run_policy(GetParam(), 8, 5, 33, 1, &peak);
  if (GetParam() == "full") EXPECT_EQ(peak, 60);
  else EXPECT_EQ(peak, 8 + 5);
}

// eval.budgeted_layers: only the listed layers are cut; the others keep every token while the policy observes them.
TEST_P(EveryPolicy, BudgetedLayersAloneAreCut) {
  const test::TinyModel& f = tiny_model();
  ASSERT_GE(f.model->config().num_layers, 2);
  auto policy = matrix_policy(GetParam(), 1);
  BudgetedHook hook(*policy, 8, 0, {1});
  KVCache cache = f.model->make_cache();
  const std::int64_t T = f.tokens.size(1);
  for (std::int64_t s = 0; s < 33; s += 5) f.model->forward(f.tokens.narrow(1, s, std::min<std::int64_t>(5, 33 - s)), cache, hook.get());
  for (std::int64_t t = 33; t < T; ++t) f.model->forward(f.tokens.narrow(1, t, 1), cache, hook.get());
  EXPECT_EQ(cache.size(0), T);
  if (policy->bounded()) EXPECT_LE(cache.size(1), 8 + (policy->pre_evicts() ? 1 : 0));
  else EXPECT_EQ(cache.size(1), T);
}

// eval.layer_budget_shares: each layer is cut to its own budget (here 4 and 12 alternating).
TEST_P(EveryPolicy, EachLayerIsCutToItsOwnBudget) {
  const test::TinyModel& f = tiny_model();
  const std::int64_t L = f.model->config().num_layers;
  std::vector<std::int64_t> budgets;
  for (std::int64_t l = 0; l < L; ++l) budgets.push_back(l % 2 ? 12 : 4);
  auto policy = matrix_policy(GetParam(), 1);
  BudgetedHook hook(*policy, 8, 0, {}, budgets);
  KVCache cache = f.model->make_cache();
  const std::int64_t T = f.tokens.size(1);
  for (std::int64_t s = 0; s < 33; s += 5) f.model->forward(f.tokens.narrow(1, s, std::min<std::int64_t>(5, 33 - s)), cache, hook.get());
  for (std::int64_t t = 33; t < T; ++t) f.model->forward(f.tokens.narrow(1, t, 1), cache, hook.get());
  for (std::int64_t l = 0; l < L; ++l) {
    const std::int64_t budget = budgets[static_cast<std::size_t>(l)];
    if (!policy->bounded()) EXPECT_EQ(cache.size(l), T) << l;
    else if (policy->pre_evicts()) EXPECT_EQ(cache.size(l), budget + 1) << l;  // cut before the last token's attention
    else EXPECT_EQ(cache.size(l), budget) << l;
  }
}

// Every head's live entries of every layer, in position order (padding slots, wherever a later chunk's append left
// them, skipped); their total.
std::int64_t check_live_entries(const KVCache& cache) {
  std::int64_t total = 0;
  for (std::int64_t l = 0; l < cache.num_layers(); ++l) {
    const at::Tensor pos = cache.positions(l)[0];
    for (std::int64_t h = 0; h < pos.size(0); ++h) {
      const at::Tensor kept = pos[h].masked_select(pos[h] != kPaddingPosition);
      const std::int64_t n = kept.size(0);
      if (n > 1) EXPECT_TRUE((kept.narrow(0, 1, n - 1) > kept.narrow(0, 0, n - 1)).all().item<bool>()) << "layer " << l;
      total += n;
    }
  }
  return total;
}

// eval.budget_scope layer and model: after every chunk each layer's KV heads together hold at most Hkv·M entries
// (layer; a pre-evicting policy Hkv·M plus the chunk) or every head of every layer L·Hkv·M (model), each head's in
// position order; the logits stay finite. A +mem policy is refused with one line, as is the
// model scope for a pre-evicting policy.
TEST_P(EveryPolicy, PooledScopesHoldTheSharedBudget) {
  const test::TinyModel& f = tiny_model();
  const std::int64_t L = f.model->config().num_layers, Hkv = f.model->config().num_kv_heads, M = 6, T = f.tokens.size(1);
  for (const BudgetScope scope : {BudgetScope::Layer, BudgetScope::Model}) {
    auto policy = matrix_policy(GetParam(), 1);
    if (policy->memory() || (scope == BudgetScope::Model && policy->pre_evicts())) {
      EXPECT_THROW(BudgetedHook(*policy, M, 0, {}, {}, scope), kvbound::Error);
      continue;
    }
    BudgetedHook hook(*policy, M, 0, {}, {}, scope);
    KVCache cache = f.model->make_cache();
    std::int64_t seen = 0;
    for (std::int64_t s = 0; s < T; s += s < 30 ? 5 : 1) {
      const std::int64_t chunk = s < 30 ? 5 : 1;
      const at::Tensor logits = f.model->forward(f.tokens.narrow(1, s, chunk), cache, hook.get());
      ASSERT_TRUE(logits.isfinite().all().item<bool>()) << "position " << s;
      seen += chunk;
      const std::int64_t total = check_live_entries(cache);
      if (!policy->bounded()) {
        EXPECT_EQ(total, L * Hkv * seen);
      } else if (scope == BudgetScope::Model) {
        EXPECT_EQ(total, std::min(L * Hkv * M, L * Hkv * seen)) << "position " << s;
      } else {
        for (std::int64_t l = 0; l < L; ++l) {
          const std::int64_t held = cache.live_entries(l).sum().item<std::int64_t>();
          if (policy->pre_evicts()) EXPECT_LE(held, Hkv * (M + chunk)) << "layer " << l << " position " << s;
          else EXPECT_EQ(held, std::min(Hkv * M, Hkv * seen)) << "layer " << l << " position " << s;
        }
      }
    }
  }
}

TEST_P(EveryPolicy, SameSeedSameResult) {
  EXPECT_TRUE(at::equal(run_policy(GetParam(), 8, 4, 20, 7), run_policy(GetParam(), 8, 4, 20, 7)));
}

TEST_P(EveryPolicy, BudgetAtLeastTheLengthEqualsFull) {
  const at::Tensor full = run_policy("full", 1000, 7, 30, 0);
  EXPECT_TRUE(at::equal(run_policy(GetParam(), 60, 7, 30, 3), full));
}

// A bounded policy under a budget far below the length changes the logits; the unbounded one (full) never does.
TEST_P(EveryPolicy, TightBudgetChangesTheOutputOfEveryBoundedPolicy) {
  const at::Tensor full = run_policy("full", 1000, 4, 12, 0);
  const double change = (run_policy(GetParam(), 6, 4, 12, 3) - full).abs().max().item<double>();
  if (make_policy(GetParam(), policy_config(), test::tiny_learned_modules(open_memory()))->bounded())
    EXPECT_GT(change, 1e-3);
  else
    EXPECT_EQ(change, 0);
}

// Every registered policy, and every bounded one with the latent memory attached ("+mem": the unbounded
// reference has nothing to evict into a memory, so full+mem is refused, see MemPolicy tests).
std::vector<std::string> matrix_policies() {
  std::vector<std::string> names = policy_names();
  for (const std::string& name : policy_names())
    if (name != "full") names.push_back(name + "+mem");
  return names;
}

INSTANTIATE_TEST_SUITE_P(Registry, EveryPolicy, ::testing::ValuesIn(matrix_policies()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param;
                           const auto plus = name.find('+');
                           return plus == std::string::npos ? name : name.substr(0, plus) + "_mem";
                         });

// Captures every layer's post-RoPE q and k of one full forward.
struct Capture : AttentionHook {
  std::vector<at::Tensor> q, k;
  void before_attention(AttentionCall& call, KVCache&) override {
    q.push_back(call.q);
    k.push_back(call.k);
  }
};

// Brute force: the full causal attention matrix of layer `layer`, [Hkv, G, T, T].
at::Tensor full_attention(const Capture& c, std::int64_t layer, std::int64_t Hkv) {
  const at::Tensor q = c.q[static_cast<std::size_t>(layer)][0], k = c.k[static_cast<std::size_t>(layer)][0];
  const std::int64_t Hq = q.size(0), T = q.size(1), D = q.size(2), G = Hq / Hkv;
  at::Tensor logits = at::matmul(q.reshape({Hkv, G, T, D}), k.unsqueeze(1).transpose(-1, -2)) / std::sqrt(double(D));
  const at::Tensor future = at::ones({T, T}, at::kBool).triu(1);
  logits = logits.masked_fill(future, -std::numeric_limits<float>::infinity());
  return at::softmax(logits, -1);
}

// Runs `name` with no eviction in chunks of 7 and returns its scores for every layer at the end.
std::vector<at::Tensor> policy_scores(const std::string& name, Capture* capture, const Config& config = policy_config()) {
  const test::TinyModel& f = tiny_model();
  auto policy = make_policy(name, config, test::tiny_learned_modules());
  struct ScoreAtEnd : AttentionHook {
    BudgetedCache* budgeted;
    EvictionPolicy* policy;
    std::vector<at::Tensor> scores;
    void after_attention(AttentionCall& call, KVCache& cache) override {
      budgeted->after_attention(call, cache);
      PolicyView v;
      v.layer = call.layer;
      v.call = &call;
      v.cache = &cache;
      if (policy->needs_attention()) v.probs = chunk_attention_probs(call, cache);
      scores.push_back(policy->score(v)[0]);
    }
  } hook;
  BudgetedCache budgeted(*policy, 1000);
  hook.budgeted = &budgeted;
  hook.policy = policy.get();
  KVCache cache = f.model->make_cache();
  const std::int64_t T = f.tokens.size(1);
  for (std::int64_t s = 0; s < T; s += 7) {
    hook.scores.clear();
    f.model->forward(f.tokens.narrow(1, s, std::min<std::int64_t>(7, T - s)), cache, &hook);
  }
  KVCache full = f.model->make_cache();
  f.model->forward(f.tokens, full, capture);
  return hook.scores;
}

TEST(PolicyScores, H2OIsMeanReceivedAttention) {
  KVBOUND_REQUIRE_FILE(test::test_data("tiny/llama_tied/logits.f32"));
  Capture cap;
  const auto scores = policy_scores("h2o", &cap, policy_config({"h2o.recent=0"}));
  const std::int64_t T = tiny_model().tokens.size(1), Hkv = tiny_model().model->config().num_kv_heads;
  for (std::int64_t l = 0; l < tiny_model().model->config().num_layers; ++l) {
    const at::Tensor A = full_attention(cap, l, Hkv);  // [Hkv, G, T, T]
    const at::Tensor seen = (T - at::arange(T, at::kDouble)) * A.size(1);
    const at::Tensor expected = A.sum({1, 2}).to(at::kDouble) / seen;
    EXPECT_LE((scores[static_cast<std::size_t>(l)] - expected).abs().max().item<double>(), 1e-6) << "layer " << l;
  }
}

TEST(PolicyScores, TovaIsTheLastQueryGroupMean) {
  KVBOUND_REQUIRE_FILE(test::test_data("tiny/llama_tied/logits.f32"));
  Capture cap;
  const auto scores = policy_scores("tova", &cap);
  const std::int64_t T = tiny_model().tokens.size(1), Hkv = tiny_model().model->config().num_kv_heads;
  for (std::int64_t l = 0; l < tiny_model().model->config().num_layers; ++l) {
    const at::Tensor expected = full_attention(cap, l, Hkv).select(2, T - 1).mean(1);
    EXPECT_LE((scores[static_cast<std::size_t>(l)] - expected).abs().max().item<double>(), 1e-6) << "layer " << l;
  }
}

// trimkv.attention_weight α: the gates' keep-score plus α·log of h2o's mean received attention, entry by entry.
TEST(PolicyScores, TrimKVAttentionWeightAddsTheLogOfH2OsStatistic) {
  KVBOUND_REQUIRE_FILE(test::test_data("tiny/llama_tied/logits.f32"));
  Capture unused;
  const auto gates = policy_scores("trimkv", &unused);
  const auto attention = policy_scores("h2o", &unused, policy_config({"h2o.recent=0"}));
  const auto both = policy_scores("trimkv", &unused, policy_config({"trimkv.attention_weight=0.5"}));
  ASSERT_EQ(both.size(), gates.size());
  for (std::size_t l = 0; l < both.size(); ++l) {
    const at::Tensor expected = gates[l] + 0.5 * at::log(attention[l]);
    EXPECT_LE((both[l] - expected).abs().max().item<double>(), 1e-5) << "layer " << l;
  }
  EXPECT_THROW(make_policy("trimkv", policy_config({"trimkv.attention_weight=-1"}), test::tiny_learned_modules()), kvbound::Error);
}

// indexmem.attention_weight α: the running indexer score plus α·log of h2o's mean received attention.
TEST(PolicyScores, IndexMemAttentionWeightAddsTheLogOfH2OsStatistic) {
  KVBOUND_REQUIRE_FILE(test::test_data("tiny/llama_tied/logits.f32"));
  Capture unused;
  // After attention (the test's hook forwards after_attention alone), every entry scored: no recent window.
  const std::vector<std::string> plain = {"indexmem.pre_evict=false", "indexmem.recent=0"};
  std::vector<std::string> weighted = plain;
  weighted.push_back("indexmem.attention_weight=0.5");
  const auto indexer = policy_scores("indexmem", &unused, policy_config(plain));
  const auto attention = policy_scores("h2o", &unused, policy_config({"h2o.recent=0"}));
  const auto both = policy_scores("indexmem", &unused, policy_config(weighted));
  ASSERT_EQ(both.size(), indexer.size());
  for (std::size_t l = 0; l < both.size(); ++l) {
    const at::Tensor expected = indexer[l] + 0.5 * at::log(attention[l]);
    EXPECT_LE((both[l] - expected).abs().max().item<double>(), 1e-5) << "layer " << l;
    EXPECT_GT((both[l] - indexer[l]).abs().max().item<double>(), 0.01) << "layer " << l;
  }
  EXPECT_THROW(make_policy("indexmem", policy_config({"indexmem.attention_weight=-1"}), test::tiny_learned_modules()),
               kvbound::Error);
}

// The oracle against the brute-force attention matrix, at a cut after the chunk of positions 16..20: `scored` is the
// mean over the scored rows (the last 8) and the group's heads, `later` the sum over every query after position 20.
TEST(PolicyScores, OracleRanksByTheFullModelsFutureAttention) {
  KVBOUND_REQUIRE_FILE(test::test_data("tiny/llama_tied/logits.f32"));
  const test::TinyModel& f = tiny_model();
  const std::int64_t T = f.tokens.size(1), Hkv = f.model->config().num_kv_heads, first = T - 8, newest = 20;
  Capture cap;
  KVCache full = f.model->make_cache();
  f.model->forward(f.tokens, full, &cap);
  KVCache cache = f.model->make_cache();
  f.model->forward(f.tokens.narrow(1, 0, newest + 1), cache);
  AttentionCall chunk;
  chunk.start = newest - 4;
  chunk.q = at::zeros({1, cap.q[0].size(1), 5, cap.q[0].size(3)});
  for (const std::string queries : {"scored", "later"}) {
    auto policy = make_policy("oracle", policy_config({"oracle.queries=" + queries}), {});
    policy->set_hindsight(hindsight_attention(*f.model, f.tokens, first));
    for (std::int64_t l = 0; l < f.model->config().num_layers; ++l) {
      const at::Tensor A = full_attention(cap, l, Hkv).mean(1);  // [Hkv, T, T]
      const at::Tensor expected = queries == "scored" ? A.narrow(1, first, T - first).mean(1)
                                                      : A.narrow(1, newest + 1, T - newest - 1).sum(1);
      PolicyView v;
      v.layer = l;
      v.call = &chunk;
      v.cache = &cache;
      const at::Tensor got = policy->score(v)[0];  // [Hkv, newest + 1]
      EXPECT_LE((got - expected.narrow(-1, 0, newest + 1)).abs().max().item<double>(), 1e-6) << queries << " layer " << l;
    }
  }
}

// Anywhere but eval's tasks nothing hands the oracle its hindsight: the first cut says so; a bad key names itself.
TEST(PolicyScores, OracleWithoutHindsightOrWithABadKeyIsOneLineNamingIt) {
  KVBOUND_REQUIRE_FILE(test::test_data("tiny/llama_tied/logits.f32"));
  const test::TinyModel& f = tiny_model();
  auto policy = make_policy("oracle", policy_config(), {});
  BudgetedCache budgeted(*policy, 4);
  KVCache cache = f.model->make_cache();
  try {
    f.model->forward(f.tokens.narrow(1, 0, 10), cache, &budgeted);
    ADD_FAILURE() << "no error";
  } catch (const kvbound::Error& e) {
    EXPECT_NE(std::string(e.what()).find("oracle: ranks by the full model's future attention"), std::string::npos) << e.what();
  }
  try {
    make_policy("oracle", policy_config({"oracle.queries=future"}), {});
    ADD_FAILURE() << "no error";
  } catch (const kvbound::Error& e) {
    EXPECT_NE(std::string(e.what()).find("oracle.queries: must be scored or later, got 'future'"), std::string::npos) << e.what();
  }
}

TEST(PolicyScores, SnapKVIsPooledWindowVotesWithTheWindowKept) {
  KVBOUND_REQUIRE_FILE(test::test_data("tiny/llama_tied/logits.f32"));
  Capture cap;
  const auto scores = policy_scores("snapkv", &cap, policy_config({"snapkv.window=9"}));  // spans two chunks of 7
  const std::int64_t T = tiny_model().tokens.size(1), Hkv = tiny_model().model->config().num_kv_heads;
  for (std::int64_t l = 0; l < tiny_model().model->config().num_layers; ++l) {
    const at::Tensor votes = full_attention(cap, l, Hkv).narrow(2, T - 9, 9).mean({1, 2});  // [Hkv, T]
    const at::Tensor pooled = at::avg_pool1d(votes.unsqueeze(1), {5}, {1}, {2}).squeeze(1);
    const at::Tensor s = scores[static_cast<std::size_t>(l)];
    EXPECT_LE((s.narrow(-1, 0, T - 9) - pooled.narrow(-1, 0, T - 9)).abs().max().item<double>(), 1e-6);
    EXPECT_TRUE(s.narrow(-1, T - 9, 9).isinf().all().item<bool>());
  }
}

// The trimkv options reproduce the official cache's score (trimkv 0.1.5, cache_utils.py), recomputed here in
// float64 from the gates' log β after one 60-token chunk (t = 59): (t + offset − pos)·log β; with lookahead
// n > 1, (a + 1)·log β + log(1 − β^n) − log(1 − β) with a = t + offset − pos; the sliding window's w newest
// entries score +inf.
TEST(PolicyScores, TrimKVOptionsScoreAsTheOfficialCache) {
  KVBOUND_REQUIRE_FILE(test::test_data("tiny/llama_tied/logits.f32"));
  const test::TinyModel& f = tiny_model();
  struct Probe : AttentionHook {
    BudgetedCache* inner = nullptr;
    EvictionPolicy* policy = nullptr;
    std::vector<at::Tensor> x, scores;
    void after_attention(AttentionCall& call, KVCache& cache) override {
      inner->after_attention(call, cache);
      x.push_back(call.normed_input);
      PolicyView v{call.layer, &call, &cache, {}};
      scores.push_back(policy->score(v)[0].to(at::kDouble));
    }
  };
  const TrainedModules modules = test::tiny_learned_modules();
  const auto gates = modules.find<RetentionGates>();
  const auto log1mexp = [](const at::Tensor& x) { return at::log(-at::expm1(x)); };
  struct Case {
    std::int64_t offset, lookahead, window, sinks;
  };
  for (const Case c : {Case{0, 1, 0, 0}, Case{2, 1, 0, 0}, Case{2, 4, 0, 0}, Case{0, 1, 5, 0}, Case{0, 1, 0, 3}}) {
    SCOPED_TRACE("offset " + std::to_string(c.offset) + " lookahead " + std::to_string(c.lookahead) + " window " +
                 std::to_string(c.window) + " sinks " + std::to_string(c.sinks));
    auto policy = make_policy("trimkv",
                              policy_config({"trimkv.score_offset=" + std::to_string(c.offset),
                                             "trimkv.lookahead=" + std::to_string(c.lookahead),
                                             "trimkv.sliding_window=" + std::to_string(c.window),
                                             "trimkv.sinks=" + std::to_string(c.sinks)}),
                              modules);
    BudgetedCache budgeted(*policy, 1000);
    Probe probe;
    probe.inner = &budgeted;
    probe.policy = policy.get();
    KVCache cache = f.model->make_cache();
    f.model->forward(f.tokens, cache, &probe);
    const std::int64_t T = f.tokens.size(1);
    for (std::size_t l = 0; l < probe.scores.size(); ++l) {
      const at::Tensor lb = gates->log_beta(static_cast<std::int64_t>(l), probe.x[l])[0].to(at::kDouble);  // [Hkv, T]
      const at::Tensor age = static_cast<double>(T - 1 + c.offset) - at::arange(T, at::kDouble);
      at::Tensor want = c.lookahead == 1 ? age * lb
                                         : (age + 1) * lb + log1mexp(lb * static_cast<double>(c.lookahead)) - log1mexp(lb);
      if (c.window > 0) want.narrow(-1, T - c.window, c.window).fill_(std::numeric_limits<double>::infinity());
      if (c.sinks > 0) want.narrow(-1, 0, c.sinks).fill_(std::numeric_limits<double>::infinity());
      const at::Tensor got = probe.scores[l];
      EXPECT_TRUE(at::equal(got.isinf(), want.isinf())) << "layer " << l;
      const at::Tensor finite = want.isfinite();
      EXPECT_TRUE(at::allclose(got.masked_select(finite), want.masked_select(finite), 1e-5, 1e-5))
          << "layer " << l << ": " << (got - want).masked_select(finite).abs().max();
    }
  }
}

// trimkv.cut: the official cache cuts a layer that reaches M + buffer entries, kvbound's default one that
// exceeds it; decoding token by token, the cache so peaks at M + buffer or M + buffer + 1 entries.
// trimkv.budget_scope is the scope the eval serves trimkv under by default (eval.budget_scope policy); trimkv+mem
// is served per head, the memory writing what each head evicts; every other policy is served per head.
TEST(PolicyScores, TrimKVBudgetScopeIsItsOwnUnlessItCarriesAMemory) {
  const TrainedModules modules = test::tiny_learned_modules(open_memory());
  EXPECT_EQ(make_policy("trimkv", policy_config(), modules)->budget_scope(), BudgetScope::Head);
  EXPECT_EQ(make_policy("trimkv", policy_config({"trimkv.budget_scope=model"}), modules)->budget_scope(), BudgetScope::Model);
  EXPECT_EQ(make_policy("trimkv", policy_config({"trimkv.budget_scope=layer"}), modules)->budget_scope(), BudgetScope::Layer);
  EXPECT_EQ(make_policy("trimkv+mem", policy_config({"trimkv.budget_scope=model"}), modules)->budget_scope(), BudgetScope::Head);
  EXPECT_EQ(make_policy("h2o", policy_config({"trimkv.budget_scope=model"}), modules)->budget_scope(), BudgetScope::Head);
  EXPECT_THROW(make_policy("trimkv", policy_config({"trimkv.budget_scope=all"}), modules), kvbound::Error);
}

TEST(PolicyScores, TrimKVCutReachesHoldsOneEntryLessThanExceeds) {
  KVBOUND_REQUIRE_FILE(test::test_data("tiny/llama_tied/logits.f32"));
  const test::TinyModel& f = tiny_model();
  for (const auto& [cut, peak] : {std::pair<std::string, std::int64_t>{"exceeds", 8 + 2 + 1}, {"reaches", 8 + 2}}) {
    auto policy = make_policy("trimkv", policy_config({"trimkv.cut=" + cut}), test::tiny_learned_modules());
    BudgetedCache budgeted(*policy, 8, 2);
    KVCache cache = f.model->make_cache();
    for (std::int64_t t = 0; t < 30; ++t) f.model->forward(f.tokens.narrow(1, t, 1), cache, &budgeted);
    EXPECT_EQ(budgeted.peak_entries(), peak) << cut;
    EXPECT_LE(cache.size(0), peak) << cut;
  }
}

}  // namespace

namespace {

// The per-layer budgets of eval.layer_budget_shares: proportional, at least 1 each, L·M in all.
TEST(BudgetedCacheEngine, ApportionBudgetSplitsLTimesMInProportion) {
  EXPECT_EQ(apportion_budget(64, std::vector<double>(30, 0.7)), std::vector<std::int64_t>(30, 64));
  EXPECT_EQ(apportion_budget(8, {1.0, 3.0}), (std::vector<std::int64_t>{1 + 4, 1 + 10}));  // 14 spare split 3.5 : 10.5
  EXPECT_EQ(apportion_budget(2, {1.0, 1000.0, 1.0}), (std::vector<std::int64_t>{1, 4, 1}));
  const std::vector<std::int64_t> b = apportion_budget(100, {0.3, 1.9, 1.1, 0.7});
  EXPECT_EQ(b[0] + b[1] + b[2] + b[3], 400);
  EXPECT_EQ(b, (std::vector<std::int64_t>{1 + 30, 1 + 188, 1 + 109, 1 + 69}));  // 396 spare: 29.7, 188.1, 108.9, 69.3
  EXPECT_THROW(apportion_budget(8, {1.0, 0.0}), kvbound::Error);
  EXPECT_THROW(apportion_budget(8, {1.0, std::nan("")}), kvbound::Error);
}

// A test policy whose scores differ by head and by layer, all distinct: (pos mod 7) + 0.37·head + 0.11·layer + pos/1000.
class ScoredByHeadAndLayer final : public EvictionPolicy {
 public:
  static at::Tensor scores(std::int64_t layer, const at::Tensor& positions) {
    const at::Tensor pos = positions.to(at::kDouble);
    const at::Tensor head = at::arange(positions.size(1), at::kDouble).view({1, -1, 1});
    return (at::fmod(pos, 7) + 0.37 * head + 0.11 * static_cast<double>(layer) + pos / 1000).to(at::kFloat);
  }
  at::Tensor score(const PolicyView& v) override { return scores(v.layer, v.cache->positions(v.layer)); }
};

// The positions each head keeps when the top K scores over `layers`' live entries are kept, [layer][head].
std::vector<std::vector<std::vector<std::int64_t>>> pooled_top(const KVCache& cache, const std::vector<std::int64_t>& layers,
                                                               std::int64_t K) {
  std::vector<std::tuple<float, std::int64_t, std::int64_t, std::int64_t>> entries;  // score, layer, head, position
  for (const std::int64_t l : layers) {
    const at::Tensor pos = cache.positions(l), sc = ScoredByHeadAndLayer::scores(l, pos);
    for (std::int64_t h = 0; h < pos.size(1); ++h)
      for (std::int64_t i = 0; i < pos.size(2); ++i)
        if (pos[0][h][i].item<std::int64_t>() != kPaddingPosition)
          entries.emplace_back(sc[0][h][i].item<float>(), l, h, pos[0][h][i].item<std::int64_t>());
  }
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return std::get<0>(a) > std::get<0>(b); });
  std::vector<std::vector<std::vector<std::int64_t>>> kept(static_cast<std::size_t>(cache.num_layers()));
  for (auto& heads : kept) heads.resize(static_cast<std::size_t>(cache.positions(layers.front()).size(1)));
  for (std::size_t i = 0; i < entries.size() && static_cast<std::int64_t>(i) < K; ++i)
    kept[static_cast<std::size_t>(std::get<1>(entries[i]))][static_cast<std::size_t>(std::get<2>(entries[i]))].push_back(std::get<3>(entries[i]));
  for (auto& heads : kept)
    for (auto& positions : heads) std::sort(positions.begin(), positions.end());
  return kept;
}

std::vector<std::int64_t> live_positions(const KVCache& cache, std::int64_t layer, std::int64_t head) {
  const at::Tensor pos = cache.positions(layer)[0][head];
  std::vector<std::int64_t> out;
  for (std::int64_t i = 0; i < pos.size(0); ++i)
    if (pos[i].item<std::int64_t>() != kPaddingPosition) out.push_back(pos[i].item<std::int64_t>());
  return out;
}

// A pooled cut keeps the top scores over every head it pools (brute force over the live entries just before the cut):
// under `layer` at each layer's cut, Hkv·M over the layer's heads; under `model`, after the last layer's attention,
// L·Hkv·M over every layer's heads. The heads' shares differ, so padding appears.
TEST(BudgetedCacheEngine, PooledCutKeepsTheTopScoresOverThePooledHeads) {
  KVBOUND_REQUIRE_FILE(test::test_data("tiny/llama_tied/logits.f32"));
  const test::TinyModel& f = tiny_model();
  const std::int64_t L = f.model->config().num_layers, Hkv = f.model->config().num_kv_heads, M = 5;
  ASSERT_GE(Hkv, 2);
  for (const BudgetScope scope : {BudgetScope::Layer, BudgetScope::Model}) {
    ScoredByHeadAndLayer policy;
    BudgetedCache budgeted(policy, M, 0, {}, {}, scope);
    struct CheckCut : AttentionHook {
      BudgetedCache* inner;
      BudgetScope scope;
      std::int64_t L, Hkv, M, cuts = 0;
      bool padded = false;
      void after_attention(AttentionCall& call, KVCache& cache) override {
        const bool layer_cut = scope == BudgetScope::Layer && cache.live_entries(call.layer).sum().item<std::int64_t>() > Hkv * M;
        std::int64_t held = 0;
        for (std::int64_t l = 0; l <= call.layer; ++l) held += cache.live_entries(l).sum().item<std::int64_t>();
        const bool model_cut = scope == BudgetScope::Model && call.layer == L - 1 && held > L * Hkv * M;
        std::vector<std::int64_t> pooled;
        if (layer_cut) pooled = {call.layer};
        if (model_cut)
          for (std::int64_t l = 0; l < L; ++l) pooled.push_back(l);
        const auto expected = pooled.empty() ? decltype(pooled_top(cache, {0}, 0)){} : pooled_top(cache, pooled, static_cast<std::int64_t>(pooled.size()) * Hkv * M);
        inner->after_attention(call, cache);
        for (const std::int64_t l : pooled) {
          ++cuts;
          padded = padded || cache.padded(l);
          for (std::int64_t h = 0; h < Hkv; ++h)
            EXPECT_EQ(live_positions(cache, l, h), expected[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)])
                << "layer " << l << " head " << h;
        }
      }
    } check;
    check.inner = &budgeted;
    check.scope = scope;
    check.L = L;
    check.Hkv = Hkv;
    check.M = M;
    KVCache cache = f.model->make_cache();
    for (std::int64_t s = 0; s < 40; s += 4) f.model->forward(f.tokens.narrow(1, s, 4), cache, &check);
    EXPECT_GT(check.cuts, 0);
    EXPECT_TRUE(check.padded);
  }
}

// streaming_llm scores a position alike in every head and layer, so pooling changes nothing: each head keeps the
// newest M as under `head`, and the logits are the head scope's exactly.
TEST(BudgetedCacheEngine, PooledScopeOfAHeadUniformScoreIsTheHeadScope) {
  KVBOUND_REQUIRE_FILE(test::test_data("tiny/llama_tied/logits.f32"));
  const test::TinyModel& f = tiny_model();
  auto logits = [&](BudgetScope scope) {
    auto policy = make_policy("streaming_llm", policy_config(), {});
    BudgetedCache budgeted(*policy, 6, 0, {}, {}, scope);
    KVCache cache = f.model->make_cache();
    std::vector<at::Tensor> out;
    for (std::int64_t s = 0; s < 30; s += 5) out.push_back(f.model->forward(f.tokens.narrow(1, s, 5), cache, &budgeted));
    for (std::int64_t t = 30; t < f.tokens.size(1); ++t) out.push_back(f.model->forward(f.tokens.narrow(1, t, 1), cache, &budgeted));
    return at::cat(out, 1);
  };
  const at::Tensor head = logits(BudgetScope::Head);
  EXPECT_TRUE(at::equal(logits(BudgetScope::Layer), head));
  EXPECT_TRUE(at::equal(logits(BudgetScope::Model), head));
}

TEST(BudgetedCacheEngine, FullThroughTheEngineEqualsOnePlainForwardForAnyChunkSize) {
  KVBOUND_REQUIRE_FILE(test::test_data("tiny/llama_tied/logits.f32"));
  const test::TinyModel& f = tiny_model();
  KVCache plain = f.model->make_cache();
  const at::Tensor expected = f.model->forward(f.tokens, plain);
  for (std::int64_t chunk : {1, 3, 16, 60}) {
    auto policy = make_policy("full", policy_config(), {});
    BudgetedCache budgeted(*policy, 4);
    KVCache cache = f.model->make_cache();
    std::vector<at::Tensor> out;
    for (std::int64_t s = 0; s < f.tokens.size(1); s += chunk)
      out.push_back(f.model->forward(f.tokens.narrow(1, s, std::min(chunk, f.tokens.size(1) - s)), cache, &budgeted));
    EXPECT_LE((at::cat(out, 1) - expected).abs().max().item<double>(), 1e-5) << "chunk " << chunk;
  }
}

}  // namespace
