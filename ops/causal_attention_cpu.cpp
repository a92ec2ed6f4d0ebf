#include "ops/causal_attention_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "ops/amx_panels.h"
#include "ops/cpu_vector.h"

namespace kvbound::ops {
namespace {

namespace cpublas = at::native::cpublas;
using Bits = uint16_t;  // bfloat16 as its bits; the cpublas calls take at::BFloat16

// Keys per packed panel of Kᵀ and per packed block of V, columns per packed slice of V.
constexpr int64_t kBlock = amx::kPanel;
constexpr int64_t kMinQueries = 192;  // below it SDPA's kernel was as fast or faster (bench_cpu_attention)
constexpr int64_t kMaxKeys = 4096;
// Score rows per task (a GQA group's heads × a block of queries): up to 256, so a task's scores stay ~4 MiB at
// 4096 keys whatever the group size. Their row stride is fixed, so the score product's micro-kernel (oneDNN
// generates one per shape and leading dimensions, and keeps it) is the same for every block and call.
constexpr int64_t kMaxRows = 256;
constexpr int64_t kScoreStride = kMaxKeys + 16;  // not a power of two: rows do not share cache sets

const at::BFloat16* as_bf16(const Bits* p) { return reinterpret_cast<const at::BFloat16*>(p); }

// One head's values [N, D] as, per 64 columns of D, blocks of 64 keys [64, 64] in the packed layout (rows past N
// zero: their weights are zero too). The layout interleaves pairs of keys, so a slice's blocks side by side are
// the packing of all its keys at once: one brgemm call reads any prefix of whole blocks (the tests hold it).
void pack_values(const Bits* values, int64_t ld, int64_t N, int64_t D, Bits* packed, std::vector<Bits>& scratch) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  scratch.assign(static_cast<size_t>(kBlock * kBlock), 0);
  for (int64_t c = 0; c < D; c += kBlock)
    for (int64_t j0 = 0; j0 < N; j0 += kBlock) {
      const int64_t n = std::min(kBlock, N - j0);
      if (n < kBlock) std::fill(scratch.begin(), scratch.end(), Bits{0});
      for (int64_t j = 0; j < n; ++j)
        std::copy_n(values + (j0 + j) * ld + c, kBlock, scratch.data() + j * kBlock);
      cpublas::pack(kBlock, kBlock, kBlock, kBlock, at::kBFloat16, at::kBFloat16, scratch.data(),
                    packed + ((c / kBlock) * blocks + j0 / kBlock) * kBlock * kBlock);
    }
}

// One score row s [width] in place: for k < visible, p[k] = bfloat16(e^(scale·s[k] − m)) with m = scale·max s;
// p[k] = 0 for visible ≤ k < width. Returns m and Σ e in float32, summed in ops/cpu_vector.h's fixed order.
// The row is padded with −∞ to whole 16-lane chunks first (every key's weight there is 0), so no loop has a
// scalar tail: rows average a few hundred keys, and a tail cost as much as a tenth of the row.
KVBOUND_VECTOR_CLONES void softmax_row(float* s, Bits* p, int64_t visible, int64_t width, float scale,
                                        float& row_max, float& row_sum) {
  constexpr int kLanes = 16;
  const int64_t chunked = (visible + kLanes - 1) / kLanes * kLanes;  // ≤ width (a multiple of 64)
  std::fill(s + visible, s + chunked, -std::numeric_limits<float>::infinity());
  // 16 running maxima, then one: a `reduction(max)` loop stays scalar here, one dependent max per key.
  float lane[kLanes];
  std::fill_n(lane, kLanes, -std::numeric_limits<float>::infinity());
  for (int64_t k = 0; k < chunked; k += kLanes)
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) lane[j] = lane[j] < s[k + j] ? s[k + j] : lane[j];
  const float max = *std::max_element(lane, lane + kLanes);
  const float log2_scale = scale * 1.44269504088896341f, shift = max * log2_scale;
  // e alone in its loop: beside the sum and the conversion GCC vectorizes it worse (measured 1.5x slower).
#pragma omp simd
  for (int64_t k = 0; k < chunked; ++k) s[k] = cpu::exp2_nonpositive(s[k] * log2_scale - shift);
  row_sum = cpu::fixed_order_sum(chunked, [s, p](int64_t k) {
    p[k] = cpu::float_to_bf16(s[k]);
    return s[k];
  });
  std::fill(p + chunked, p + width, Bits{0});
  row_max = max * scale;
}

KVBOUND_VECTOR_CLONES void write_row(const float* o, float inv_sum, int64_t D, Bits* out) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) out[d] = cpu::float_to_bf16(o[d] * inv_sum);
}

}  // namespace

bool causal_attention_cpu_supported(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values) {
  if (!q.is_cpu() || !keys.is_cpu() || !values.is_cpu() || q.scalar_type() != at::kBFloat16 ||
      keys.scalar_type() != at::kBFloat16 || values.scalar_type() != at::kBFloat16 || q.dim() != 4 ||
      keys.dim() != 4 || values.sizes() != keys.sizes())
    return false;
  const int64_t D = q.size(3), T = q.size(2), N = keys.size(2), Hkv = keys.size(1);
  if ((D != 64 && D != 128) || keys.size(3) != D || keys.size(0) != q.size(0) || Hkv < 1 || q.size(1) % Hkv != 0 ||
      T < 1 || N < T || N > kMaxKeys)
    return false;
  if (q.stride(3) != 1 || keys.stride(3) != 1 || values.stride(3) != 1) return false;
  if (at::GradMode::is_enabled() && (q.requires_grad() || keys.requires_grad() || values.requires_grad())) return false;
  return amx::bf16_available();
}

bool causal_attention_cpu_fits(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values) {
  return q.dim() == 4 && q.size(2) >= kMinQueries && causal_attention_cpu_supported(q, keys, values);
}

at::Tensor causal_attention_cpu(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                at::Tensor* logsumexp) {
  TORCH_CHECK(causal_attention_cpu_supported(q, keys, values), "causal_attention_cpu: inputs outside its fast path");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = keys.size(1), N = keys.size(2), G = Hq / Hkv, cached = N - T;
  const int64_t key_blocks = (N + kBlock - 1) / kBlock, padded = key_blocks * kBlock;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  // Queries per task: 64, fewer for large groups (G·queries ≤ 256 score rows); 1 for a group of more than 256.
  const int64_t queries = std::max<int64_t>(1, std::min<int64_t>(kBlock, kMaxRows / G));

  // K and V packed once per (row, KV head): every query head of the group and every query block reads them.
  const auto bits = q.options().dtype(at::kBFloat16);
  const at::Tensor packed_k = at::empty({B, Hkv, padded * D}, bits), packed_v = at::empty({B, Hkv, padded * D}, bits);
  const auto* k_data = static_cast<const Bits*>(keys.const_data_ptr());
  const auto* v_data = static_cast<const Bits*>(values.const_data_ptr());
  auto* pk = static_cast<Bits*>(packed_k.mutable_data_ptr());
  auto* pv = static_cast<Bits*>(packed_v.mutable_data_ptr());
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<Bits> scratch;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hkv, h = bh % Hkv;
      // Kᵀ in panels of 64 keys, keys past N zero (masked out of every score row).
      amx::pack_transposed_panels(k_data + b * keys.stride(0) + h * keys.stride(1), keys.stride(2), N, D,
                                  pk + bh * padded * D);
      pack_values(v_data + b * values.stride(0) + h * values.stride(1), values.stride(2), N, D, pv + bh * padded * D,
                  scratch);
    }
  });

  const at::Tensor out = at::empty({B, T, Hq, D}, bits);  // [B, Hq, T, D] through the transpose below
  at::Tensor lse = logsumexp ? at::empty({B, Hq, T}, q.options().dtype(at::kFloat)) : at::Tensor();
  const auto* q_data = static_cast<const Bits*>(q.const_data_ptr());
  auto* out_data = static_cast<Bits*>(out.mutable_data_ptr());
  float* lse_data = logsumexp ? lse.mutable_data_ptr<float>() : nullptr;
  const int64_t query_blocks = (T + queries - 1) / queries, max_rows = G * queries;

  at::parallel_for(0, B * Hkv * query_blocks, 1, [&](int64_t begin, int64_t end) {
    // Per task: the group's queries as one [G·queries, D] block, its scores, weights and weighted values
    // (uninitialised: every entry a task reads it has written).
    const auto rows_of = [&](int64_t n) { return static_cast<size_t>(max_rows * n); };
    const std::unique_ptr<Bits[]> q_rows(new Bits[rows_of(D)]), weights(new Bits[rows_of(padded)]);
    const std::unique_ptr<float[]> scores(new float[rows_of(kScoreStride)]), acc(new float[rows_of(D)]);
    std::vector<float> row_max(static_cast<size_t>(max_rows)), row_sum(static_cast<size_t>(max_rows));
    for (int64_t task = begin; task < end; ++task) {
      // A block's cost grows with its keys; taking a head's blocks first, last, second, second to last, …
      // gives each thread's contiguous range of tasks a like share of cheap and dear ones.
      const int64_t bh = task / query_blocks, b = bh / Hkv, h = bh % Hkv, p = task % query_blocks;
      const int64_t s0 = (p % 2 == 0 ? p / 2 : query_blocks - 1 - p / 2) * queries;
      const int64_t qn = std::min(queries, T - s0), rows = G * qn;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < qn; ++t)
          std::copy_n(q_data + b * q.stride(0) + (h * G + g) * q.stride(1) + (s0 + t) * q.stride(2), D,
                      q_rows.get() + (g * qn + t) * D);
      // The block's last query sees cached + s0 + qn keys; earlier rows mask the rest of that width.
      const int64_t blocks = (cached + s0 + qn + kBlock - 1) / kBlock, width = blocks * kBlock;
      amx::multiply_panels(q_rows.get(), rows, D, D, pk + bh * padded * D, 0, blocks, scores.get(), kScoreStride);
      for (int64_t r = 0; r < rows; ++r)
        softmax_row(scores.get() + r * kScoreStride, weights.get() + r * width, cached + s0 + r % qn + 1, width,
                    scale, row_max[static_cast<size_t>(r)], row_sum[static_cast<size_t>(r)]);
      for (int64_t c = 0; c < D; c += kBlock)
        cpublas::brgemm(rows, kBlock, width, width, kBlock, D, false, as_bf16(weights.get()),
                        as_bf16(pv + bh * padded * D + (c / kBlock) * key_blocks * kBlock * kBlock), acc.get() + c);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t g = r / qn, t = s0 + r % qn, head = h * G + g;
        write_row(acc.get() + r * D, 1.f / row_sum[static_cast<size_t>(r)], D, out_data + ((b * T + t) * Hq + head) * D);
        if (lse_data)
          lse_data[(b * Hq + head) * T + t] = row_max[static_cast<size_t>(r)] + std::log(row_sum[static_cast<size_t>(r)]);
      }
    }
    amx::release();
  });
  if (logsumexp) *logsumexp = lse;
  return out.transpose(1, 2);
}

}  // namespace kvbound::ops
