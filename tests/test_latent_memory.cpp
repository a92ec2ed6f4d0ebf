// The latent memory (modules/latent_memory) and "<policy>+mem" (modules/memory_cache): batched writes
// equal the one-token recurrence, the hook writes every evicted token exactly once, a closed gate or an
// unbounded budget leaves the base policy's output untouched, the named tensors round-trip through
// safetensors, "+mem" without weights is an error, and `kvbound train` trains and exports the memory.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/elu.h>
#include <ATen/ops/full.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/log.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/errors.h"
#include "checkpoints/safetensors_io.h"
#include "golden_reader.h"
#include "losses/distillation.h"
#include "modules/backbone.h"
#include "modules/indexer.h"
#include "modules/latent_memory.h"
#include "modules/memory_cache.h"
#include "modules/policies/registry.h"
#include "modules/retention_gate.h"
#include "test_env.h"
#include "tiny_model.h"
#include "tiny_cli_runs.h"
#include "train/memory_method.h"

using namespace kvbound;

namespace {

using test::tiny_model;

// A memory whose gate bias is `cg` everywhere (open: +4, closed: −1e4), everything else from init.
std::shared_ptr<const LatentMemory> memory_with_gate_bias(double cg, MemoryRead read = MemoryRead::Add) {
  const ModelConfig& c = tiny_model().model->config();
  std::map<std::string, at::Tensor> t = LatentMemory::init(c, {}, 5).named_tensors();
  for (auto& [name, tensor] : t)
    if (name.size() > 2 && name.substr(name.size() - 2) == "cg") tensor = at::full_like(tensor, cg);
  return std::make_shared<const LatentMemory>(LatentMemory::from_tensors(t, c, read, "test"));
}

// The whole sequence as one training row: each position's target is the next token; the last has none (no weight).
Batch next_token_batch(const at::Tensor& tokens) {
  const std::int64_t T = tokens.size(1);
  Batch batch;
  batch.inputs = tokens;
  batch.targets = at::cat({tokens.narrow(1, 1, T - 1), at::full({1, 1}, -1, tokens.options())}, 1);
  batch.weights = at::ones({1, T});
  batch.weights.narrow(1, T - 1, 1).zero_();
  return batch;
}

// Chunked prefill of `prefill` tokens, then token-by-token decode, through the engine's hook; every logit.
at::Tensor run(const std::string& name, std::int64_t budget, std::int64_t chunk, std::int64_t prefill,
               std::shared_ptr<const LatentMemory> memory) {
  // As `kvbound eval` runs it: without autograd (the memory's trainable weights would otherwise make every later
  // activation carry a gradient, and the backbone take its differentiable paths).
  const at::NoGradGuard no_grad;
  const test::TinyModel& f = tiny_model();
  auto policy = make_policy(name, policy_config({"snapkv.window=6"}), test::tiny_learned_modules(std::move(memory)), 3);
  BudgetedHook hook(*policy, budget);
  KVCache cache = f.model->make_cache();
  std::vector<at::Tensor> out;
  for (std::int64_t s = 0; s < prefill; s += chunk)
    out.push_back(f.model->forward(f.tokens.narrow(1, s, std::min(chunk, prefill - s)), cache, hook.get()));
  for (std::int64_t t = prefill; t < f.tokens.size(1); ++t)
    out.push_back(f.model->forward(f.tokens.narrow(1, t, 1), cache, hook.get()));
  return at::cat(out, 1);
}

// One layer, 4 query heads over 2 KV heads of size 8: the smallest shape where GQA grouping can go wrong.
ModelConfig one_layer_gqa() {
  ModelConfig c;
  c.num_layers = 1;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  return c;
}

class MemPolicy : public ::testing::Test {
 protected:
  void SetUp() override { KVBOUND_REQUIRE_FILE(test::test_data("tiny/llama_tied/logits.f32")); }
};

}  // namespace

TEST(LatentMemory, BatchedWritesEqualTheOneTokenRecurrence) {
  const ModelConfig c = one_layer_gqa();
  LatentMemorySettings s;
  s.dim = 5;
  s.decay_init = 0.8;  // far from 1, so a wrong power of λ shows
  const LatentMemory memory = LatentMemory::init(c, s, 1);
  const auto t = memory.named_tensors();
  const at::Tensor wk = t.at(LatentMemory::tensor_prefix(0) + "wk"), theta = t.at(LatentMemory::tensor_prefix(0) + "theta");
  const at::Tensor k = at::randn({3, 2, 7, 8}), v = at::randn({3, 2, 7, 8});

  // The definition, token by token: Mem ← λ·Mem + k̂_i v_iᵀ, z ← λ·z + k̂_i.
  const at::Tensor lambda = at::sigmoid(theta).view({1, 2, 1, 1});
  at::Tensor mem = at::zeros({3, 2, 5, 8}), z = at::zeros({3, 2, 5, 1});
  for (std::int64_t i = 0; i < 7; ++i) {
    const at::Tensor khat = at::elu(at::matmul(k.narrow(2, i, 1), wk.transpose(-1, -2))) + 1;  // [3, 2, 1, 5]
    mem = lambda * mem + at::matmul(khat.transpose(-1, -2), v.narrow(2, i, 1));
    z = lambda * z + khat.transpose(-1, -2);
  }
  MemoryState one(1), split(1), whole(1);
  for (std::int64_t i = 0; i < 7; ++i) memory.write(0, one, k.narrow(2, i, 1), v.narrow(2, i, 1));
  memory.write(0, split, k.narrow(2, 0, 3), v.narrow(2, 0, 3));
  memory.write(0, split, k.narrow(2, 3, 4), v.narrow(2, 3, 4));
  memory.write(0, whole, k, v);
  for (const MemoryState* st : {&one, &split, &whole}) {
    EXPECT_TRUE(at::allclose(st->layer(0).mem, mem, 1e-5, 1e-5));
    EXPECT_TRUE(at::allclose(st->layer(0).z, z.squeeze(-1), 1e-5, 1e-5));
  }
  // An empty memory leaves the attention output as it is; a written one changes it.
  const at::Tensor q = at::randn({3, 4, 6, 8}), attention = at::randn({3, 4, 6, 8}), lse = at::randn({3, 4, 6, 1});
  EXPECT_TRUE(at::equal(memory.mix(0, MemoryState(1), q, attention, lse), attention));
  EXPECT_GT((memory.mix(0, whole, q, attention, lse) - attention).abs().max().item<double>(), 0);
}

// A slot read is attention over one more entry beside the retained keys: value m(q), logit
// s_m(q) = log(q̂·z / d_m) + w_g·q_pre + c_g. The reference builds that softmax head by head from the
// definitions; the engine's path mixes it into the attention output with the chunk's logsumexp.
TEST(LatentMemory, SlotMixIsTheSoftmaxOverTheRetainedKeysPlusTheMemorySlot) {
  const ModelConfig c = one_layer_gqa();
  LatentMemorySettings s;
  s.read = MemoryRead::Slot;
  s.dim = 5;
  s.gate_std = 0.5;
  s.gate_bias_init = 0.3;
  const LatentMemory memory = LatentMemory::init(c, s, 3);
  const auto t = memory.named_tensors();
  auto tensor = [&](const std::string& n) { return t.at(LatentMemory::tensor_prefix(0) + n).detach(); };
  MemoryState state(1);
  memory.write(0, state, at::randn({2, 2, 6, 8}), at::randn({2, 2, 6, 8}));
  // 4 retained entries, then a chunk of 3 queries whose own keys close the cache.
  const at::Tensor q = at::randn({2, 4, 3, 8}), q_pre = at::randn({2, 4, 3, 8});
  const at::Tensor keys = at::randn({2, 2, 7, 8}), values = at::randn({2, 2, 7, 8});
  std::vector<at::Tensor> attention, lse, want;
  for (std::int64_t h = 0; h < 4; ++h) {
    const std::int64_t g = h / 2;
    at::Tensor logits = at::matmul(q.select(1, h), keys.select(1, g).transpose(-1, -2)) / std::sqrt(8.0);  // [2, 3, 7]
    for (std::int64_t i = 0; i < 3; ++i)
      for (std::int64_t j = 4 + i + 1; j < 7; ++j) logits.select(1, i).select(1, j).fill_(-INFINITY);
    attention.push_back(at::matmul(at::softmax(logits, -1), values.select(1, g)));
    lse.push_back(at::logsumexp(logits, -1, true));
    const at::Tensor qhat = at::elu(at::matmul(q_pre.select(1, h), tensor("wq").select(0, g).transpose(0, 1))) + 1;  // [2, 3, 5]
    const at::Tensor z = state.layer(0).z.select(1, g).unsqueeze(-1);                                               // [2, 5, 1]
    const at::Tensor den = at::matmul(qhat, z) + LatentMemory::kEpsilon;                                            // [2, 3, 1]
    const at::Tensor m = at::matmul(qhat, state.layer(0).mem.select(1, g)) / den;                                  // [2, 3, 8]
    const at::Tensor slot = at::log(den / 5.0) + at::matmul(q_pre.select(1, h), tensor("wg").select(0, h).unsqueeze(-1)) +
                            tensor("cg").select(0, h);
    const at::Tensor p = at::softmax(at::cat({logits, slot}, -1), -1);
    want.push_back(at::matmul(p.narrow(-1, 0, 7), values.select(1, g)) + p.narrow(-1, 7, 1) * m);
  }
  const at::Tensor got = memory.mix(0, state, q_pre, at::stack(attention, 1), at::stack(lse, 1));
  EXPECT_TRUE(at::allclose(got, at::stack(want, 1), 1e-5, 1e-5)) << (got - at::stack(want, 1)).abs().max();
  EXPECT_THROW(memory.mix(0, state, q_pre, at::stack(attention, 1), {}), c10::Error);  // slot needs the logsumexp
}

TEST(LatentMemory, EvictedIndexIsTheSortedComplementOfKeep) {
  const at::Tensor keep = at::tensor(std::vector<std::int64_t>{0, 3, 4, 1, 2, 5}).view({1, 2, 3});
  const at::Tensor want = at::tensor(std::vector<std::int64_t>{1, 2, 5, 0, 3, 4}).view({1, 2, 3});
  EXPECT_TRUE(at::equal(evicted_index(keep, 6), want));
}

TEST_F(MemPolicy, NamedTensorsRoundTripThroughSafetensors) {
  const ModelConfig& c = tiny_model().model->config();
  const LatentMemory memory = LatentMemory::init(c, {}, 2);
  const test::TempDir dir("latent_memory");
  const std::map<std::string, at::Tensor> written = memory.named_tensors();
  EXPECT_EQ(written.size(), static_cast<std::size_t>(5 * c.num_layers));
  EXPECT_TRUE(written.count("model.layers.0.self_attn.latent_memory.wk"));
  write_safetensors(dir / "memory.safetensors", written);
  const auto read =
      LatentMemory::from_tensors(read_safetensors(dir / "memory.safetensors").tensors, c, MemoryRead::Add, "file").named_tensors();
  ASSERT_EQ(read.size(), written.size());
  for (const auto& [name, t] : written) EXPECT_TRUE(at::equal(read.at(name), t.detach())) << name;
  EXPECT_EQ(LatentMemory::from_tensors(read, c, MemoryRead::Slot, "file").dim(), 16);

  std::map<std::string, at::Tensor> broken = written;
  broken.erase("model.layers.1.self_attn.latent_memory.wg");
  try {
    LatentMemory::from_tensors(broken, c, MemoryRead::Add, "file");
    FAIL() << "a missing tensor must be an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("file: model.layers.1.self_attn.latent_memory.wg"), std::string::npos) << e.what();
  }
}

TEST_F(MemPolicy, PlusMemWithoutWeightsFailsNamingMemoryWeights) {
  const Config config = policy_config();
  try {
    make_policy("h2o+mem", config, {});
    FAIL() << "h2o+mem without memory weights must be an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("memory.weights"), std::string::npos) << e.what();
  }
  TrainedModules m;
  m.add<LatentMemory>(memory_with_gate_bias(0));
  EXPECT_THROW(make_policy("nope+mem", config, m), Error);
  EXPECT_THROW(make_policy("full+mem", config, m), Error);  // nothing is ever evicted into it
  EXPECT_TRUE(make_policy("h2o+mem", config, m)->memory());
  EXPECT_FALSE(make_policy("h2o", config, m)->memory());
}

// A memory added for one policy (memory.weights_for: the one trained under it) serves that policy only; the
// others take the memory added for any policy (memory.weights).
TEST_F(MemPolicy, AMemoryForOnePolicyOverridesTheDefaultForThatPolicyOnly) {
  const Config config = policy_config();
  TrainedModules m;
  const auto own = memory_with_gate_bias(1);
  m.add<LatentMemory>(own, "snapkv");
  EXPECT_EQ(make_policy("snapkv+mem", config, m)->memory(), own);
  EXPECT_THROW(make_policy("h2o+mem", config, m), Error);  // no default memory
  const auto any = memory_with_gate_bias(0);
  m.add<LatentMemory>(any);
  EXPECT_EQ(make_policy("h2o+mem", config, m)->memory(), any);
  EXPECT_EQ(make_policy("snapkv+mem", config, m)->memory(), own);
}

TEST_F(MemPolicy, ClosedGateEqualsTheBasePolicyAndAnOpenOneChangesIt) {
  const at::Tensor h2o = run("h2o", 8, 5, 33, nullptr);
  for (const MemoryRead read : {MemoryRead::Add, MemoryRead::Slot}) {
    SCOPED_TRACE(memory_read_name(read));
    EXPECT_TRUE(at::equal(run("h2o+mem", 8, 5, 33, memory_with_gate_bias(-1e4, read)), h2o));
    EXPECT_GT((run("h2o+mem", 8, 5, 33, memory_with_gate_bias(4, read)) - h2o).abs().max().item<double>(), 1e-3);
  }
}

TEST_F(MemPolicy, BudgetAtLeastTheLengthEqualsFullForEveryPolicy) {
  const at::Tensor full = run("full", 1000, 7, 30, nullptr);
  for (const std::string& name : policy_names())
    if (name != "full") EXPECT_TRUE(at::equal(run(name + "+mem", 60, 7, 30, memory_with_gate_bias(4)), full)) << name;
}

TEST_F(MemPolicy, TheHookWritesEveryEvictedTokenExactlyOnce) {
  // λ = 1 (θ = 40) and W_mk = 0 make k̂ = 1 for every token, so z counts the tokens written.
  const test::TinyModel& f = tiny_model();
  const ModelConfig& c = f.model->config();
  std::map<std::string, at::Tensor> t = LatentMemory::init(c, {}, 5).named_tensors();
  for (auto& [name, tensor] : t) {
    if (name.substr(name.size() - 2) == "wk") tensor = at::zeros_like(tensor);
    if (name.substr(name.size() - 5) == "theta") tensor = at::full_like(tensor, 40.0);
  }
  auto policy = make_policy("h2o", policy_config(), {});
  BudgetedCache budgeted(*policy, 8);
  MemoryAugmentedCache hook(budgeted,
                            std::make_shared<const LatentMemory>(LatentMemory::from_tensors(t, c, MemoryRead::Add, "test")));
  KVCache cache = f.model->make_cache();
  for (std::int64_t s = 0; s < 33; s += 5) f.model->forward(f.tokens.narrow(1, s, std::min<std::int64_t>(5, 33 - s)), cache, &hook);
  for (std::int64_t l = 0; l < c.num_layers; ++l) {
    const at::Tensor z = hook.state().layer(l).z;
    EXPECT_TRUE(at::equal(z, at::full_like(z, static_cast<double>(33 - cache.size(l))))) << "layer " << l;
  }
}

TEST_F(MemPolicy, TrainingLossReachesEveryMemoryParameter) {
  const test::TinyModel& f = tiny_model();
  for (const MemoryRead read : {MemoryRead::Add, MemoryRead::Slot}) {
    SCOPED_TRACE(memory_read_name(read));
    MemorySettings s;
    s.memory.read = read;
    s.memory.dim = 4;
    s.budgets = {8, 12};
    s.chunk = 5;
    MemoryMethod method(*f.model, s, 1);
    Batch batch;
    batch.inputs = f.tokens;
    batch.weights = at::ones({1, f.tokens.size(1)});
    const StepLoss loss = method.loss(batch);
    EXPECT_GT(loss.total.item<double>(), 0);
    EXPECT_EQ(loss.per_layer.size(), static_cast<std::size_t>(f.model->config().num_layers));
    loss.total.backward();
    for (const auto& [name, p] : method.named_parameters()) {
      ASSERT_TRUE(p.grad().defined()) << name;
      EXPECT_GT(p.grad().abs().max().item<double>(), 0) << name;
    }
    EXPECT_TRUE(method.eval_policy()->memory());  // the periodic eval runs h2o+mem
    EXPECT_EQ(method.metadata().at("memory_read"), memory_read_name(read));
  }
}

// memory.loss kl is the engine's own budgeted forward, scored where the memory can matter: at each budget,
// KL(full model || the "+mem" policy's chunked forward) over the positions of the chunks after the first
// eviction, averaged over budgets — computed here apart, with full vocabulary logits — and its gradient
// reaches every memory parameter (layer 0's through the layers above it).
TEST_F(MemPolicy, EndToEndKlLossIsTheEnginesForwardScoredAfterTheFirstEviction) {
  const test::TinyModel& f = tiny_model();
  const std::int64_t T = f.tokens.size(1);
  for (const std::string& policy_name : {"h2o", "indexmem"}) {  // evicting after attention, and before it
    SCOPED_TRACE(policy_name);
    MemorySettings s;
    s.memory.read = MemoryRead::Slot;
    s.memory.dim = 4;
    s.loss = MemoryLoss::Kl;
    s.loss_block_rows = 7;  // blocks that do not divide the rows
    s.policy = policy_name;
    s.base_modules = test::tiny_learned_modules();
    s.budgets = {8, 20};
    s.chunk = 5;
    MemoryMethod method(*f.model, s, 1);
    const Batch batch = next_token_batch(f.tokens);
    const StepLoss loss = method.loss(batch);

    // The same KL apart from a separate no-grad engine run: through the blocked loss itself (the same float32
    // arithmetic on the same hidden states) and through full [B, T, V] logits in float64.
    double same_formula = 0, float64 = 0;
    {
      const at::NoGradGuard no_grad;
      KVCache full_cache = f.model->make_cache();
      const at::Tensor teacher = f.model->forward_hidden(f.tokens, full_cache);
      for (std::int64_t budget : s.budgets) {
        auto policy = method.eval_policy();
        BudgetedHook hook(*policy, budget);
        KVCache cache = f.model->make_cache();
        std::vector<at::Tensor> hidden;
        std::int64_t first_scored = -1;
        for (std::int64_t t = 0; t < T; t += 5) {
          const std::int64_t before = hook.budgeted().evictions();
          hidden.push_back(f.model->forward_hidden(f.tokens.narrow(1, t, 5), cache, hook.get()));
          const bool scored = before > 0 || (policy->pre_evicts() && hook.budgeted().evictions() > before);
          if (scored && first_scored < 0) first_scored = t;
        }
        ASSERT_GT(first_scored, 0);
        const at::Tensor w = batch.weights.clone();  // positions from the first scored chunk on
        w.narrow(1, 0, first_scored).zero_();
        const at::Tensor student = at::cat(hidden, 1), head = f.model->lm_head();
        const double n = static_cast<double>(s.budgets.size());
        same_formula += losses::distillation_loss(student, teacher, head, batch.targets, w, 7).kl.item<double>() / n;
        const at::Tensor log_p = at::log_softmax(at::matmul(teacher.to(at::kDouble), head.to(at::kDouble).t()), -1);
        const at::Tensor log_q = at::log_softmax(at::matmul(student.to(at::kDouble), head.to(at::kDouble).t()), -1);
        const at::Tensor kl = (log_p.exp() * (log_p - log_q)).sum(-1);  // [B, T]
        float64 += ((kl * w.to(at::kDouble)).sum() / w.sum()).item<double>() / n;
      }
    }
    EXPECT_GT(float64, 0);
    // The KL here is ~1e-5, a difference of nearly equal float32 log-probabilities: the grad path's attention
    // (SDPA with autograd, the logsumexp formed apart) rounds differently from the no-grad run, by ~1e-9 absolute
    // on one CPU and 4e-8 (0.23 %) on an AVX2-only one. A wrong mask or budget average moves it by whole chunks'
    // shares (> 10 %).
    EXPECT_NEAR(loss.total.item<double>(), same_formula, 1e-2 * same_formula);
    EXPECT_NEAR(loss.total.item<double>(), float64, 1e-2 * float64);
    EXPECT_TRUE(loss.stats.count("kl_M8") && loss.stats.count("kl_M20"));
    EXPECT_TRUE(loss.per_layer.empty());
    loss.total.backward();
    for (const auto& [name, p] : method.named_parameters()) {
      ASSERT_TRUE(p.grad().defined()) << name;
      EXPECT_GT(p.grad().abs().max().item<double>(), 0) << name;
    }
    EXPECT_EQ(method.metadata().at("memory_loss"), "kl");
  }
  EXPECT_THROW(parse_memory_loss("ce"), Error);
}

// The KL loss's gradient is the whole derivative: a central difference along it equals its norm. The budgeted
// forward must keep the graph through the KV cache (a later chunk reads the keys and values an earlier chunk's
// memory read shaped): a cache that detached its entries would drop that share of the gradient while the loss and
// every parameter's gradient stayed non-zero (measured: its gradient norm is 21 % below the difference; this path
// is within 0.1 %). streaming_llm evicts by position, so no perturbation flips a decision; steps below ~1e-2 drown
// in float32 rounding.
TEST_F(MemPolicy, EndToEndKlGradientEqualsAFiniteDifferenceThroughTheCache) {
  const test::TinyModel& f = tiny_model();
  MemorySettings s;
  s.memory.read = MemoryRead::Slot;
  s.memory.dim = 4;
  s.memory.gate_bias_init = 2;  // an open gate: the memory moves the loss well above float32 rounding
  s.loss = MemoryLoss::Kl;
  s.policy = "streaming_llm";
  s.budgets = {8, 20};
  s.chunk = 5;
  MemoryMethod method(*f.model, s, 1);
  const Batch batch = next_token_batch(f.tokens);
  method.loss(batch).total.backward();
  double norm2 = 0;
  for (const auto& [name, p] : method.named_parameters()) norm2 += p.grad().pow(2).sum().item<double>();
  const double norm = std::sqrt(norm2), eps = 5e-2;
  auto loss_at = [&](double step) {  // the loss at θ + step · g / |g|
    const at::NoGradGuard no_grad;
    for (const auto& [name, p] : method.named_parameters()) p.add_(p.grad() * (step / norm));
    const double l = method.loss(batch).total.item<double>();
    for (const auto& [name, p] : method.named_parameters()) p.sub_(p.grad() * (step / norm));
    return l;
  };
  const double directional = (loss_at(eps) - loss_at(-eps)) / (2 * eps);
  EXPECT_GT(norm, 0);
  EXPECT_NEAR(directional, norm, 0.01 * norm);
}

// Layer 0 sees the same input with or without eviction upstream, so the trainer's replay of layer 0 must
// reproduce the engine's layer-0 output exactly: same read/evict/write order, same attention, under a
// heuristic, trimkv, and the pre-evicting indexmem (cut before the chunk's attention, then read).
TEST_F(MemPolicy, TrainingReplayOfLayerZeroEqualsTheEngineUnderEveryKindOfPolicy) {
  const test::TinyModel& f = tiny_model();
  for (const auto& [policy_name, read] : std::vector<std::pair<std::string, MemoryRead>>{
           {"h2o", MemoryRead::Add}, {"trimkv", MemoryRead::Add}, {"indexmem", MemoryRead::Add},
           {"h2o", MemoryRead::Slot}, {"trimkv", MemoryRead::Slot}, {"indexmem", MemoryRead::Slot}}) {
    SCOPED_TRACE(policy_name + " " + memory_read_name(read));
    MemorySettings s;
    s.memory.read = read;
    s.memory.gate_bias_init = 2;  // an open gate, so the memory's share of the output is large
    s.policy = policy_name;
    s.base_modules = test::tiny_learned_modules();
    s.budgets = {8};
    s.chunk = 5;
    MemoryMethod method(*f.model, s, 1);
    Batch batch;
    batch.inputs = f.tokens;
    batch.weights = at::ones({1, f.tokens.size(1)});
    const double replay_mse = method.loss(batch).per_layer.at(0);

    struct LayerZero : AttentionHook {
      AttentionHook* inner = nullptr;
      std::vector<at::Tensor> outputs;
      void before_attention(AttentionCall& call, KVCache& cache) override {
        if (inner) inner->before_attention(call, cache);
      }
      void after_attention(AttentionCall& call, KVCache& cache) override {
        if (inner) inner->after_attention(call, cache);
        if (call.layer == 0) outputs.push_back(call.output.detach().clone());
      }
    };
    const at::NoGradGuard no_grad;
    LayerZero full, engine;
    KVCache full_cache = f.model->make_cache(), cache = f.model->make_cache();
    f.model->forward(f.tokens, full_cache, &full);
    auto policy = method.eval_policy();
    BudgetedHook hook(*policy, 8);
    engine.inner = hook.get();
    for (std::int64_t t = 0; t < 60; t += 5) f.model->forward(f.tokens.narrow(1, t, 5), cache, &engine);
    // The first cut follows the chunk that ends at position 9 (10 > 8 entries), after its attention or (a
    // pre-evicting policy) before the next chunk's: either way positions 10.. are the first to differ.
    const at::Tensor o = at::cat(engine.outputs, 2).narrow(2, 10, 50), o_full = full.outputs[0].narrow(2, 10, 50);
    EXPECT_NEAR((o - o_full).pow(2).mean().item<double>(), replay_mse, 1e-6 * replay_mse);
    EXPECT_GT(replay_mse, 0);
  }
}

// The memory writes evicted keys rotated back from the cache (undo_rope): per entry, at that entry's own
// position, they equal the pre-RoPE keys the backbone rotated, up to float rounding.
TEST_F(MemPolicy, UndoRopeGivesBackThePreRopeKeysOfScatteredPositions) {
  const test::TinyModel& f = tiny_model();
  struct Capture final : AttentionHook {
    std::vector<AttentionCall> calls;
    void after_attention(AttentionCall& call, KVCache&) override { calls.push_back(call); }
  } capture;
  KVCache cache = f.model->make_cache();
  f.model->forward(f.tokens, cache, &capture);
  const AttentionCall& call = capture.calls.back();
  const std::int64_t B = call.k.size(0), Hkv = call.k.size(1), T = call.k.size(2);
  // Each (row, head) its own scattered entries, as a cache holds them after evictions.
  at::manual_seed(3);
  const at::Tensor index = std::get<0>(at::sort(at::randperm(T, at::kLong).narrow(0, 0, T / 2))).expand({B, Hkv, T / 2}).contiguous();
  const at::Tensor rows = index.unsqueeze(-1).expand({-1, -1, -1, call.k.size(3)});
  const at::Tensor back = undo_rope(at::gather(call.k, 2, rows), call.positions.index_select(0, index.flatten()).view(index.sizes()),
                                    call.inv_freq);
  const at::Tensor want = at::gather(call.k_pre_rope, 2, rows).to(at::kFloat);
  EXPECT_TRUE(at::allclose(back, want, 1e-5, 1e-5)) << (back - want).abs().max().item<double>();
  // Not the identity: the rotation is undone, not skipped.
  EXPECT_GT((at::gather(call.k, 2, rows).to(at::kFloat) - want).abs().max().item<double>(), 1e-2);
}

// What "+mem" holds beside the cache counts in the engine's peak: per layer Mem [B, Hkv, d_m, D] and z
// [B, Hkv, d_m] in float32, nothing else (evicted keys are rotated back, not copied); the same policy without
// the memory holds exactly the cache.
TEST_F(MemPolicy, PeakBytesCountTheCacheAndTheStateAlone) {
  const test::TinyModel& f = tiny_model();
  const ModelConfig& c = f.model->config();
  const std::int64_t budget = 8, chunk = 4, B = f.tokens.size(0);
  auto peak = [&](const std::string& name, std::int64_t* cache_bytes) {
    auto policy = make_policy(name, policy_config({}), test::tiny_learned_modules(memory_with_gate_bias(4.0)), 3);
    BudgetedHook hook(*policy, budget);
    KVCache cache = f.model->make_cache();
    for (std::int64_t s = 0; s + chunk <= 40; s += chunk) f.model->forward(f.tokens.narrow(1, s, chunk), cache, hook.get());
    *cache_bytes = hook.budgeted().peak_kv_bytes();
    return hook.peak_kv_bytes();
  };
  std::int64_t plain_cache = 0, mem_cache = 0;
  EXPECT_EQ(peak("h2o", &plain_cache), plain_cache);
  const std::int64_t with_memory = peak("h2o+mem", &mem_cache);
  EXPECT_EQ(mem_cache, plain_cache);
  const std::int64_t D = c.head_dim, Hkv = c.num_kv_heads, d_m = LatentMemorySettings{}.dim;
  EXPECT_EQ(with_memory - plain_cache, c.num_layers * B * Hkv * d_m * (D + 1) * 4);
}

// The oracle ranks by attention that training has not computed when it cuts: refused, naming the key, before a run.
TEST(MemPolicyCli, AMemoryCannotTrainUnderTheOracle) {
  const auto cli = test::stories260k_cli();
  test::TempDir dir("memory_oracle");
  std::ofstream(dir / "train.yaml") << test::tiny_train_yaml(
      cli, "  method: memory\n  steps: 3\n", "memory:\n  policy: oracle\nrun:\n  out_dir: " + (dir / "run") + "\n");
  std::string out, err;
  EXPECT_NE(test::run_kvbound("train " + (dir / "train.yaml"), &out, &err), 0);
  EXPECT_NE(err.find("memory.policy: 'oracle' ranks by the full model's future attention"), std::string::npos) << err;
  EXPECT_FALSE(std::filesystem::exists(dir / "run/metrics.jsonl"));
}

// The real CLI on stories260K: 3 steps of 2 rows of 32 tokens, one thread; export; evaluate h2o+mem.
TEST(MemPolicyCli, TrainsExportsAndEvaluates) {
  const auto cli = test::stories260k_cli();
  test::TempDir dir("memory_cli");
  std::ofstream(dir / "train.yaml") << test::tiny_train_yaml(
      cli, "  method: memory\n  steps: 3\n",
      "memory:\n  dim: 8\n  read: add\n  budgets: [8, 12]\n  chunk: 4\nrun:\n  out_dir: " + (dir / "run") + "\n");
  std::string out, err;
  ASSERT_EQ(test::run_kvbound("train " + (dir / "train.yaml"), &out, &err), 0) << err;
  const auto lines = test::read_jsonl(dir / "run/metrics.jsonl");
  ASSERT_EQ(lines.size(), 3u);
  for (const auto& j : lines) {
    EXPECT_TRUE(std::isfinite(j["loss"].get<double>())) << j.dump();
    EXPECT_GT(j["mse"].get<double>(), 0.0) << j.dump();
    EXPECT_EQ(j["mse_per_layer"].size(), 5u) << j.dump();
  }

  ASSERT_EQ(test::run_kvbound("export " + (dir / "run") + " --out " + (dir / "mem.safetensors"), &out, &err), 0) << err;
  const auto mem = read_safetensors(dir / "mem.safetensors");
  EXPECT_EQ(mem.tensors.size(), 5u * 5u);  // 5 layers x (wk, wq, theta, wg, cg)
  EXPECT_EQ(mem.tensors.at("model.layers.4.self_attn.latent_memory.wk").size(1), 8);
  EXPECT_EQ(mem.metadata.at("method"), "memory");
  EXPECT_EQ(mem.metadata.at("memory_policy"), "h2o");
  EXPECT_EQ(mem.metadata.at("memory_read"), "add");  // not the default: the key reaches the export

  std::set<std::string> policies;
  ASSERT_EQ(test::tiny_eval(cli, dir / "eval", "--set eval.policies=[h2o+mem,h2o] --set memory.weights=" + (dir / "mem.safetensors"),
                            &policies, &err), 0) << err;
  EXPECT_EQ(policies, (std::set<std::string>{"h2o+mem", "h2o"}));

  // A memory file whose read kvbound does not know fails naming the file and the field.
  std::map<std::string, std::string> metadata = mem.metadata;
  metadata["memory_read"] = "sum";
  write_safetensors(dir / "unknown_read.safetensors", mem.tensors, metadata);
  EXPECT_NE(test::tiny_eval(cli, dir / "unknown_read_eval",
                            "--set eval.policies=[h2o+mem] --set memory.weights=" + (dir / "unknown_read.safetensors"), &policies, &err),
            0);
  EXPECT_NE(err.find("unknown_read.safetensors: memory_read: 'sum' is not a memory read"), std::string::npos) << err;
}
