// attend_over_cache, the backbone's one attention path: the row logsumexp it hands a hook that asks for it, with
// a gradient when its inputs carry one; a layer whose heads hold different numbers of entries (padding slots).
// In kvbound_device_tests so the GPU machine runs the CUDA branch too (scripts/gpu_check.sh).
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tensor.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "modules/backbone.h"
#include "modules/kv_cache.h"
#include "ops/amx_panels.h"
#include "ops/bf16_dot_panels.h"
#include "ops/causal_attention_cpu.h"
#include "ops/causal_attention_float32.h"
#include "ops/cuda_module.h"

using namespace kvbound;

namespace {

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

// Scores q·kᵀ/8 (head dim 64) of a chunk of queries at positions start … over `keys` (every cached entry, then
// the chunk), at `precision`, with the chunk's causal mask as −∞.
at::Tensor chunk_scores(const at::Tensor& q, const at::Tensor& keys, std::int64_t start, at::ScalarType precision) {
  const std::int64_t T = q.size(2), N = keys.size(2);
  at::Tensor scores = at::matmul(q.to(precision), keys.to(precision).transpose(-1, -2)) / 8.0;
  for (std::int64_t t = 0; t < T; ++t) scores.narrow(2, t, 1).narrow(3, start + t + 1, N - start - t - 1).fill_(-INFINITY);
  return scores;
}

// A hook that asks for the logsumexp gets it from the attention pass (the CPU's flash kernel) or formed apart
// (other devices) — either way SDPA's output unchanged and the logsumexp of exactly the entries each query
// attended: a first chunk (causal), a chunk after cached entries (cache + causal) and a single token (all),
// GQA (6 query heads over 2 KV heads), float32 and bfloat16, checked against the float64 formula.
TEST(AttendOverCache, HandsOutTheLogsumexpOfWhatEachQueryAttended) {
  std::vector<c10::Device> devices{c10::kCPU};
  if (load_cuda_kernels() && at::hasCUDA()) devices.emplace_back(c10::kCUDA);  // loading brings libtorch_cuda
  for (const c10::Device device : devices) {
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      const auto opts = at::TensorOptions().dtype(dtype).device(device);
      const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
      KVCache plain(1), asking(1);
      std::int64_t start = 0;
      for (const std::int64_t T : {5, 3, 1}) {
        AttentionCall call;
        call.q = at::randn({2, 6, T, 16}, opts);
        call.k = at::randn({2, 2, T, 16}, opts);
        call.v = at::randn({2, 2, T, 16}, opts);
        call.positions = at::arange(start, start + T, at::TensorOptions().dtype(at::kLong).device(device));
        AttentionCall with_lse = call;
        with_lse.wants_logsumexp = true;
        attend_over_cache(call, plain, nullptr);
        attend_over_cache(with_lse, asking, nullptr);
        const std::string where = std::string(device.str()) + " " + std::string(c10::toString(dtype)) + " T=" + std::to_string(T);
        EXPECT_FALSE(call.logsumexp.defined()) << where;  // nobody asked
        if (device.is_cpu())  // the very kernel SDPA runs: bit-identical, or SDPA picked another path
          EXPECT_TRUE(at::equal(with_lse.output, call.output)) << where;
        else
          EXPECT_LE(max_abs_diff(with_lse.output.to(at::kFloat), call.output.to(at::kFloat)), tol) << where;

        const std::int64_t N = start + T;
        const at::Tensor keys = asking.keys(0).repeat_interleave(3, 1);  // [2, 6, N, 16]
        // The logsumexp of the row's visible scores, from scores formed at `precision`.
        auto row_logsumexp = [&](at::ScalarType precision) {
          at::Tensor scores = at::matmul(call.q.to(precision), keys.to(precision).transpose(-1, -2)) / 4.0;  // [2, 6, T, N]
          for (std::int64_t t = 0; t < T; ++t) scores.narrow(2, t, 1).narrow(3, start + t + 1, N - start - t - 1).fill_(-INFINITY);
          return at::logsumexp(scores, -1, true).to(at::kDouble);
        };
        const at::Tensor want = row_logsumexp(at::kDouble);
        ASSERT_TRUE(with_lse.logsumexp.defined()) << where;
        EXPECT_EQ(with_lse.logsumexp.scalar_type(), at::kFloat) << where;
        EXPECT_EQ(with_lse.logsumexp.sizes(), want.sizes()) << where;
        // Within twice the error of the plain formula in the inputs' dtype (1e-5 at least): on a CPU without
        // native bf16 the kernel's bf16 path is ~5e-5 off, still far inside the plain bf16 formula's ~1e-2.
        const double plain_error = max_abs_diff(row_logsumexp(dtype), want);
        EXPECT_LE(max_abs_diff(with_lse.logsumexp.to(at::kDouble), want), std::max(1e-5, 2 * plain_error)) << where;
        plain.advance(T);
        asking.advance(T);
        start += T;
      }
    }
  }
}

// Inputs that carry a gradient (the latent memory's end-to-end loss) get a logsumexp that passes it on:
// d Σ lse / d q_t = Σ_j p_tj k_j / √D over the entries query t attended (float64 formula), on a chunk after
// cached entries, GQA, with the attention output still SDPA's.
TEST(AttendOverCache, LogsumexpCarriesTheGradientOfInputsThatNeedOne) {
  std::vector<c10::Device> devices{c10::kCPU};
  if (load_cuda_kernels() && at::hasCUDA()) devices.emplace_back(c10::kCUDA);
  for (const c10::Device device : devices) {
    const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
    KVCache cache(1);
    AttentionCall first;
    first.q = at::randn({2, 6, 4, 16}, opts);
    first.k = at::randn({2, 2, 4, 16}, opts);
    first.v = at::randn({2, 2, 4, 16}, opts);
    first.positions = at::arange(0, 4, at::TensorOptions().dtype(at::kLong).device(device));
    attend_over_cache(first, cache, nullptr);
    cache.advance(4);
    AttentionCall call;
    call.q = at::randn({2, 6, 3, 16}, opts).requires_grad_(true);
    call.k = at::randn({2, 2, 3, 16}, opts);
    call.v = at::randn({2, 2, 3, 16}, opts);
    call.positions = at::arange(4, 7, at::TensorOptions().dtype(at::kLong).device(device));
    call.wants_logsumexp = true;
    attend_over_cache(call, cache, nullptr);
    const std::string where = device.str();
    ASSERT_TRUE(call.logsumexp.requires_grad()) << where;
    call.logsumexp.sum().backward();

    const at::Tensor keys = cache.keys(0).to(at::kDouble).repeat_interleave(3, 1);  // [2, 6, 7, 16]
    const at::Tensor q = call.q.detach().to(at::kDouble);
    at::Tensor scores = at::matmul(q, keys.transpose(-1, -2)) / 4.0;  // [2, 6, 3, 7]
    for (std::int64_t t = 0; t < 3; ++t) scores.narrow(2, t, 1).narrow(3, 5 + t, 2 - t).fill_(-INFINITY);
    const at::Tensor want_grad = at::matmul(at::softmax(scores, -1), keys) / 4.0;
    EXPECT_LE(max_abs_diff(call.q.grad().to(at::kDouble), want_grad), 1e-5) << where;
    EXPECT_LE(max_abs_diff(call.logsumexp.detach().to(at::kDouble), at::logsumexp(scores, -1, true)), 1e-5) << where;
    const at::Tensor values = cache.values(0).to(at::kDouble).repeat_interleave(3, 1);
    EXPECT_LE(max_abs_diff(call.output.detach().to(at::kDouble), at::matmul(at::softmax(scores, -1), values)), 1e-5) << where;
  }
}

// A bfloat16 prefill of ≥ 192 queries on an AMX CPU (any on one with AVX512-BF16) takes ops/causal_attention_cpu: a first chunk and one after
// 192 cached entries, GQA, with and without the logsumexp — the output within the plain bfloat16 formula's
// error of the float64 one (as SDPA's is), the logsumexp [B, Hq, T, 1] float32 of what each query saw.
TEST(AttendOverCache, BFloat16PrefillChunksTakeTheAmxKernel) {
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  const at::Tensor probe = at::randn({1, 6, 192, 64}, bf16), probe_kv = at::randn({1, 2, 192, 64}, bf16);
  if (!ops::causal_attention_cpu_fits(probe, probe_kv, probe_kv))
    GTEST_SKIP() << "this CPU has neither AMX nor AVX512-BF16: the kernel never runs here";
  at::manual_seed(21);
  KVCache plain(1), asking(1);
  for (std::int64_t start = 0; start < 384; start += 192) {
    AttentionCall call;
    call.q = (at::randn({2, 6, 192, 64}) * 2).to(at::kBFloat16);
    call.k = at::randn({2, 2, 192, 64}, bf16);
    call.v = at::randn({2, 2, 192, 64}, bf16);
    call.positions = at::arange(start, start + 192, at::TensorOptions().dtype(at::kLong));
    AttentionCall with_lse = call;
    with_lse.wants_logsumexp = true;
    attend_over_cache(call, plain, nullptr);
    attend_over_cache(with_lse, asking, nullptr);
    const std::string where = "start " + std::to_string(start);
    EXPECT_FALSE(call.logsumexp.defined()) << where;
    EXPECT_TRUE(at::equal(with_lse.output, call.output)) << where;
    ASSERT_EQ(call.output.sizes(), call.q.sizes()) << where;
    const std::int64_t N = start + 192;
    const at::Tensor keys = asking.keys(0).repeat_interleave(3, 1), values = asking.values(0).repeat_interleave(3, 1);
    const auto scores_at = [&](at::ScalarType precision) { return chunk_scores(call.q, keys, start, precision); };
    const at::Tensor exact = at::matmul(at::softmax(scores_at(at::kDouble), -1), values.to(at::kDouble));
    const at::Tensor plain_bf16 = at::matmul(at::softmax(scores_at(at::kBFloat16), -1), values);
    EXPECT_LE(max_abs_diff(call.output.to(at::kDouble), exact), 2 * max_abs_diff(plain_bf16.to(at::kDouble), exact)) << where;
    const at::Tensor want_lse = at::logsumexp(scores_at(at::kDouble), -1, true);
    ASSERT_EQ(with_lse.logsumexp.sizes(), want_lse.sizes()) << where;
    EXPECT_EQ(with_lse.logsumexp.scalar_type(), at::kFloat) << where;
    const double plain_lse_error = max_abs_diff(at::logsumexp(scores_at(at::kBFloat16), -1, true).to(at::kDouble), want_lse);
    EXPECT_LE(max_abs_diff(with_lse.logsumexp.to(at::kDouble), want_lse), std::max(1e-4, 2 * plain_lse_error)) << where;
    plain.advance(192);
    asking.advance(192);
  }
}

// A float32 chunk takes ops/causal_attention_cpu only when the call says the backbone's products are bf16x3
// (AttentionCall::bf16x3): then within 32× the plain float32 formula's error of the float64 one, with its
// logsumexp; otherwise the float32 sgemm kernel's output. A first chunk of 192 queries and one after 192 cached
// entries.
TEST(AttendOverCache, Float32ChunksTakeTheAmxKernelOnlyUnderBf16x3) {
  const at::Tensor probe = at::randn({1, 6, 192, 64}), probe_kv = at::randn({1, 2, 192, 64});
  if (!ops::causal_attention_cpu_fits(probe, probe_kv, probe_kv))
    GTEST_SKIP() << "this CPU's oneDNN does not pack bfloat16 (no AMX): the tiles never run here";
  at::manual_seed(22);
  KVCache plain(1), tiles(1);
  for (std::int64_t start = 0; start < 384; start += 192) {
    AttentionCall call;
    call.q = at::randn({2, 6, 192, 64}) * 2;
    call.k = at::randn({2, 2, 192, 64});
    call.v = at::randn({2, 2, 192, 64});
    call.positions = at::arange(start, start + 192, at::TensorOptions().dtype(at::kLong));
    AttentionCall on_tiles = call;
    on_tiles.bf16x3 = true;
    on_tiles.wants_logsumexp = true;
    attend_over_cache(call, plain, nullptr);
    attend_over_cache(on_tiles, tiles, nullptr);
    const std::string where = "start " + std::to_string(start);
    const std::int64_t N = start + 192;
    const at::Tensor keys = tiles.keys(0).repeat_interleave(3, 1), values = tiles.values(0).repeat_interleave(3, 1);
    const auto scores_at = [&](at::ScalarType precision) { return chunk_scores(call.q, keys, start, precision); };
    const at::Tensor mask = scores_at(at::kFloat).isfinite();
    EXPECT_TRUE(at::equal(call.output, ops::causal_attention_float32(call.q, plain.keys(0), plain.values(0), nullptr))) << where;
    const at::Tensor exact = at::matmul(at::softmax(scores_at(at::kDouble), -1), values.to(at::kDouble));
    const at::Tensor plain_float = at::matmul(at::softmax(scores_at(at::kFloat), -1), values);
    const double error = max_abs_diff(on_tiles.output.to(at::kDouble), exact);
    EXPECT_GT(error, 0) << where;
    EXPECT_LE(error, 32 * max_abs_diff(plain_float.to(at::kDouble), exact)) << where;
    EXPECT_FALSE(at::equal(on_tiles.output, call.output)) << where << ": the kernel did not run";
    const at::Tensor want_lse = at::logsumexp(scores_at(at::kDouble), -1, true);
    ASSERT_EQ(on_tiles.logsumexp.sizes(), want_lse.sizes()) << where;
    const double plain_lse_error = max_abs_diff(at::logsumexp(scores_at(at::kFloat), -1, true).to(at::kDouble), want_lse);
    EXPECT_LE(max_abs_diff(on_tiles.logsumexp.to(at::kDouble), want_lse), 32 * plain_lse_error) << where;
    plain.advance(192);
    tiles.advance(192);
  }
}

// A float32 chunk of a float32 backbone takes ops/causal_attention_float32 from 96 queries on (any CPU): its
// output and logsumexp, within 4× the plain float32 formula's error of the float64 one; a shorter chunk SDPA's
// output, bit for bit. A first chunk of 96 queries, one of 95 after it, one of 128 after both.
TEST(AttendOverCache, Float32ChunksTakeTheSgemmKernelFrom96Queries) {
  at::manual_seed(23);
  KVCache cache(1);
  std::int64_t start = 0;
  for (const std::int64_t T : {96, 95, 128}) {
    AttentionCall call;
    call.q = at::randn({2, 6, T, 64}) * 2;
    call.k = at::randn({2, 2, T, 64});
    call.v = at::randn({2, 2, T, 64});
    call.positions = at::arange(start, start + T, at::TensorOptions().dtype(at::kLong));
    call.wants_logsumexp = true;
    attend_over_cache(call, cache, nullptr);
    const std::string where = "T " + std::to_string(T) + " after " + std::to_string(start);
    const at::Tensor keys = cache.keys(0).repeat_interleave(3, 1), values = cache.values(0).repeat_interleave(3, 1);
    const auto scores_at = [&](at::ScalarType precision) { return chunk_scores(call.q, keys, start, precision); };
    const at::Tensor sdpa = at::scaled_dot_product_attention(call.q, keys, values, scores_at(at::kFloat).isfinite());
    if (T < 96) {
      EXPECT_TRUE(at::equal(call.output, sdpa)) << where;
    } else {
      at::Tensor lse;
      EXPECT_TRUE(at::equal(call.output, ops::causal_attention_float32(call.q, cache.keys(0), cache.values(0), &lse))) << where;
      EXPECT_TRUE(at::equal(call.logsumexp, lse.unsqueeze(-1))) << where;
      EXPECT_FALSE(at::equal(call.output, sdpa)) << where << ": the kernel did not run";
    }
    const at::Tensor exact = at::matmul(at::softmax(scores_at(at::kDouble), -1), values.to(at::kDouble));
    const at::Tensor plain_float = at::matmul(at::softmax(scores_at(at::kFloat), -1), values);
    EXPECT_LE(max_abs_diff(call.output.to(at::kDouble), exact), 4 * max_abs_diff(plain_float.to(at::kDouble), exact)) << where;
    const at::Tensor want_lse = at::logsumexp(scores_at(at::kDouble), -1, true);
    const double plain_lse_error = max_abs_diff(at::logsumexp(scores_at(at::kFloat), -1, true).to(at::kDouble), want_lse);
    EXPECT_LE(max_abs_diff(call.logsumexp.to(at::kDouble), want_lse), std::max(1e-5, 4 * plain_lse_error)) << where;
    cache.advance(T);
    start += T;
  }
}

// Without AMX a bfloat16 chunk takes ops/causal_attention_cpu on VDPBF16PS where the CPU has AVX512-BF16, whatever
// its length; on a CPU without it, one of ≥ 96 queries takes ops/causal_attention_float32 (SDPA's bfloat16 kernel
// there converts every block for a float32 GEMM) and a shorter one SDPA. The kernel's output and logsumexp bit for
// bit, within 2× the plain bfloat16 formula's error of the float64 one. A first chunk of 96 queries, one of 95 after it.
TEST(AttendOverCache, BFloat16ChunksWithoutAmxTakeVdpbf16psElseTheSgemmKernel) {
  if (ops::amx::bf16_available()) GTEST_SKIP() << "this CPU has AMX: its bfloat16 chunks take the tiles (tested above)";
  const bool dot = ops::bf16_dot::available();
  at::manual_seed(24);
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  KVCache cache(1);
  std::int64_t start = 0;
  for (const std::int64_t T : {96, 95}) {
    AttentionCall call;
    call.q = (at::randn({2, 6, T, 64}) * 2).to(at::kBFloat16);
    call.k = at::randn({2, 2, T, 64}, bf16);
    call.v = at::randn({2, 2, T, 64}, bf16);
    call.positions = at::arange(start, start + T, at::TensorOptions().dtype(at::kLong));
    call.wants_logsumexp = true;
    attend_over_cache(call, cache, nullptr);
    const std::string where = "T " + std::to_string(T) + " after " + std::to_string(start);
    const at::Tensor keys = cache.keys(0).repeat_interleave(3, 1), values = cache.values(0).repeat_interleave(3, 1);
    const auto scores_at = [&](at::ScalarType precision) { return chunk_scores(call.q, keys, start, precision); };
    const at::Tensor sdpa = at::scaled_dot_product_attention(call.q, keys, values, scores_at(at::kFloat).isfinite());
    if (T < 96 && !dot) {
      EXPECT_TRUE(at::equal(call.output, sdpa)) << where;
    } else {
      at::Tensor lse;
      const auto kernel = dot ? &ops::causal_attention_cpu : &ops::causal_attention_float32;
      EXPECT_TRUE(at::equal(call.output, kernel(call.q, cache.keys(0), cache.values(0), &lse))) << where;
      EXPECT_TRUE(at::equal(call.logsumexp, lse.unsqueeze(-1))) << where;
      const at::Tensor exact = at::matmul(at::softmax(scores_at(at::kDouble), -1), values.to(at::kDouble));
      const at::Tensor plain_bf16 = at::matmul(at::softmax(scores_at(at::kBFloat16), -1), values);
      EXPECT_LE(max_abs_diff(call.output.to(at::kDouble), exact), 2 * max_abs_diff(plain_bf16.to(at::kDouble), exact)) << where;
    }
    cache.advance(T);
    start += T;
  }
}

// A pooled budget leaves the heads of a layer with different numbers of entries (KVCache::retain with `live`): the
// padding slots are never attended and the others are, for each query as if its head held only its own entries
// (float64 reference per head), in float32 and bfloat16, with and without the logsumexp.
TEST(AttendOverCache, PaddingSlotsAreNeverAttended) {
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (const bool wants_lse : {false, true}) {
      const auto opts = at::TensorOptions().dtype(dtype);
      KVCache cache(1);
      AttentionCall first;
      first.q = at::randn({1, 6, 10, 16}, opts);
      first.k = at::randn({1, 2, 10, 16}, opts);
      first.v = at::randn({1, 2, 10, 16}, opts);
      first.positions = at::arange(0, 10, at::kLong);
      attend_over_cache(first, cache, nullptr);
      cache.advance(10);
      // Head 0 keeps 7 entries, head 1 keeps 3 (then 4 padding slots).
      const at::Tensor index = at::tensor({0, 1, 2, 4, 6, 8, 9, 3, 5, 9, 0, 0, 0, 0}, at::kLong).view({1, 2, 7});
      const at::Tensor live = at::arange(7, at::kLong).view({1, 1, 7}) < at::tensor({7, 3}, at::kLong).view({1, 2, 1});
      cache.retain(0, index, live);
      ASSERT_TRUE(cache.padded(0));
      EXPECT_TRUE(at::equal(cache.live_entries(0), at::tensor({7, 3}, at::kLong).view({1, 2})));
      const at::Tensor kept_k = cache.keys(0).clone(), kept_v = cache.values(0).clone();
      AttentionCall call;
      call.q = at::randn({1, 6, 3, 16}, opts);
      call.k = at::randn({1, 2, 3, 16}, opts);
      call.v = at::randn({1, 2, 3, 16}, opts);
      call.positions = at::arange(10, 13, at::kLong);
      call.wants_logsumexp = wants_lse;
      attend_over_cache(call, cache, nullptr);
      const std::string where = std::string(c10::toString(dtype)) + (wants_lse ? " with lse" : "");
      for (std::int64_t h = 0; h < 6; ++h) {
        const std::int64_t g = h / 3, kept = g == 0 ? 7 : 3;
        const at::Tensor keys = at::cat({kept_k[0][g].narrow(0, 0, kept), call.k[0][g]}).to(at::kDouble);
        const at::Tensor values = at::cat({kept_v[0][g].narrow(0, 0, kept), call.v[0][g]}).to(at::kDouble);
        at::Tensor scores = at::matmul(call.q[0][h].to(at::kDouble), keys.t()) / 4.0;  // [3, kept + 3]
        for (std::int64_t t = 0; t < 3; ++t) scores[t].narrow(0, kept + t + 1, 2 - t).fill_(-INFINITY);
        const at::Tensor expected = at::matmul(at::softmax(scores, -1), values);
        const double tol = dtype == at::kFloat ? 1e-5 : 3e-2;
        EXPECT_LE(max_abs_diff(call.output[0][h].to(at::kDouble), expected), tol) << where << " head " << h;
        if (wants_lse)
          EXPECT_LE(max_abs_diff(call.logsumexp[0][h].squeeze(-1).to(at::kDouble), at::logsumexp(scores, -1)), tol)
              << where << " head " << h;
      }
    }
  }
}

}  // namespace
