#include "ops/causal_attention_float32.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "ops/amx_panels.h"
#include "ops/prefill_attention_operands.h"
#include "ops/cpu_vector.h"

// The Fortran BLAS sgemm that libtorch_cpu exports (MKL's in the torch wheel, 32-bit integers: LP64). ATen's
// own float32 cpublas::gemm is not exported, and an at::mm per block would cost a dispatch per product.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace kvbound::ops {
namespace {

// Column-major C [m, n] = op(A) · B with op(A) = A or Aᵀ, on one thread of the caller (MKL keeps to one inside
// an OpenMP parallel region).
void sgemm(bool transpose_a, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
           float* c, int64_t ldc) {
  const char ta = transpose_a ? 'T' : 'N', tb = 'N';
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  const int la = static_cast<int>(lda), lb = static_cast<int>(ldb), lc = static_cast<int>(ldc);
  const float one = 1.f, zero = 0.f;
  sgemm_(&ta, &tb, &mi, &ni, &ki, &one, a, &la, b, &lb, &zero, c, &lc);
}

constexpr int64_t kQueryBlock = 64;
constexpr int64_t kMaxKeys = 4096;
constexpr int64_t kMaxHeadDim = 256;
// Score rows per task (a GQA group's heads × a block of queries): up to 256, so a task's scores stay ~4 MiB at
// 4096 keys whatever the group size.
constexpr int64_t kMaxRows = 256;
// Below this many queries SDPA's kernel was as fast or faster (bench_cpu_attention, float32, 2 threads).
constexpr int64_t kMinQueries = 96;
constexpr int kLanes = 16;

// One score row s [visible rounded up to 16 lanes, within the buffer's stride] in place: s[k] = e^(scale·s[k] − m)
// with m = scale·max s for k < visible, 0 for visible ≤ k < width. Returns m and Σ e, summed in
// ops/cpu_vector.h's fixed order. The row is padded with −∞ to whole 16-lane chunks first (their weight is 0),
// so no loop has a scalar tail.
KVBOUND_VECTOR_CLONES void softmax_row(float* s, int64_t visible, int64_t width, float scale, float& row_max,
                                       float& row_sum) {
  const int64_t chunked = (visible + kLanes - 1) / kLanes * kLanes;
  std::fill(s + visible, s + chunked, -std::numeric_limits<float>::infinity());
  // 16 running maxima, then one: a `reduction(max)` loop stays scalar here, one dependent max per key.
  float lane[kLanes];
  std::fill_n(lane, kLanes, -std::numeric_limits<float>::infinity());
  for (int64_t k = 0; k < chunked; k += kLanes)
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) lane[j] = lane[j] < s[k + j] ? s[k + j] : lane[j];
  const float max = *std::max_element(lane, lane + kLanes);
  const float log2_scale = scale * 1.44269504088896341f, shift = max * log2_scale;
#pragma omp simd
  for (int64_t k = 0; k < chunked; ++k) s[k] = cpu::exp2_nonpositive(s[k] * log2_scale - shift);
  row_sum = cpu::fixed_order_sum(chunked, [s](int64_t k) { return s[k]; });
  if (chunked < width) std::fill(s + chunked, s + width, 0.f);
  row_max = max * scale;
}

KVBOUND_VECTOR_CLONES void write_row(const float* o, float inv_sum, int64_t D, float* out) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) out[d] = o[d] * inv_sum;
}

KVBOUND_VECTOR_CLONES void write_row(const float* o, float inv_sum, int64_t D, uint16_t* out) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) out[d] = cpu::float_to_bf16(o[d] * inv_sum);
}

void widen_row(const float* in, int64_t D, float* out) { std::copy_n(in, D, out); }

KVBOUND_VECTOR_CLONES void widen_row(const uint16_t* in, int64_t D, float* out) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) out[d] = cpu::bf16_to_float(in[d]);
}

// The float32 operands of the products: K or V as they are, or a bfloat16 cache's [B, Hkv, N, D] widened once per
// call (every query block of a head reads all of it) into a contiguous float32 copy.
at::Tensor float32_operand(const at::Tensor& x) {
  if (x.scalar_type() == at::kFloat) return x;
  const at::Tensor wide = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  const int64_t Hkv = x.size(1), N = x.size(2), D = x.size(3);
  const auto* in = static_cast<const uint16_t*>(x.const_data_ptr());
  float* out = wide.mutable_data_ptr<float>();
  at::parallel_for(0, x.size(0) * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh)
      for (int64_t n = 0; n < N; ++n)
        widen_row(in + (bh / Hkv) * x.stride(0) + (bh % Hkv) * x.stride(1) + n * x.stride(2), D,
                  out + (bh * N + n) * D);
  });
  return wide;
}

// scalar_t: float, or uint16_t for bfloat16 q and output (K and V arrive widened).
template <typename scalar_t>
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, at::Tensor* logsumexp) {
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = keys.size(1), N = keys.size(2), G = Hq / Hkv, cached = N - T;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  // Queries per task: 64, fewer for large groups (G·queries ≤ 256 score rows); 1 for a group of more than 256.
  const int64_t queries = std::max<int64_t>(1, std::min<int64_t>(kQueryBlock, kMaxRows / G));
  const int64_t query_blocks = (T + queries - 1) / queries, max_rows = G * queries;
  // Row stride of the scores: the widest row rounded up to whole lanes, plus 16 so rows do not share cache sets.
  const int64_t score_stride = (N + kLanes - 1) / kLanes * kLanes + kLanes;

  const at::Tensor out = at::empty({B, T, Hq, D}, q.options());  // [B, Hq, T, D] through the transpose below
  at::Tensor lse = logsumexp ? at::empty({B, Hq, T}, q.options().dtype(at::kFloat)) : at::Tensor();
  const auto* q_data = static_cast<const scalar_t*>(q.const_data_ptr());
  const float* k_data = keys.const_data_ptr<float>();
  const float* v_data = values.const_data_ptr<float>();
  auto* out_data = static_cast<scalar_t*>(out.mutable_data_ptr());
  float* lse_data = logsumexp ? lse.mutable_data_ptr<float>() : nullptr;

  at::parallel_for(0, B * Hkv * query_blocks, 1, [&](int64_t begin, int64_t end) {
    // Per task: the group's queries as one [G·queries, D] block, its scores (then weights) and weighted values
    // (uninitialised: every entry a task reads it has written).
    const auto rows_of = [&](int64_t n) { return static_cast<size_t>(max_rows * n); };
    const std::unique_ptr<float[]> q_rows(new float[rows_of(D)]), scores(new float[rows_of(score_stride)]),
        acc(new float[rows_of(D)]);
    std::vector<float> row_max(static_cast<size_t>(max_rows)), row_sum(static_cast<size_t>(max_rows));
    for (int64_t task = begin; task < end; ++task) {
      // A block's cost grows with its keys; taking a head's blocks first, last, second, second to last, …
      // gives each thread's contiguous range of tasks a like share of cheap and dear ones.
      const int64_t bh = task / query_blocks, b = bh / Hkv, h = bh % Hkv, p = task % query_blocks;
      const int64_t s0 = (p % 2 == 0 ? p / 2 : query_blocks - 1 - p / 2) * queries;
      const int64_t qn = std::min(queries, T - s0), rows = G * qn;
      for (int64_t g = 0; g < G; ++g) {
        const scalar_t* head = q_data + b * q.stride(0) + (h * G + g) * q.stride(1) + s0 * q.stride(2);
        for (int64_t t = 0; t < qn; ++t) widen_row(head + t * q.stride(2), D, q_rows.get() + (g * qn + t) * D);
      }
      // The block's last query sees cached + s0 + qn keys; earlier rows mask the rest of that width.
      const int64_t width = cached + s0 + qn;
      const float* k_head = k_data + b * keys.stride(0) + h * keys.stride(1);
      const float* v_head = v_data + b * values.stride(0) + h * values.stride(1);
      // Row-major scores [rows, width] = Q [rows, D] · Kᵀ, as the column-major BLAS product Sᵀ = K · Qᵀ.
      sgemm(true, width, rows, D, k_head, keys.stride(2), q_rows.get(), D, scores.get(), score_stride);
      for (int64_t r = 0; r < rows; ++r)
        softmax_row(scores.get() + r * score_stride, cached + s0 + r % qn + 1, width, scale,
                    row_max[static_cast<size_t>(r)], row_sum[static_cast<size_t>(r)]);
      // Row-major acc [rows, D] = P [rows, width] · V [width, D], as accᵀ = Vᵀ · Pᵀ.
      sgemm(false, D, rows, width, v_head, values.stride(2), scores.get(), score_stride, acc.get(), D);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t g = r / qn, t = s0 + r % qn, head = h * G + g;
        write_row(acc.get() + r * D, 1.f / row_sum[static_cast<size_t>(r)], D, out_data + ((b * T + t) * Hq + head) * D);
        if (lse_data)
          lse_data[(b * Hq + head) * T + t] = row_max[static_cast<size_t>(r)] + std::log(row_sum[static_cast<size_t>(r)]);
      }
    }
  });
  if (logsumexp) *logsumexp = lse;
  return out.transpose(1, 2);
}

}  // namespace

bool causal_attention_float32_supported(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values) {
  const int64_t D = q.dim() == 4 ? q.size(3) : 0;
  return D >= 1 && D <= kMaxHeadDim && prefill_attention_operands(q, keys, values, kMaxKeys);
}

bool causal_attention_float32_fits(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values) {
  // On AMX, SDPA's bfloat16 products already run on the tiles: a bfloat16 chunk too short for ours stays with it.
  if (q.dim() == 4 && q.scalar_type() == at::kBFloat16 && amx::bf16_available()) return false;
  return q.dim() == 4 && q.size(2) >= kMinQueries && causal_attention_float32_supported(q, keys, values);
}

at::Tensor causal_attention_float32(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                    at::Tensor* logsumexp) {
  TORCH_CHECK(causal_attention_float32_supported(q, keys, values), "causal_attention_float32: inputs outside its path");
  const at::Tensor k32 = float32_operand(keys), v32 = float32_operand(values);
  return q.scalar_type() == at::kFloat ? attend<float>(q, k32, v32, logsumexp) : attend<uint16_t>(q, k32, v32, logsumexp);
}

}  // namespace kvbound::ops
