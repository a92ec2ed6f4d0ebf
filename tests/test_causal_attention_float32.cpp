// The float32 CPU prefill attention on the BLAS sgemm (ops/causal_attention_float32.h): within a small multiple of
// the plain float32 formula's error against float64, output and row logsumexp, for first chunks and chunks after
// cached keys, batches of 2, GQA groups of 1 to 16, head dims 16 to 256, query counts that leave a partial block,
// 4096 keys, strided inputs; bfloat16 inputs (a bfloat16 model on a CPU without AMX) within a small multiple of
// the plain bfloat16 formula's error; the same result whatever the thread count; and which inputs it takes and
// which it is the faster kernel for. It needs no AMX: it runs on every CPU. tests/test_attend_over_cache.cpp runs it through
// the backbone's path.
#include <ATen/Parallel.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/softmax.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "ops/causal_attention_float32.h"

using namespace kvbound;

namespace {

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// Scores [B, Hq, T, N] of q over keys repeated per group, at `precision`, with the chunk's causal mask (query t
// sees keys 0 … N − T + t).
at::Tensor masked_scores(const at::Tensor& q, const at::Tensor& keys, at::ScalarType precision) {
  const int64_t G = q.size(1) / keys.size(1), T = q.size(2), N = keys.size(2);
  at::Tensor scores = at::matmul(q.to(precision), keys.repeat_interleave(G, 1).to(precision).transpose(-1, -2)) /
                      std::sqrt(static_cast<double>(q.size(3)));
  return scores.masked_fill(at::ones({T, N}, at::kBool).tril(N - T).logical_not(), -INFINITY);
}

at::Tensor attention_at(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, at::ScalarType precision) {
  const int64_t G = q.size(1) / keys.size(1);
  return at::matmul(at::softmax(masked_scores(q, keys, precision), -1), values.repeat_interleave(G, 1).to(precision));
}

struct Shape {
  int64_t B, Hq, Hkv, T, cached, D;
  std::string describe() const {
    return "B " + std::to_string(B) + " Hq " + std::to_string(Hq) + " Hkv " + std::to_string(Hkv) + " T " +
           std::to_string(T) + " cached " + std::to_string(cached) + " D " + std::to_string(D);
  }
};

}  // namespace

// Within 4× the plain float32 formula's error against float64 (both sum in float32; the orders differ), output and
// logsumexp; without the logsumexp, the same output bit for bit.
TEST(CausalAttentionFloat32, WithinASmallMultipleOfThePlainFloat32Error) {
  at::manual_seed(31);
  for (const Shape s : {Shape{2, 6, 2, 64, 0, 64}, Shape{2, 3, 3, 100, 37, 64}, Shape{1, 9, 3, 512, 0, 64},
                        Shape{1, 4, 1, 192, 200, 128}, Shape{1, 16, 2, 130, 0, 128}, Shape{1, 16, 1, 70, 0, 16},
                        Shape{1, 2, 1, 33, 5, 80}, Shape{1, 4, 2, 96, 0, 256}, Shape{1, 3, 1, 192, 3904, 64}}) {
    const int64_t N = s.cached + s.T;
    // q scaled by 2: peakier rows.
    const at::Tensor q = at::randn({s.B, s.Hq, s.T, s.D}) * 2, keys = at::randn({s.B, s.Hkv, N, s.D}),
                     values = at::randn({s.B, s.Hkv, N, s.D});
    const std::string where = s.describe();
    ASSERT_TRUE(ops::causal_attention_float32_supported(q, keys, values)) << where;
    at::Tensor lse;
    const at::Tensor out = ops::causal_attention_float32(q, keys, values, &lse);
    ASSERT_EQ(out.sizes(), q.sizes()) << where;
    ASSERT_EQ(out.scalar_type(), at::kFloat) << where;
    const at::Tensor exact = attention_at(q, keys, values, at::kDouble);
    const double error = max_abs_diff(out, exact);
    EXPECT_GT(error, 0) << where;
    EXPECT_LE(error, 4 * max_abs_diff(attention_at(q, keys, values, at::kFloat), exact)) << where;
    const at::Tensor exact_lse = at::logsumexp(masked_scores(q, keys, at::kDouble), -1);
    ASSERT_EQ(lse.sizes(), exact_lse.sizes()) << where;
    EXPECT_LE(max_abs_diff(lse, exact_lse), 4 * max_abs_diff(at::logsumexp(masked_scores(q, keys, at::kFloat), -1), exact_lse))
        << where;
    EXPECT_TRUE(at::equal(ops::causal_attention_float32(q, keys, values, nullptr), out)) << where;
  }
}

// bfloat16 q, K and V (a bfloat16 backbone's chunk where the AMX tiles are absent): products and softmax in float32,
// the output rounded once to bfloat16, so within 2× the plain bfloat16 formula's error against float64 (its scores,
// weights and products each rounded to bfloat16), the logsumexp within the float32 formula's error on the bfloat16
// inputs; strided keys as the contiguous ones.
TEST(CausalAttentionFloat32, TakesBfloat16InputsWithinTheBfloat16FormulasError) {
  at::manual_seed(34);
  for (const Shape s : {Shape{2, 9, 3, 192, 0, 64}, Shape{1, 4, 2, 100, 60, 128}, Shape{1, 3, 1, 96, 0, 16}}) {
    const int64_t N = s.cached + s.T;
    const at::Tensor q = (at::randn({s.B, s.Hq, s.T, s.D}) * 2).to(at::kBFloat16);
    const at::Tensor buffer_k = at::randn({s.B, s.Hkv, N + 8, s.D}).to(at::kBFloat16);
    const at::Tensor keys = buffer_k.narrow(2, 0, N), values = at::randn({s.B, s.Hkv, N, s.D}).to(at::kBFloat16);
    const std::string where = s.describe();
    ASSERT_TRUE(ops::causal_attention_float32_supported(q, keys, values)) << where;
    at::Tensor lse;
    const at::Tensor out = ops::causal_attention_float32(q, keys, values, &lse);
    ASSERT_EQ(out.scalar_type(), at::kBFloat16) << where;
    ASSERT_EQ(out.sizes(), q.sizes()) << where;
    ASSERT_EQ(lse.scalar_type(), at::kFloat) << where;
    const at::Tensor exact = attention_at(q, keys, values, at::kDouble);
    const double error = max_abs_diff(out, exact);
    EXPECT_GT(error, 0) << where;
    EXPECT_LE(error, 2 * max_abs_diff(attention_at(q, keys, values, at::kBFloat16), exact)) << where;
    const at::Tensor exact_lse = at::logsumexp(masked_scores(q, keys, at::kDouble), -1);
    EXPECT_LE(max_abs_diff(lse, exact_lse), 4 * max_abs_diff(at::logsumexp(masked_scores(q, keys, at::kFloat), -1), exact_lse))
        << where;
    EXPECT_TRUE(at::equal(ops::causal_attention_float32(q, keys.contiguous(), values, nullptr), out)) << where;
  }
}

// Each task owns its rows: one thread or two, the same result bit for bit.
TEST(CausalAttentionFloat32, TheSameOnOneThreadAsOnTwo) {
  at::manual_seed(32);
  const at::Tensor q = at::randn({2, 9, 300, 64}), keys = at::randn({2, 3, 340, 64}), values = at::randn({2, 3, 340, 64});
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  at::Tensor lse_one, lse_two;
  const at::Tensor one = ops::causal_attention_float32(q, keys, values, &lse_one);
  at::set_num_threads(2);
  const at::Tensor two = ops::causal_attention_float32(q, keys, values, &lse_two);
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(one, two));
  EXPECT_TRUE(at::equal(lse_one, lse_two));
}

// Strided keys and values (the cache's views of a larger buffer, and a [B, N, Hkv, D] layout seen as
// [B, Hkv, N, D]) and queries from a transposed projection: the same result as contiguous copies.
TEST(CausalAttentionFloat32, ReadsStridedInputs) {
  at::manual_seed(33);
  const at::Tensor q = at::randn({1, 200, 6, 64}).transpose(1, 2);  // [1, 6, 200, 64]
  const at::Tensor buffer_k = at::randn({1, 2, 400, 64}), buffer_v = at::randn({1, 2, 400, 64});
  const at::Tensor keys = buffer_k.narrow(2, 0, 260), values = buffer_v.narrow(2, 0, 260);
  const at::Tensor same = ops::causal_attention_float32(q.contiguous(), keys.contiguous(), values.contiguous(), nullptr);
  EXPECT_TRUE(at::equal(ops::causal_attention_float32(q, keys, values, nullptr), same));
  const at::Tensor keys_nhd = keys.transpose(1, 2).contiguous().transpose(1, 2);  // stride(2) = Hkv·D
  const at::Tensor values_nhd = values.transpose(1, 2).contiguous().transpose(1, 2);
  ASSERT_NE(keys_nhd.stride(2), 64);
  EXPECT_TRUE(at::equal(ops::causal_attention_float32(q, keys_nhd, values_nhd, nullptr), same));
}

TEST(CausalAttentionFloat32, TakesOnlyItsInputsAndRunsWhereItIsFaster) {
  const at::Tensor q = at::randn({1, 6, 96, 64}), kv = at::randn({1, 2, 200, 64});
  EXPECT_TRUE(ops::causal_attention_float32_supported(q, kv, kv));
  EXPECT_TRUE(ops::causal_attention_float32_fits(q, kv, kv));
  // A short chunk (a decoded token above all): the kernel takes it, but SDPA's was faster there.
  EXPECT_TRUE(ops::causal_attention_float32_supported(q.narrow(2, 0, 95), kv, kv));
  EXPECT_FALSE(ops::causal_attention_float32_fits(q.narrow(2, 0, 95), kv, kv));
  const auto refused = [&](const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const char* why) {
    EXPECT_FALSE(ops::causal_attention_float32_supported(q_, k_, v_)) << why;
    EXPECT_FALSE(ops::causal_attention_float32_fits(q_, k_, v_)) << why;
  };
  EXPECT_TRUE(ops::causal_attention_float32_fits(q.to(at::kBFloat16), kv.to(at::kBFloat16), kv.to(at::kBFloat16)));
  refused(q, kv.to(at::kBFloat16), kv, "bfloat16 keys for float32 queries");
  refused(q.to(at::kHalf), kv.to(at::kHalf), kv.to(at::kHalf), "float16");
  refused(q.to(at::kDouble), kv.to(at::kDouble), kv.to(at::kDouble), "float64");
  refused(at::randn({1, 6, 96, 512}), at::randn({1, 2, 200, 512}), at::randn({1, 2, 200, 512}), "head dim 512");
  refused(q, kv.narrow(2, 0, 90), kv.narrow(2, 0, 90), "fewer keys than queries");
  refused(q, at::randn({1, 2, 5000, 64}), at::randn({1, 2, 5000, 64}), "more than 4096 keys");
  refused(q, at::randn({1, 4, 200, 64}), at::randn({1, 4, 200, 64}), "6 query heads over 4 KV heads");
  refused(q, at::randn({1, 0, 200, 64}), at::randn({1, 0, 200, 64}), "no KV heads");
  refused(q.transpose(2, 3).contiguous().transpose(2, 3), kv, kv, "queries strided along D");
  refused(q.clone().requires_grad_(true), kv, kv, "a gradient to carry");
}
