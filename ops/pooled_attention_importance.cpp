#include "ops/pooled_attention_importance.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "ops/bf16_dot_panels.h"
#include "ops/bf16_product_engine.h"
#include "ops/cpu_vector.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace kvbound::ops {
namespace {

constexpr const char* kOpName = "kvbound::pooled_attention_importance";

void check_inputs(const at::Tensor& q, const at::Tensor& k) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, kOpName, ": expected q [B, Hq, T, D] and k [B, Hkv, T, D]; got q ",
              q.sizes(), ", k ", k.sizes());
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.size(3) == q.size(3), kOpName,
              ": k must be [B, Hkv, T, D] matching q ", q.sizes(), "; got k ", k.sizes());
  TORCH_CHECK(q.size(3) > 0, kOpName, ": head_dim must be positive; got q ", q.sizes());
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, kOpName, ": query heads (", q.size(1),
              ") must be a positive multiple of KV heads (", k.size(1), ")");
  TORCH_CHECK(at::isFloatingType(q.scalar_type()) && k.scalar_type() == q.scalar_type(), kOpName,
              ": q and k must share one floating dtype; got ", q.scalar_type(), " and ", k.scalar_type());
  TORCH_CHECK(k.device() == q.device(), kOpName, ": q and k must be on one device");
}

// Rows flattened as [B·H, T, D] in the arithmetic type (float64 stays, everything else float32). Query row
// b·Hq + h reads KV row (b·Hq + h) / G = b·Hkv + h / G.
at::Tensor flat_rows(const at::Tensor& x) {
  const at::ScalarType compute = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return x.to(compute).contiguous().view({x.size(0) * x.size(1), x.size(2), x.size(3)});
}

// Pass 1: lse[row, s] = log Σ_{t≤s} exp(q_s·k_t/√D) for the queries s ≥ first_query (the others are in no
// Ω), by an online max and sum over key blocks. Parallel over (row, query block).
template <typename scalar_t>
void row_logsumexp(const at::Tensor& q, const at::Tensor& k, scalar_t* lse, int64_t first_query, int64_t query_block,
                   int64_t key_block) {
  const int64_t rows = q.size(0), T = q.size(1), D = q.size(2), group = rows / k.size(0);
  const int64_t query_blocks = (T - first_query + query_block - 1) / query_block;
  const scalar_t scale = scalar_t(1) / std::sqrt(static_cast<scalar_t>(D));
  const scalar_t minus_inf = -std::numeric_limits<scalar_t>::infinity();
  at::parallel_for(0, rows * query_blocks, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::Tensor tile = at::empty({query_block * key_block}, q.options());
    std::vector<scalar_t> row_max(query_block), row_sum(query_block);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / query_blocks;
      const int64_t s0 = first_query + interleaved_block(task % query_blocks, query_blocks) * query_block;
      const int64_t nq = std::min(query_block, T - s0);
      const at::Tensor q_rows = q[row].narrow(0, s0, nq);
      std::fill_n(row_max.begin(), nq, minus_inf);
      std::fill_n(row_sum.begin(), nq, scalar_t(0));
      for (int64_t t0 = 0; t0 < s0 + nq; t0 += key_block) {
        const int64_t nk = std::min(key_block, T - t0);
        at::Tensor logits = tile.narrow(0, 0, nq * nk).view({nq, nk});
        at::mm_out(logits, q_rows, k[row / group].narrow(0, t0, nk).t());
        scalar_t* x = logits.mutable_data_ptr<scalar_t>();
        for (int64_t r = 0; r < nq; ++r) {
          const int64_t visible = std::clamp<int64_t>(s0 + r - t0 + 1, 0, nk);
          scalar_t* xr = x + r * nk;
          scalar_t block_max = minus_inf;
          for (int64_t c = 0; c < visible; ++c) {
            xr[c] *= scale;
            block_max = std::max(block_max, xr[c]);
          }
          // Finite: key block 0 holds key 0 ≤ s, so the running max is finite from the first block on.
          const scalar_t new_max = std::max(row_max[r], block_max);
          row_sum[r] *= std::exp(row_max[r] - new_max);
          row_max[r] = new_max;
          for (int64_t c = 0; c < visible; ++c) xr[c] -= new_max;
          std::fill(xr + visible, xr + nk, minus_inf);
        }
        logits.exp_();  // ATen's vectorised exp; masked entries become 0
        for (int64_t r = 0; r < nq; ++r) {
          scalar_t sum = 0;
          for (int64_t c = 0; c < nk; ++c) sum += x[r * nk + c];
          row_sum[r] += sum;
        }
      }
      for (int64_t r = 0; r < nq; ++r) lse[row * T + s0 + r] = row_max[r] + std::log(row_sum[r]);
    }
  });
}

// Pass 2: for every key t, pool A_h[s,t] = exp(logit − lse_s) over s ∈ Ω(t) for each query head of the
// group, then average the heads. Parallel over (KV row, key block), so each key's accumulator has one
// writer. Max pools the shifted logits and exponentiates once per key; logsumexp sums exp(A) unshifted,
// since A ∈ [0, 1] bounds every term by e.
template <typename scalar_t>
void pool_probabilities(const at::Tensor& q, const at::Tensor& k, const scalar_t* lse, scalar_t* out, PoolMode pool,
                        const PoolWindow& omega, int64_t query_block, int64_t key_block) {
  const int64_t kv_rows = k.size(0), T = q.size(1), D = q.size(2), group = q.size(0) / kv_rows;
  const int64_t key_blocks = (T + key_block - 1) / key_block;
  const scalar_t scale = scalar_t(1) / std::sqrt(static_cast<scalar_t>(D));
  const scalar_t minus_inf = -std::numeric_limits<scalar_t>::infinity();
  at::parallel_for(0, kv_rows * key_blocks, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::Tensor tile = at::empty({query_block * key_block}, q.options());
    std::vector<scalar_t> acc(key_block), total(key_block);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv_row = task / key_blocks;
      const int64_t t0 = interleaved_block(task % key_blocks, key_blocks) * key_block;
      const int64_t nk = std::min(key_block, T - t0);
      const at::Tensor k_rows = k[kv_row].narrow(0, t0, nk);
      std::fill_n(total.begin(), nk, scalar_t(0));
      for (int64_t row = kv_row * group; row < (kv_row + 1) * group; ++row) {
        std::fill_n(acc.begin(), nk, pool == PoolMode::Max ? minus_inf : scalar_t(0));
        // Ω(t0) starts earliest in the block; query blocks before it see none of these keys.
        for (int64_t s0 = omega.start(t0); s0 < T; s0 += query_block) {
          const int64_t nq = std::min(query_block, T - s0);
          at::Tensor logits = tile.narrow(0, 0, nq * nk).view({nq, nk});
          at::mm_out(logits, q[row].narrow(0, s0, nq), k_rows.t());
          scalar_t* x = logits.mutable_data_ptr<scalar_t>();
          for (int64_t r = 0; r < nq; ++r) {
            const int64_t seen = omega.keys_seen_by(s0 + r, t0, nk);
            const scalar_t row_lse = lse[row * T + s0 + r];
            scalar_t* xr = x + r * nk;
            if (pool == PoolMode::Max) {
              for (int64_t c = 0; c < seen; ++c) acc[c] = std::max(acc[c], xr[c] * scale - row_lse);
            } else {
              for (int64_t c = 0; c < seen; ++c) xr[c] = xr[c] * scale - row_lse;
              std::fill(xr + seen, xr + nk, minus_inf);
            }
          }
          if (pool == PoolMode::Max) continue;
          logits.exp_();                                   // A
          if (pool == PoolMode::LogSumExp) logits.exp_();  // exp(A); entries outside Ω are not summed
          for (int64_t r = 0; r < nq; ++r) {
            const int64_t seen = omega.keys_seen_by(s0 + r, t0, nk);
            for (int64_t c = 0; c < seen; ++c) acc[c] += x[r * nk + c];
          }
        }
        for (int64_t c = 0; c < nk; ++c) {
          const int64_t n = omega.size(t0 + c);
          if (n == 0) continue;  // invalid key: 0
          total[c] += pool == PoolMode::Mean  ? acc[c] / static_cast<scalar_t>(n)
                      : pool == PoolMode::Max ? std::exp(acc[c])
                                              : std::log(acc[c]);
        }
      }
      for (int64_t c = 0; c < nk; ++c) out[kv_row * T + t0 + c] = total[c] / static_cast<scalar_t>(group);
    }
  });
}

// One row of the one-block path in place: its first `visible` logits l (unscaled q·k) become the softmax weights
// A = e^(scale·(l − max)) / Σ; float32 by the fused kernels' exp2 (ops/cpu_vector.h, vectorized, a fixed-order
// sum), float64 by std::exp (the tests' reference precision).
KVBOUND_VECTOR_CLONES void softmax_prefix(float* x, int64_t visible, float scale) {
  const float max = cpu::running_max(x, visible);
  const float log2_scale = scale * 1.44269504088896341f, shift = max * log2_scale;
#pragma omp simd
  for (int64_t t = 0; t < visible; ++t) x[t] = cpu::exp2_nonpositive(x[t] * log2_scale - shift);
  const float inv_sum = 1.f / cpu::fixed_order_sum(visible, [x](int64_t t) { return x[t]; });
#pragma omp simd
  for (int64_t t = 0; t < visible; ++t) x[t] *= inv_sum;
}

void softmax_prefix(double* x, int64_t visible, double scale) {
  const double max = *std::max_element(x, x + visible);
  double sum = 0;
  for (int64_t t = 0; t < visible; ++t) sum += x[t] = std::exp(scale * (x[t] - max));
  for (int64_t t = 0; t < visible; ++t) x[t] /= sum;
}

// One query's weights A[0, seen) into its head's per-key pool: their sum (mean), their largest, or Σ e^A
// (logsumexp; A ∈ [0, 1] bounds every term by e, so nothing is shifted).
KVBOUND_VECTOR_CLONES void pool_row(const float* a, int64_t seen, PoolMode pool, float* acc) {
  if (pool == PoolMode::Mean) {
#pragma omp simd
    for (int64_t t = 0; t < seen; ++t) acc[t] += a[t];
  } else if (pool == PoolMode::Max) {
#pragma omp simd
    for (int64_t t = 0; t < seen; ++t) acc[t] = acc[t] < a[t] ? a[t] : acc[t];
  } else {
#pragma omp simd
    for (int64_t t = 0; t < seen; ++t) acc[t] += cpu::exp_float(a[t]);
  }
}

void pool_row(const double* a, int64_t seen, PoolMode pool, double* acc) {
  for (int64_t t = 0; t < seen; ++t)
    acc[t] = pool == PoolMode::Mean ? acc[t] + a[t] : pool == PoolMode::Max ? std::max(acc[t], a[t]) : acc[t] + std::exp(a[t]);
}

// One KV head's pass of the one-block path: each of its G·W logits rows (row r at x + r·ld, unscaled, query
// first_query + r % W) into softmax weights, pooled per query head into `total` [T], averaged over the G heads.
template <typename scalar_t>
void pool_kv_head(scalar_t* x, int64_t ld, int64_t G, int64_t first_query, PoolMode pool, const PoolWindow& omega,
                  scalar_t scale, scalar_t* acc, scalar_t* total) {
  const int64_t T = omega.T, W = T - first_query;
  for (int64_t g = 0; g < G; ++g) {
    std::fill(acc, acc + T, scalar_t(0));
    for (int64_t i = 0; i < W; ++i) {
      const int64_t s = first_query + i;
      scalar_t* row = x + (g * W + i) * ld;
      softmax_prefix(row, s + 1, scale);                       // keys t ≤ s
      pool_row(row, omega.keys_seen_by(s, 0, T), pool, acc);  // the keys whose Ω(t) holds s: a prefix
    }
    for (int64_t t = 0; t < T; ++t) {
      const int64_t size = omega.size(t);  // |Ω(t)|; 0: an invalid key, 0 in every pool
      total[t] += pool == PoolMode::Mean ? acc[t] / static_cast<scalar_t>(std::max<int64_t>(size, 1))
                  : pool == PoolMode::Max ? acc[t]
                                          : (size > 0 ? std::log(acc[t]) : scalar_t(0));
    }
  }
  for (int64_t t = 0; t < T; ++t) total[t] /= static_cast<scalar_t>(G);
}

// When every query of any window fits one query block (the IndexMem default: window 32 ≤ block 64), that block's
// logits against every key, [G·W, T] per KV head (W = the window's queries: as many values as q itself when
// W ≤ D), then one pass per KV head (parallel over B·Hkv) turning each row into weights and pooling them: the
// tiled passes make two small products and exps per (row, block) pair, which at these sizes cost more in dispatch
// than in arithmetic, and the ATen ops that did this pass (mask, softmax, masked sum) cost 0.9 ms of the 1.1 ms
// per layer (SmolLM2, T 511, W 32: DESIGN.md, "IndexMem stage 1"). bfloat16 q and K on a CPU with AVX512-BF16
// and no AMX form the logits with VDPBF16PS (ops/bf16_dot_panels.h: each product exact in float32, as in the
// widened matmul, summed in another order), K packed per head; otherwise one float32 (float64) matmul.
template <typename scalar_t>
at::Tensor window_block_importance(const at::Tensor& q, const at::Tensor& k, PoolMode pool, const PoolWindow& omega,
                                   int64_t first_query) {
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), G = Hq / Hkv;
  const int64_t W = T - first_query;
  const at::ScalarType compute = c10::CppTypeToScalarType<scalar_t>::value;
  const at::Tensor out = at::zeros({B, Hkv, T}, q.options().dtype(compute));
  if (W == 0) return out;  // every window empty
  const scalar_t scale = scalar_t(1) / std::sqrt(static_cast<scalar_t>(D));
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (q.scalar_type() == at::kBFloat16 && q.stride(3) == 1 && k.stride(3) == 1 && D % 2 == 0 &&
        bf16_product_engine() == Bf16ProductEngine::kDot) {
      const int64_t panels = (T + bf16_dot::kPanel - 1) / bf16_dot::kPanel, ld = panels * bf16_dot::kPanel;
      const auto* q_bits = static_cast<const uint16_t*>(q.const_data_ptr());
      const auto* k_bits = static_cast<const uint16_t*>(k.const_data_ptr());
      at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
        std::vector<uint16_t> packed(static_cast<size_t>(ld * D));
        std::vector<float> logits(static_cast<size_t>(G * W * ld)), acc(static_cast<size_t>(T));
        for (int64_t kv = begin; kv < end; ++kv) {
          const int64_t b = kv / Hkv, j = kv % Hkv;
          bf16_dot::pack_transposed_panels(k_bits + b * k.stride(0) + j * k.stride(1), k.stride(2), T, D, packed.data());
          for (int64_t g = 0; g < G; ++g) {
            const uint16_t* rows = q_bits + b * q.stride(0) + (j * G + g) * q.stride(1) + first_query * q.stride(2);
            bf16_dot::multiply_panels(rows, W, D, q.stride(2), packed.data(), 0, panels, logits.data() + g * W * ld, ld);
          }
          pool_kv_head(logits.data(), ld, G, first_query, pool, omega, scale, acc.data(), o + kv * T);
        }
      });
      return out;
    }
  }
  // The G query heads of KV head j are j·G … j·G + G − 1: as rows g·W + i of one [G·W, D] block per KV head.
  const at::Tensor queries = q.narrow(2, first_query, W).to(compute).reshape({B, Hkv, G * W, D});
  const at::Tensor logits = at::matmul(queries, k.to(compute).transpose(-2, -1)).contiguous();  // [B, Hkv, G·W, T]
  scalar_t* x = logits.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> acc(static_cast<size_t>(T));
    for (int64_t kv = begin; kv < end; ++kv)
      pool_kv_head(x + kv * G * W * T, T, G, first_query, pool, omega, scale, acc.data(), o + kv * T);
  });
  return out;
}

at::Tensor pooled_attention_importance_fwd_cpu(const at::Tensor& q, const at::Tensor& k, int64_t pool, int64_t window,
                                               int64_t min_gap, int64_t query_block, int64_t key_block) {
  const PoolMode mode = pool_mode_from_int(pool, kOpName);
  check_window_args(kOpName, min_gap, query_block, key_block);
  const int64_t T = q.size(2);
  const PoolWindow omega{T, window, min_gap};
  // Only queries from Ω(0)'s start on are in any window; their rows need a logsumexp.
  const int64_t first_query = std::min(omega.start(0), T);
  if (T - first_query <= query_block) {
    return q.scalar_type() == at::kDouble ? window_block_importance<double>(q, k, mode, omega, first_query)
                                          : window_block_importance<float>(q, k, mode, omega, first_query);
  }
  const at::Tensor q_flat = flat_rows(q), k_flat = flat_rows(k);
  const at::Tensor out = at::empty({k.size(0), k.size(1), T}, q_flat.options());
  const at::Tensor lse = at::empty({q_flat.size(0), T}, q_flat.options());
  AT_DISPATCH_FLOATING_TYPES(q_flat.scalar_type(), "pooled_attention_importance_fwd_cpu", [&] {
    scalar_t* lse_data = lse.mutable_data_ptr<scalar_t>();
    row_logsumexp<scalar_t>(q_flat, k_flat, lse_data, first_query, query_block, key_block);
    pool_probabilities<scalar_t>(q_flat, k_flat, lse_data, out.mutable_data_ptr<scalar_t>(), mode, omega, query_block,
                                 key_block);
  });
  return out;
}

}  // namespace

at::Tensor pooled_attention_importance(const at::Tensor& q, const at::Tensor& k, PoolMode pool, int64_t window,
                                       int64_t min_gap, int64_t query_block, int64_t key_block) {
  check_inputs(q, k);
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvbound::pooled_attention_importance_fwd", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t)>();
  const at::NoGradGuard no_grad;
  return op.call(q, k, static_cast<int64_t>(pool), window, min_gap, query_block, key_block);
}

at::Tensor pooled_attention_importance_reference(const at::Tensor& q, const at::Tensor& k, PoolMode pool,
                                                 int64_t window, int64_t min_gap) {
  check_inputs(q, k);
  TORCH_CHECK(min_gap >= 0, kOpName, ": min_gap must be ≥ 0; got ", min_gap);
  const at::NoGradGuard no_grad;
  const int64_t B = q.size(0), Hkv = k.size(1), group = q.size(1) / Hkv, T = q.size(2);
  const at::Tensor logits =
      at::matmul(q, k.repeat_interleave(group, 1).transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(3)));
  const at::Tensor positions = at::arange(T, q.options().dtype(at::kLong));
  const at::Tensor future = positions.unsqueeze(0) > positions.unsqueeze(1);  // [s, t]: t > s
  const at::Tensor probs = at::softmax(logits.masked_fill(future, -std::numeric_limits<double>::infinity()), -1);
  const at::Tensor pooled = pool_window_reference(probs, pool, window, min_gap, 0.0);  // [B, Hq, T]
  return pooled.view({B, Hkv, group, T}).mean(2);
}

}  // namespace kvbound::ops

TORCH_LIBRARY_FRAGMENT(kvbound, m) {
  m.def(
      "pooled_attention_importance_fwd(Tensor q, Tensor k, int pool, int window, int min_gap, int query_block, "
      "int key_block) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvbound, CPU, m) {
  m.impl("pooled_attention_importance_fwd", &kvbound::ops::pooled_attention_importance_fwd_cpu);
}
