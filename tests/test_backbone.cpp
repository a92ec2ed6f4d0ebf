// The backbone computes what transformers computes: golden logits of tiny random checkpoints of every
// supported family, the real SmolLM2 GGUF, and llama2.c's reference generation for stories260K.
#include <ATen/ops/randint.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/tensor.h>
#include <gtest/gtest.h>

#include "data/tokenizer.h"
#include "golden_reader.h"
#include "modules/backbone.h"
#include "modules/sampler.h"
#include "ops/bf16x3_linear.h"
#include "test_env.h"

using namespace kvbound;

namespace {

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

class TinyGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(TinyGolden, Fp32LogitsMatchTransformers) {
  const std::string dir = test::test_data("tiny/" + GetParam());
  KVBOUND_REQUIRE_FILE(dir + "/logits.f32");
  const auto golden = test::read_golden(dir, "logits");
  const auto model = Backbone::load(dir, at::kFloat);
  KVCache cache = model->make_cache();
  const at::Tensor logits = model->forward(golden.input_ids, cache);
  EXPECT_LE(max_abs_diff(logits, golden.values), 1e-4) << GetParam();
  EXPECT_EQ(cache.size(0), golden.input_ids.size(1));
}

TEST_P(TinyGolden, IncrementalDecodeEqualsOneForward) {
  const std::string dir = test::test_data("tiny/" + GetParam());
  KVBOUND_REQUIRE_FILE(dir + "/logits.f32");
  const auto golden = test::read_golden(dir, "logits");
  const auto model = Backbone::load(dir, at::kFloat);
  KVCache one = model->make_cache();
  const at::Tensor full = model->forward(golden.input_ids, one);
  // Prefill in two uneven chunks, then one token at a time.
  KVCache cache = model->make_cache();
  std::vector<at::Tensor> parts;
  const std::int64_t T = golden.input_ids.size(1);
  parts.push_back(model->forward(golden.input_ids.narrow(1, 0, 37), cache));
  parts.push_back(model->forward(golden.input_ids.narrow(1, 37, 64), cache));
  for (std::int64_t t = 101; t < T; ++t) parts.push_back(model->forward(golden.input_ids.narrow(1, t, 1), cache));
  EXPECT_LE(max_abs_diff(at::cat(parts, 1), full), 1e-5);
  EXPECT_EQ(cache.next_position(), T);
}

// The bf16x3 products (ops/bf16x3_linear.h) hold the same tolerance as the float32 GEMM against transformers.
TEST_P(TinyGolden, Bf16x3ProductsMatchTransformers) {
  if (!ops::bf16x3_available()) GTEST_SKIP() << "this CPU's oneDNN does not pack bfloat16 (no AMX)";
  const std::string dir = test::test_data("tiny/" + GetParam());
  KVBOUND_REQUIRE_FILE(dir + "/logits.f32");
  const auto golden = test::read_golden(dir, "logits");
  const auto model = Backbone::load(dir, at::kFloat);
  ASSERT_TRUE(model->set_float32_products(Backbone::Float32Products::kBf16x3));
  KVCache cache = model->make_cache();
  const at::Tensor logits = model->forward(golden.input_ids, cache);
  EXPECT_LE(max_abs_diff(logits, golden.values), 1e-4) << GetParam();
  // Not the float32 GEMM's values: the tiles did run.
  ASSERT_FALSE(model->set_float32_products(Backbone::Float32Products::kFloat32));
  KVCache float32_cache = model->make_cache();
  EXPECT_FALSE(at::equal(model->forward(golden.input_ids, float32_cache), logits)) << GetParam();
}

INSTANTIATE_TEST_SUITE_P(Families, TinyGolden,
                         ::testing::Values("llama_tied", "llama3_untied", "mistral_untied", "qwen2_tied",
                                           "qwen3_untied", "llama3_sharded", "qwen3_bf16"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

TEST(Backbone, Bf16ComputeStaysCloseToFp32) {
  const std::string dir = test::test_data("tiny/qwen3_bf16");
  KVBOUND_REQUIRE_FILE(dir + "/logits.f32");
  const auto golden = test::read_golden(dir, "logits");
  const auto model = Backbone::load(dir, at::kBFloat16);
  EXPECT_EQ(model->dtype(), at::kBFloat16);
  KVCache cache = model->make_cache();
  const at::Tensor logits = model->forward(golden.input_ids, cache);
  // bf16 keeps 8 mantissa bits: relative error of a few 1e-2 through 3 layers.
  const double scale = golden.values.abs().max().item<double>();
  EXPECT_LE(max_abs_diff(logits, golden.values), 0.05 * scale);
}

TEST(Backbone, EveryParameterIsFrozenAndCounted) {
  const std::string dir = test::test_data("tiny/llama3_untied");
  KVBOUND_REQUIRE_FILE(dir + "/config.json");
  const auto model = Backbone::load(dir, at::kFloat);
  // embed + head (untied) + per layer: 2 norms + q,k,v,o + 3 MLP.
  const std::int64_t d = 64, v = 160, ff = 112, q = 64, kv = 16;
  const std::int64_t per_layer = 2 * d + d * q + 2 * d * kv + q * d + 3 * d * ff;
  EXPECT_EQ(model->num_parameters(), 2 * v * d + d + 3 * per_layer);
}

TEST(Backbone, HookSeesEveryLayerAndCanReplaceTheAttentionOutput) {
  const std::string dir = test::test_data("tiny/llama_tied");
  KVBOUND_REQUIRE_FILE(dir + "/logits.f32");
  const auto golden = test::read_golden(dir, "logits");
  const auto model = Backbone::load(dir, at::kFloat);
  struct Recorder : AttentionHook {
    std::vector<std::int64_t> before, after;
    bool zero_output = false;
    void before_attention(AttentionCall& call, KVCache& cache) override {
      before.push_back(call.layer);
      EXPECT_EQ(cache.size(call.layer), 0);  // the chunk is not in the cache yet
      EXPECT_EQ(call.k.size(1), 2);
    }
    void after_attention(AttentionCall& call, KVCache& cache) override {
      after.push_back(call.layer);
      EXPECT_EQ(cache.size(call.layer), call.q.size(2));
      if (zero_output) call.output = call.output * 0;
    }
  } hook;
  KVCache cache = model->make_cache();
  const at::Tensor with_hook = model->forward(golden.input_ids, cache, &hook);
  EXPECT_EQ(hook.before, (std::vector<std::int64_t>{0, 1, 2}));
  EXPECT_EQ(hook.after, (std::vector<std::int64_t>{0, 1, 2}));
  EXPECT_LE(max_abs_diff(with_hook, golden.values), 1e-4);
  hook.zero_output = true;
  KVCache cache2 = model->make_cache();
  EXPECT_GT(max_abs_diff(model->forward(golden.input_ids, cache2, &hook), golden.values), 1e-2);
}

// Both sides dequantize the same Q4_1/Q8_0 blocks to fp32; what remains is fp32 summation order over 30 layers,
// on logits of magnitude ~20 (and, with bf16x3 products, their rounding: the same tolerance holds).
void expect_smollm2_goldens(const Backbone& model) {
  for (const char* name : {"story", "code"}) {
    const std::string dir = test::test_data("smollm2");
    KVBOUND_REQUIRE_FILE(dir + "/" + name + ".f32");
    const auto golden = test::read_golden(dir, name);
    KVCache cache = model.make_cache();
    const at::Tensor logits = model.forward(golden.input_ids, cache)[0];
    EXPECT_LE(max_abs_diff(logits, golden.values), 2e-3) << name;
    EXPECT_TRUE(at::equal(logits.argmax(-1), golden.values.argmax(-1))) << name;
  }
}

TEST(Backbone, SmolLM2GgufLogitsMatchTransformers) {
  KVBOUND_REQUIRE_FILE(test::default_model());
  expect_smollm2_goldens(*Backbone::load(test::default_model(), at::kFloat));
}

TEST(Backbone, SmolLM2GgufBf16x3ProductsMatchTransformers) {
  if (!ops::bf16x3_available()) GTEST_SKIP() << "this CPU's oneDNN does not pack bfloat16 (no AMX)";
  KVBOUND_REQUIRE_FILE(test::default_model());
  const auto model = Backbone::load(test::default_model(), at::kFloat);
  ASSERT_TRUE(model->set_float32_products(Backbone::Float32Products::kBf16x3));
  expect_smollm2_goldens(*model);
  // The goldens are too short for the attention kernel (ops/causal_attention_cpu: from 128 queries): 256 tokens
  // against the float32 GEMM's forward, to the goldens' tolerance — the precision of the whole bf16x3 forward
  // (tests/test_attend_over_cache.cpp checks that the kernel is the one that runs).
  at::manual_seed(5);
  const at::Tensor ids = at::randint(3, model->config().vocab_size, {1, 256}, at::TensorOptions().dtype(at::kLong));
  const auto float32 = Backbone::load(test::default_model(), at::kFloat);
  KVCache a = model->make_cache(), b = float32->make_cache();
  const at::Tensor tiles = model->forward(ids, a), gemm = float32->forward(ids, b);
  EXPECT_LE(max_abs_diff(tiles, gemm), 2e-3);
  EXPECT_TRUE(at::equal(tiles.argmax(-1), gemm.argmax(-1)));
  EXPECT_FALSE(at::equal(tiles, gemm));
}

// bfloat16 compute keeps its own GEMM; chunks of fewer than kBf16x3MinRows rows (B·T: a decode step) take the
// float32 GEMM, bit for bit the float32 model's.
TEST(Backbone, Bf16x3ProductsOnlyWhereTheyApply) {
  const std::string dir = test::test_data("tiny/llama_tied");
  KVBOUND_REQUIRE_FILE(dir + "/logits.f32");
  const auto golden = test::read_golden(dir, "logits");
  const auto bf16 = Backbone::load(dir, at::kBFloat16);
  EXPECT_FALSE(bf16->set_float32_products(Backbone::Float32Products::kBf16x3));
  EXPECT_EQ(bf16->float32_products(), Backbone::Float32Products::kFloat32);
  if (!ops::bf16x3_available()) GTEST_SKIP() << "this CPU's oneDNN does not pack bfloat16 (no AMX)";
  const auto model = Backbone::load(dir, at::kFloat), float32 = Backbone::load(dir, at::kFloat);
  ASSERT_TRUE(model->set_float32_products(Backbone::Float32Products::kBf16x3));
  const at::Tensor one_row = golden.input_ids.narrow(0, 0, 1);  // rows are B·T
  const at::Tensor few = one_row.narrow(1, 0, Backbone::kBf16x3MinRows - 1);
  const at::Tensor enough = one_row.narrow(1, 0, Backbone::kBf16x3MinRows);
  KVCache a = model->make_cache(), b = float32->make_cache(), c = model->make_cache(), d = float32->make_cache();
  EXPECT_TRUE(at::equal(model->forward(few, a), float32->forward(few, b)));
  EXPECT_FALSE(at::equal(model->forward(enough, c), float32->forward(enough, d)));
}

// An input that carries a gradient gets it through the float32 weights (ops::bf16x3_linear's differentiable
// form): a hook that scales every attention output by a trainable factor gets the float32 model's gradient
// within the products' rounding, with the bf16x3 products on.
TEST(Backbone, GradientsFlowThroughTheProjectionsWithBf16x3On) {
  if (!ops::bf16x3_available()) GTEST_SKIP() << "this CPU's oneDNN does not pack bfloat16 (no AMX)";
  const std::string dir = test::test_data("tiny/llama3_untied");
  KVBOUND_REQUIRE_FILE(dir + "/logits.f32");
  const auto golden = test::read_golden(dir, "logits");
  struct Scale : AttentionHook {
    at::Tensor factor = at::ones({1}).requires_grad_(true);
    void after_attention(AttentionCall& call, KVCache&) override { call.output = call.output * factor; }
  };
  auto gradient = [&](Backbone::Float32Products products) {
    const auto model = Backbone::load(dir, at::kFloat);
    model->set_float32_products(products);
    Scale hook;
    KVCache cache = model->make_cache();
    model->forward(golden.input_ids, cache, &hook).square().mean().backward();
    return hook.factor.grad();
  };
  const at::Tensor float32 = gradient(Backbone::Float32Products::kFloat32);
  const at::Tensor bf16x3 = gradient(Backbone::Float32Products::kBf16x3);
  ASSERT_TRUE(bf16x3.defined());
  EXPECT_FALSE(at::equal(bf16x3, float32));  // the tiles ran
  EXPECT_LE(max_abs_diff(bf16x3, float32), 1e-4 * float32.abs().item<double>());
}

TEST(Backbone, Stories260KGreedyReproducesLlama2cReference) {
  const std::string dir = test::asset("stories260K");
  KVBOUND_REQUIRE_FILE(dir + "/model.safetensors");
  const auto model = Backbone::load(dir, at::kFloat);
  const auto tokenizer = load_tokenizer(dir + "/tok512.bin");
  // llama2.c test_all.py: `run stories260K.bin -z tok512.bin -t 0.0 -n 200` prints exactly this.
  const std::string expected =
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she "
      "saw a big, red ball. She wanted to play with it, but it was too high.\nLily's mom said, \"Lily, let's go to "
      "the park.\" Lily was sad and didn't know what to do. She said, \"I want to play with your ball, but I can't "
      "find it.\"\nLily was sad and didn't know what to do. She said, \"I'm sorry, Lily. I didn't know what to "
      "do.\"\nLily didn't want to help her mom, so she";
  std::vector<std::int64_t> ids = {tokenizer->bos_id()};
  KVCache cache = model->make_cache();
  Sampler greedy({});
  at::Tensor input = at::tensor(ids, at::kLong).unsqueeze(0);
  for (int step = 0; step < 200; ++step) {  // run.c -n 200: 200 forward steps, each printing its next token
    const std::int64_t next = greedy.next(model->forward(input, cache)[0][-1]);
    ids.push_back(next);
    input = at::tensor(std::vector<std::int64_t>{next}, at::kLong).unsqueeze(0);
  }
  EXPECT_EQ(tokenizer->decode(ids), expected);
  EXPECT_EQ(std::vector<std::int64_t>(ids.begin() + 1, ids.begin() + 11),
            (std::vector<std::int64_t>{403, 407, 261, 378, 432, 383, 286, 261, 376, 298}));
}

}  // namespace
