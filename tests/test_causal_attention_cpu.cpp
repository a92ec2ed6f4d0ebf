// The CPU prefill attention (ops/causal_attention_cpu.h): in bfloat16 within a small multiple of the plain
// bfloat16 formula's error against float64, in float32 (bf16x3) within a multiple of the plain float32 formula's,
// output and row logsumexp, for first chunks and chunks after cached keys, GQA
// groups of 1 to 8, head dims 64 and 128, query counts that leave a partial block, 4096 keys, strided keys and
// values; and which inputs it takes, and which it is the faster kernel for. bfloat16 runs on AMX tiles or, without
// them, with VDPBF16PS; float32 (bf16x3) on AMX alone. Each test is skipped, saying so, on a CPU without its engine. tests/test_attend_over_cache.cpp runs it through the backbone's path.
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/ones.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "ops/causal_attention_cpu.h"

using namespace kvbound;

namespace {

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// Scores [B, Hq, T, N] of q over keys repeated per group, at the given precision, with the chunk's causal mask
// (query t sees keys 0 … N − T + t).
at::Tensor masked_scores(const at::Tensor& q, const at::Tensor& keys, at::ScalarType precision) {
  const int64_t G = q.size(1) / keys.size(1), T = q.size(2), N = keys.size(2);
  at::Tensor scores = at::matmul(q.to(precision), keys.repeat_interleave(G, 1).to(precision).transpose(-1, -2)) /
                      std::sqrt(static_cast<double>(q.size(3)));
  const at::Tensor hidden = at::ones({T, N}, at::kBool).tril(N - T).logical_not();
  return scores.masked_fill(hidden, -INFINITY);
}

at::Tensor attention_at(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, at::ScalarType precision) {
  const int64_t G = q.size(1) / keys.size(1);
  return at::matmul(at::softmax(masked_scores(q, keys, precision), -1),
                    values.repeat_interleave(G, 1).to(precision));
}

struct Shape {
  int64_t B, Hq, Hkv, T, cached, D;
  std::string describe() const {
    return "B " + std::to_string(B) + " Hq " + std::to_string(Hq) + " Hkv " + std::to_string(Hkv) + " T " +
           std::to_string(T) + " cached " + std::to_string(cached) + " D " + std::to_string(D);
  }
};

// Random q (scaled by 2: peakier rows), keys and values of the shape in `dtype`.
struct Inputs {
  at::Tensor q, keys, values;
};
Inputs random_inputs(const Shape& s, at::ScalarType dtype) {
  const int64_t N = s.cached + s.T;
  return {(at::randn({s.B, s.Hq, s.T, s.D}) * 2).to(dtype), at::randn({s.B, s.Hkv, N, s.D}).to(dtype),
          at::randn({s.B, s.Hkv, N, s.D}).to(dtype)};
}

// Whether this CPU runs the bfloat16 kernel (AMX tiles or VDPBF16PS), and the float32 one (AMX tiles alone).
bool bf16_here() {
  const at::Tensor probe = at::randn({1, 1, 192, 64}).to(at::kBFloat16);
  return ops::causal_attention_cpu_supported(probe, probe, probe);
}
bool amx_here() {
  const at::Tensor probe = at::randn({1, 1, 192, 64});
  return ops::causal_attention_cpu_supported(probe, probe, probe);
}
constexpr const char* kNoBf16 = "this CPU has neither AMX nor AVX512-BF16: the bfloat16 kernel never runs here";

}  // namespace

TEST(CausalAttentionCpu, WithinThePlainBfloat16ErrorOfTheFormula) {
  if (!bf16_here()) GTEST_SKIP() << kNoBf16;
  at::manual_seed(11);
  for (const Shape s : {Shape{2, 6, 2, 64, 0, 64}, Shape{2, 3, 3, 100, 37, 64}, Shape{2, 6, 2, 192, 0, 64},
                        Shape{1, 9, 3, 200, 0, 64}, Shape{2, 3, 3, 193, 37, 64}, Shape{1, 4, 1, 192, 200, 128},
                        Shape{1, 8, 2, 250, 64, 128}, Shape{1, 16, 2, 192, 0, 128}, Shape{1, 3, 1, 192, 3904, 64}}) {
    const auto [q, keys, values] = random_inputs(s, at::kBFloat16);
    const std::string where = s.describe();
    ASSERT_TRUE(ops::causal_attention_cpu_supported(q, keys, values)) << where;
    at::Tensor lse;
    const at::Tensor out = ops::causal_attention_cpu(q, keys, values, &lse);
    ASSERT_EQ(out.sizes(), q.sizes()) << where;
    ASSERT_EQ(out.scalar_type(), at::kBFloat16) << where;
    const at::Tensor exact = attention_at(q, keys, values, at::kDouble);
    const double plain_error = max_abs_diff(attention_at(q, keys, values, at::kBFloat16), exact);
    EXPECT_LE(max_abs_diff(out, exact), 2 * plain_error) << where;
    const at::Tensor exact_lse = at::logsumexp(masked_scores(q, keys, at::kDouble), -1);
    const double plain_lse_error = max_abs_diff(at::logsumexp(masked_scores(q, keys, at::kBFloat16), -1), exact_lse);
    ASSERT_EQ(lse.sizes(), exact_lse.sizes()) << where;
    EXPECT_LE(max_abs_diff(lse, exact_lse), std::max(1e-4, 2 * plain_lse_error)) << where;
    // Without the logsumexp, the same output.
    EXPECT_TRUE(at::equal(ops::causal_attention_cpu(q, keys, values, nullptr), out)) << where;
  }
}

// float32 inputs, their products as bf16x3 (ops/bf16x3_linear.h): within 32× the plain float32 formula's error
// against float64 (measured 8–25×: the dropped terms are ~2^-16 of each product), output and logsumexp, and far
// from bfloat16's (1/256 of its error: a lost correction term would show at about half of it).
TEST(CausalAttentionCpu, Float32WithinAMultipleOfThePlainFloat32Error) {
  if (!amx_here()) GTEST_SKIP() << "this CPU's oneDNN does not pack bfloat16 (no AMX): the fast path never runs here";
  at::manual_seed(13);
  for (const Shape s : {Shape{2, 6, 2, 64, 0, 64}, Shape{2, 3, 3, 100, 37, 64}, Shape{1, 9, 3, 512, 0, 64},
                        Shape{1, 4, 1, 192, 200, 128}, Shape{1, 16, 2, 130, 0, 128}, Shape{1, 3, 1, 192, 3904, 64}}) {
    const auto [q, keys, values] = random_inputs(s, at::kFloat);
    const std::string where = s.describe();
    ASSERT_TRUE(ops::causal_attention_cpu_supported(q, keys, values)) << where;
    at::Tensor lse;
    const at::Tensor out = ops::causal_attention_cpu(q, keys, values, &lse);
    ASSERT_EQ(out.sizes(), q.sizes()) << where;
    ASSERT_EQ(out.scalar_type(), at::kFloat) << where;
    const at::Tensor exact = attention_at(q, keys, values, at::kDouble);
    const double error = max_abs_diff(out, exact);
    EXPECT_LE(error, 32 * max_abs_diff(attention_at(q, keys, values, at::kFloat), exact)) << where;
    EXPECT_LE(error, max_abs_diff(attention_at(q, keys, values, at::kBFloat16), exact) / 256) << where;
    const at::Tensor exact_lse = at::logsumexp(masked_scores(q, keys, at::kDouble), -1);
    ASSERT_EQ(lse.sizes(), exact_lse.sizes()) << where;
    const double lse_error = max_abs_diff(lse, exact_lse);
    EXPECT_LE(lse_error, 32 * max_abs_diff(at::logsumexp(masked_scores(q, keys, at::kFloat), -1), exact_lse)) << where;
    EXPECT_LE(lse_error, max_abs_diff(at::logsumexp(masked_scores(q, keys, at::kBFloat16), -1), exact_lse) / 256) << where;
    EXPECT_TRUE(at::equal(ops::causal_attention_cpu(q, keys, values, nullptr), out)) << where;
  }
}

// Strided keys and values (the cache's views of a larger buffer, and a [B, N, Hkv, D] layout seen as
// [B, Hkv, N, D]) and queries from a transposed projection: the same result as contiguous copies.
TEST(CausalAttentionCpu, ReadsStridedInputs) {
  if (!bf16_here()) GTEST_SKIP() << kNoBf16;
  at::manual_seed(12);
  const at::Tensor q = at::randn({1, 200, 6, 64}).to(at::kBFloat16).transpose(1, 2);  // [1, 6, 200, 64]
  const at::Tensor buffer_k = at::randn({1, 2, 400, 64}).to(at::kBFloat16), buffer_v = at::randn({1, 2, 400, 64}).to(at::kBFloat16);
  const at::Tensor keys = buffer_k.narrow(2, 0, 260), values = buffer_v.narrow(2, 0, 260);
  const at::Tensor same = ops::causal_attention_cpu(q.contiguous(), keys.contiguous(), values.contiguous(), nullptr);
  EXPECT_TRUE(at::equal(ops::causal_attention_cpu(q, keys, values, nullptr), same));
  const at::Tensor keys_nhd = keys.transpose(1, 2).contiguous().transpose(1, 2);  // stride(2) = Hkv·D
  const at::Tensor values_nhd = values.transpose(1, 2).contiguous().transpose(1, 2);
  ASSERT_NE(keys_nhd.stride(2), 64);
  EXPECT_TRUE(at::equal(ops::causal_attention_cpu(q, keys_nhd, values_nhd, nullptr), same));
}

TEST(CausalAttentionCpu, TakesOnlyItsInputsAndRunsWhereItIsFaster) {
  if (!bf16_here()) GTEST_SKIP() << kNoBf16;
  const bool amx = amx_here();
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  const at::Tensor q = at::randn({1, 6, 192, 64}, bf16), kv = at::randn({1, 2, 200, 64}, bf16);
  EXPECT_TRUE(ops::causal_attention_cpu_supported(q, kv, kv));
  EXPECT_TRUE(ops::causal_attention_cpu_fits(q, kv, kv));
  // A short chunk: the kernel takes it; on AMX SDPA's was faster there, while VDPBF16PS was the faster even for
  // one query.
  EXPECT_TRUE(ops::causal_attention_cpu_supported(q.narrow(2, 0, 64), kv, kv));
  EXPECT_EQ(ops::causal_attention_cpu_fits(q.narrow(2, 0, 64), kv, kv), !amx);
  EXPECT_EQ(ops::causal_attention_cpu_fits(q.narrow(2, 0, 1), kv, kv), !amx);
  // float32 (bf16x3) on AMX alone: from 128 queries, where SDPA's float32 kernel is already the slower.
  const at::Tensor q32 = q.to(at::kFloat), kv32 = kv.to(at::kFloat);
  EXPECT_EQ(ops::causal_attention_cpu_fits(q32.narrow(2, 0, 128), kv32, kv32), amx);
  EXPECT_EQ(ops::causal_attention_cpu_supported(q32.narrow(2, 0, 127), kv32, kv32), amx);
  EXPECT_FALSE(ops::causal_attention_cpu_fits(q32.narrow(2, 0, 127), kv32, kv32));
  const auto refused = [&](const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const char* why) {
    EXPECT_FALSE(ops::causal_attention_cpu_supported(q_, k_, v_)) << why;
    EXPECT_FALSE(ops::causal_attention_cpu_fits(q_, k_, v_)) << why;
  };
  refused(q.to(at::kFloat), kv, kv, "float32 queries, bfloat16 keys and values");
  refused(q.to(at::kDouble), kv.to(at::kDouble), kv.to(at::kDouble), "float64");
  refused(at::randn({1, 6, 192, 32}, bf16), at::randn({1, 2, 200, 32}, bf16), at::randn({1, 2, 200, 32}, bf16),
          "head dim 32");
  refused(q, kv.narrow(2, 0, 100), kv.narrow(2, 0, 100), "fewer keys than queries");
  refused(q, at::randn({1, 2, 5000, 64}, bf16), at::randn({1, 2, 5000, 64}, bf16), "more than 4096 keys");
  refused(q, at::randn({1, 4, 200, 64}, bf16), at::randn({1, 4, 200, 64}, bf16), "6 query heads over 4 KV heads");
  refused(q, at::randn({1, 0, 200, 64}, bf16), at::randn({1, 0, 200, 64}, bf16), "no KV heads");
  refused(q.transpose(2, 3).contiguous().transpose(2, 3), kv, kv, "queries strided along D");
  refused(q.to(at::kFloat).requires_grad_(true).to(at::kBFloat16), kv, kv, "a gradient to carry");
}
