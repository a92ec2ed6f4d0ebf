#include "ops/pooled_attention_importance.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
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

// When every query of any window fits one query block (the IndexMem default: window 32 ≤ block 64), that block's
// logits against every key at once, [B, Hkv, G·W, T] (W = the window's queries: as many values as q itself when
// W ≤ D), in a dozen ATen ops: the tiled passes make two small products and exps per (row, block) pair, which at
// these sizes cost more in dispatch than in arithmetic (SmolLM2, T 511, W 32, 30 layers: DESIGN.md).
at::Tensor window_block_importance(const at::Tensor& q, const at::Tensor& k, PoolMode pool, const PoolWindow& omega,
                                   int64_t first_query) {
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), G = Hq / Hkv;
  const int64_t W = T - first_query;
  const at::ScalarType compute = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  if (W == 0) return at::zeros({B, Hkv, T}, q.options().dtype(compute));  // every window empty
  // The G query heads of KV head j are j·G … j·G + G − 1: as rows g·W + i of one [G·W, D] block per KV head.
  const at::Tensor queries = q.narrow(2, first_query, W).to(compute).reshape({B, Hkv, G * W, D});
  const at::Tensor logits = at::matmul(queries, k.to(compute).transpose(-2, -1))
                                .mul_(1.0 / std::sqrt(static_cast<double>(D)))
                                .view({B, Hkv, G, W, T});
  const auto long_options = q.options().dtype(at::kLong);
  const at::Tensor query_positions = at::arange(first_query, T, long_options).unsqueeze(1);  // [W, 1]
  const at::Tensor keys = at::arange(T, long_options).unsqueeze(0);                           // [1, T]
  logits.masked_fill_(keys > query_positions, -std::numeric_limits<double>::infinity());
  const at::Tensor in_omega = query_positions >= window_starts(T, omega.window, omega.min_gap, q.options()).unsqueeze(0);
  const at::Tensor outside = in_omega.logical_not();
  const at::Tensor sizes = in_omega.sum(0);  // |Ω(t)| [T]
  const double minus_inf = -std::numeric_limits<double>::infinity();
  at::Tensor pooled;  // [B, Hkv, G, T]
  if (pool == PoolMode::Max) {  // the largest log A_h[s, t], exponentiated once; empty Ω: e^−∞ = 0
    pooled = at::log_softmax(logits, -1).masked_fill_(outside, minus_inf).amax(3).exp();
  } else {
    const at::Tensor probs = at::softmax(logits, -1);  // A_h[s, t]
    pooled = pool == PoolMode::Mean
                 ? probs.masked_fill(outside, 0).sum(3) / sizes.clamp_min(1)
                 : at::where(sizes > 0, probs.exp().masked_fill_(outside, 0).sum(3).log(), 0.0);
  }
  return pooled.mean(2);
}

at::Tensor pooled_attention_importance_fwd_cpu(const at::Tensor& q, const at::Tensor& k, int64_t pool, int64_t window,
                                               int64_t min_gap, int64_t query_block, int64_t key_block) {
  const PoolMode mode = pool_mode_from_int(pool, kOpName);
  check_window_args(kOpName, min_gap, query_block, key_block);
  const int64_t T = q.size(2);
  const PoolWindow omega{T, window, min_gap};
  // Only queries from Ω(0)'s start on are in any window; their rows need a logsumexp.
  const int64_t first_query = std::min(omega.start(0), T);
  if (T - first_query <= query_block) return window_block_importance(q, k, mode, omega, first_query);
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
