#include "ops/causal_attention_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "ops/prefill_attention_operands.h"
#include "ops/amx_panels.h"
#include "ops/bf16_dot_panels.h"
#include "ops/bf16_product_engine.h"
#include "ops/bf16x3_linear.h"
#include "ops/cpu_vector.h"

namespace kvbound::ops {
namespace {

namespace cpublas = at::native::cpublas;
using Bits = uint16_t;  // bfloat16 as its bits; the cpublas calls take at::BFloat16

// Keys per packed panel of Kᵀ and per packed block of V, columns per packed slice of V.
constexpr int64_t kBlock = amx::kPanel;
// Below these query counts SDPA's kernel was as fast or faster (bench_cpu_attention, bfloat16 and float32).
constexpr int64_t kMinQueriesBf16 = 192;
// VDPBF16PS (no AMX) was the faster at every chunk measured, a single query included (see the header).
constexpr int64_t kMinQueriesBf16Dot = 1;
constexpr int64_t kMinQueriesFloat32 = 128;
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

// One score row s [width] in place: for k < visible, p[k] = e^(scale·s[k] − m) with m = scale·max s, as bfloat16
// (p_hi) or, with kSplit, as the sum of two (p_hi + p_lo, bf16x3's split); p[k] = 0 for visible ≤ k < width.
// Returns m and Σ e in float32, summed in ops/cpu_vector.h's fixed order. The row is padded with −∞ to whole
// 16-lane chunks first (every key's weight there is 0), so no loop has a scalar tail: rows average a few hundred
// keys, and a tail cost as much as a tenth of the row.
template <bool kSplit>
KVBOUND_VECTOR_CLONES void softmax_row(float* s, Bits* p_hi, Bits* p_lo, int64_t visible, int64_t width, float scale,
                                        float& row_max, float& row_sum) {
  constexpr int kLanes = 16;
  const int64_t chunked = (visible + kLanes - 1) / kLanes * kLanes;  // ≤ width (a multiple of 64)
  std::fill(s + visible, s + chunked, -std::numeric_limits<float>::infinity());
  const float max = cpu::running_max(s, chunked);
  const float log2_scale = scale * 1.44269504088896341f, shift = max * log2_scale;
  // e alone in its loop: beside the sum and the conversion GCC vectorizes it worse (measured 1.5x slower).
#pragma omp simd
  for (int64_t k = 0; k < chunked; ++k) s[k] = cpu::exp2_nonpositive(s[k] * log2_scale - shift);
  if constexpr (kSplit) {
    row_sum = cpu::fixed_order_sum(chunked, [s, p_hi, p_lo](int64_t k) {
      const Bits hi = cpu::float_to_bf16(s[k]);
      p_hi[k] = hi;
      p_lo[k] = cpu::float_to_bf16(s[k] - cpu::bf16_to_float(hi));
      return s[k];
    });
    std::fill(p_lo + chunked, p_lo + width, Bits{0});
  } else {
    row_sum = cpu::fixed_order_sum(chunked, [s, p_hi](int64_t k) {
      p_hi[k] = cpu::float_to_bf16(s[k]);
      return s[k];
    });
  }
  std::fill(p_hi + chunked, p_hi + width, Bits{0});
  row_max = max * scale;
}

KVBOUND_VECTOR_CLONES void write_row(const float* o, float inv_sum, int64_t D, Bits* out) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) out[d] = cpu::float_to_bf16(o[d] * inv_sum);
}

KVBOUND_VECTOR_CLONES void write_row(const float* o, float inv_sum, int64_t D, float* out) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) out[d] = o[d] * inv_sum;
}

// One head's values [N, D] as Vᵀ for VDPBF16PS (ops/bf16_dot_panels.h), per 64 columns of D a panel of depth
// `padded` keys ([padded / 2][64][2]: a pair of keys per dot), keys past N zero: any prefix of whole 64-key blocks
// is then the depth of a product over those keys.
void pack_values_transposed(const Bits* values, int64_t ld, int64_t N, int64_t D, int64_t padded, Bits* packed) {
  std::fill_n(packed, padded * D, Bits{0});
  for (int64_t c = 0; c < D; c += kBlock) {
    Bits* panel = packed + (c / kBlock) * padded * kBlock;
    for (int64_t key = 0; key < N; ++key) {
      Bits* pair = panel + (key / 2) * 2 * kBlock + key % 2;
      const Bits* row = values + key * ld + c;
      for (int64_t n = 0; n < kBlock; ++n) pair[2 * n] = row[n];
    }
  }
}

// A matrix in bfloat16 tile operands: `hi` alone for bfloat16 inputs (one pass per product), hi and lo for float32
// ones (bf16x3: the products hi·hi + lo·hi + hi·lo, ops/bf16x3_linear.h).
struct Split {
  Bits* hi;
  Bits* lo;  // null for bfloat16 inputs
};

// `rows` [n, D] (row stride ld) as tile operands, into `out` [n, D] (unit stride): bfloat16 rows are copied;
// float32 rows are split.
void to_operands(const Bits* rows, int64_t ld, int64_t n, int64_t D, Split out) {
  for (int64_t r = 0; r < n; ++r) std::copy_n(rows + r * ld, D, out.hi + r * D);
}
void to_operands(const float* rows, int64_t ld, int64_t n, int64_t D, Split out) {
  for (int64_t r = 0; r < n; ++r) split_row(rows + r * ld, D, D, out.hi + r * D, out.lo + r * D);
}

// The kernel, for bfloat16 (Element = Bits) or float32 (Element = float, its products as bf16x3).
template <typename Element>
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, at::Tensor* logsumexp) {
  constexpr bool kSplit = std::is_same_v<Element, float>;
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = keys.size(1), N = keys.size(2), G = Hq / Hkv, cached = N - T;
  const int64_t key_blocks = (N + kBlock - 1) / kBlock, padded = key_blocks * kBlock;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  // Queries per task: 64, fewer for large groups (G·queries ≤ 256 score rows); 1 for a group of more than 256.
  const int64_t queries = std::max<int64_t>(1, std::min<int64_t>(kBlock, kMaxRows / G));
  const int64_t parts = kSplit ? 2 : 1;  // tile operands per matrix: hi (and lo)
  // The products' engine (ops/bf16_product_engine.h): AMX tiles, else (bfloat16 alone) VDPBF16PS, whose packings
  // of Kᵀ and V differ from oneDNN's.
  const bool tiles = bf16_product_engine() == Bf16ProductEngine::kTiles;

  // K and V packed once per (row, KV head): every query head of the group and every query block reads them.
  const auto bits = q.options().dtype(at::kBFloat16);
  const at::Tensor packed_k = at::empty({parts, B * Hkv, padded * D}, bits);
  const at::Tensor packed_v = at::empty({parts, B * Hkv, padded * D}, bits);
  const auto* k_data = static_cast<const Element*>(keys.const_data_ptr());
  const auto* v_data = static_cast<const Element*>(values.const_data_ptr());
  auto* pk = static_cast<Bits*>(packed_k.mutable_data_ptr());
  auto* pv = static_cast<Bits*>(packed_v.mutable_data_ptr());
  const int64_t part_stride = B * Hkv * padded * D;
  const auto packed = [&](Bits* base, int64_t bh) {
    return Split{base + bh * padded * D, kSplit ? base + part_stride + bh * padded * D : nullptr};
  };
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<Bits> scratch, hi(kSplit ? static_cast<size_t>(N * D) : 0), lo(hi.size());
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hkv, h = bh % Hkv;
      const Element* k_head = k_data + b * keys.stride(0) + h * keys.stride(1);
      const Element* v_head = v_data + b * values.stride(0) + h * values.stride(1);
      const Split k_out = packed(pk, bh), v_out = packed(pv, bh);
      // Kᵀ in panels of 64 keys, keys past N zero (masked out of every score row); bfloat16 rows packed where
      // they lie, float32 rows split into hi and lo first.
      if constexpr (kSplit) {
        to_operands(k_head, keys.stride(2), N, D, Split{hi.data(), lo.data()});
        amx::pack_transposed_panels(hi.data(), D, N, D, k_out.hi);
        amx::pack_transposed_panels(lo.data(), D, N, D, k_out.lo);
        to_operands(v_head, values.stride(2), N, D, Split{hi.data(), lo.data()});
        pack_values(hi.data(), D, N, D, v_out.hi, scratch);
        pack_values(lo.data(), D, N, D, v_out.lo, scratch);
      } else if (tiles) {
        amx::pack_transposed_panels(k_head, keys.stride(2), N, D, k_out.hi);
        pack_values(v_head, values.stride(2), N, D, v_out.hi, scratch);
      } else {
        bf16_dot::pack_transposed_panels(k_head, keys.stride(2), N, D, k_out.hi);
        pack_values_transposed(v_head, values.stride(2), N, D, padded, v_out.hi);
      }
    }
  });

  const at::Tensor out = at::empty({B, T, Hq, D}, q.options());  // [B, Hq, T, D] through the transpose below
  at::Tensor lse = logsumexp ? at::empty({B, Hq, T}, q.options().dtype(at::kFloat)) : at::Tensor();
  const auto* q_data = static_cast<const Element*>(q.const_data_ptr());
  auto* out_data = static_cast<Element*>(out.mutable_data_ptr());
  float* lse_data = logsumexp ? lse.mutable_data_ptr<float>() : nullptr;
  const int64_t query_blocks = (T + queries - 1) / queries, max_rows = G * queries;

  at::parallel_for(0, B * Hkv * query_blocks, 1, [&](int64_t begin, int64_t end) {
    // Per task: the group's queries as one [G·queries, D] block, its scores, weights and weighted values
    // (uninitialised: every entry a task reads it has written).
    const auto rows_of = [&](int64_t n) { return static_cast<size_t>(max_rows * n); };
    const std::unique_ptr<Bits[]> q_rows(new Bits[rows_of(parts * D)]), weights(new Bits[rows_of(parts * padded)]);
    const std::unique_ptr<float[]> scores(new float[rows_of(kScoreStride)]), acc(new float[rows_of(D)]);
    std::vector<float> row_max(static_cast<size_t>(max_rows)), row_sum(static_cast<size_t>(max_rows));
    for (int64_t task = begin; task < end; ++task) {
      // A block's cost grows with its keys; taking a head's blocks first, last, second, second to last, …
      // gives each thread's contiguous range of tasks a like share of cheap and dear ones.
      const int64_t bh = task / query_blocks, b = bh / Hkv, h = bh % Hkv, p = task % query_blocks;
      const int64_t s0 = (p % 2 == 0 ? p / 2 : query_blocks - 1 - p / 2) * queries;
      const int64_t qn = std::min(queries, T - s0), rows = G * qn;
      const Split q_split{q_rows.get(), kSplit ? q_rows.get() + rows * D : nullptr};
      for (int64_t g = 0; g < G; ++g)
        to_operands(q_data + b * q.stride(0) + (h * G + g) * q.stride(1) + s0 * q.stride(2), q.stride(2), qn, D,
                    Split{q_split.hi + g * qn * D, kSplit ? q_split.lo + g * qn * D : nullptr});
      // The block's last query sees cached + s0 + qn keys; earlier rows mask the rest of that width.
      const int64_t blocks = (cached + s0 + qn + kBlock - 1) / kBlock, width = blocks * kBlock;
      const Split k_in = packed(pk, bh), v_in = packed(pv, bh);
      if (!tiles) {
        bf16_dot::multiply_panels(q_split.hi, rows, D, D, k_in.hi, 0, blocks, scores.get(), kScoreStride);
      } else {
        // Per panel of keys, the large term first, then bf16x3's two corrections into the same float32 scores.
        for (int64_t j = 0; j < blocks; ++j) {
          amx::multiply_panels(q_split.hi, rows, D, D, k_in.hi, j, j + 1, scores.get(), kScoreStride);
          if (kSplit) {
            amx::multiply_panels(q_split.lo, rows, D, D, k_in.hi, j, j + 1, scores.get(), kScoreStride, true);
            amx::multiply_panels(q_split.hi, rows, D, D, k_in.lo, j, j + 1, scores.get(), kScoreStride, true);
          }
        }
      }
      const Split w{weights.get(), kSplit ? weights.get() + rows * width : nullptr};
      for (int64_t r = 0; r < rows; ++r)
        softmax_row<kSplit>(scores.get() + r * kScoreStride, w.hi + r * width, kSplit ? w.lo + r * width : nullptr,
                            cached + s0 + r % qn + 1, width, scale, row_max[static_cast<size_t>(r)],
                            row_sum[static_cast<size_t>(r)]);
      for (int64_t c = 0; c < D; c += kBlock) {
        if (!tiles) {  // Vᵀ's panel of these 64 columns, its first `width` keys
          bf16_dot::multiply_panels(w.hi, rows, width, width, v_in.hi + (c / kBlock) * padded * kBlock, 0, 1,
                                    acc.get() + c, D);
          continue;
        }
        const int64_t slice = (c / kBlock) * key_blocks * kBlock * kBlock;
        const auto product = [&](const Bits* a, const Bits* v, bool accumulate) {
          cpublas::brgemm(rows, kBlock, width, width, kBlock, D, accumulate, as_bf16(a), as_bf16(v + slice), acc.get() + c);
        };
        product(w.hi, v_in.hi, false);
        if (kSplit) {
          product(w.lo, v_in.hi, true);
          product(w.hi, v_in.lo, true);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t g = r / qn, t = s0 + r % qn, head = h * G + g;
        write_row(acc.get() + r * D, 1.f / row_sum[static_cast<size_t>(r)], D, out_data + ((b * T + t) * Hq + head) * D);
        if (lse_data)
          lse_data[(b * Hq + head) * T + t] = row_max[static_cast<size_t>(r)] + std::log(row_sum[static_cast<size_t>(r)]);
      }
    }
    if (tiles) amx::release();
  });
  if (logsumexp) *logsumexp = lse;
  return out.transpose(1, 2);
}

}  // namespace

bool causal_attention_cpu_supported(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values) {
  const int64_t D = q.dim() == 4 ? q.size(3) : 0;
  const Bf16ProductEngine engine = bf16_product_engine();
  const bool served = engine == Bf16ProductEngine::kTiles ||
                      (q.scalar_type() == at::kBFloat16 && engine == Bf16ProductEngine::kDot);
  return (D == 64 || D == 128) && prefill_attention_operands(q, keys, values, kMaxKeys) && served;
}

bool causal_attention_cpu_fits(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values) {
  if (q.dim() != 4) return false;
  const bool tiles = bf16_product_engine() == Bf16ProductEngine::kTiles;
  const int64_t min_queries = q.scalar_type() == at::kFloat ? kMinQueriesFloat32
                              : tiles                        ? kMinQueriesBf16
                                                             : kMinQueriesBf16Dot;
  return q.size(2) >= min_queries && causal_attention_cpu_supported(q, keys, values);
}

at::Tensor causal_attention_cpu(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                at::Tensor* logsumexp) {
  TORCH_CHECK(causal_attention_cpu_supported(q, keys, values), "causal_attention_cpu: inputs outside its fast path");
  return q.scalar_type() == at::kFloat ? attend<float>(q, keys, values, logsumexp)
                                       : attend<Bits>(q, keys, values, logsumexp);
}

}  // namespace kvbound::ops
