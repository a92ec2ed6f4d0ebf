#include "ops/pooled_ops_tiled.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/full.h>
#include <ATen/ops/index_add.h>
#include <ATen/ops/index_put.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/isinf.h>
#include <ATen/ops/log.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "ops/cuda_module.h"
#include "ops/pooled_window.h"

namespace kvbound::ops {
namespace {

constexpr double kMinusInf = -std::numeric_limits<double>::infinity();

at::ScalarType compute_type(const at::Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// The queries that see some key: s ≥ T − window (window > 0) and s ≥ min_gap (query s sees keys t ≤ s − min_gap).
int64_t first_pooled_query(int64_t T, int64_t window, int64_t min_gap) {
  return std::max(window > 0 ? T - window : int64_t{0}, min_gap);
}

// bool [n, T]: query s0 + r is not in Ω(t), for a tile of queries that all lie at or after first_pooled_query.
at::Tensor outside_window(int64_t s0, int64_t n, int64_t T, int64_t min_gap, const at::TensorOptions& options) {
  const auto longs = options.dtype(at::kLong);
  return at::arange(T, longs).unsqueeze(0) > (at::arange(s0, s0 + n, longs) - min_gap).unsqueeze(1);
}

// |Ω(t)| as the compute type [T], and the keys whose Ω is not empty.
at::Tensor window_sizes(int64_t T, int64_t window, int64_t min_gap, const at::TensorOptions& options) {
  return (T - window_starts(T, window, min_gap, options)).clamp_min(0).to(options.dtype());
}

// Running pooling of tile rows into per-key accumulators (shape [..., T]): a sum (mean), a max with the query it
// came from (max), or a max-shifted sum of exponentials (logsumexp).
struct RunningPool {
  PoolMode mode;
  at::Tensor acc;     // sum | max | shift of the logsumexp
  at::Tensor sum;     // logsumexp: Σ exp(x − acc)
  at::Tensor argmax;  // max: int64 query index

  RunningPool(PoolMode m, c10::IntArrayRef sizes, const at::TensorOptions& options) : mode(m) {
    acc = m == PoolMode::Mean ? at::zeros(sizes, options) : at::full(sizes, kMinusInf, options);
    if (m == PoolMode::LogSumExp) sum = at::zeros(sizes, options);
    if (m == PoolMode::Max) argmax = at::zeros(sizes, options.dtype(at::kLong));
  }

  // x [..., n, T] for queries s0..s0+n−1 (overwritten: no second tile is allocated), `outside` [n, T]: the
  // pairs that do not count.
  void add(at::Tensor& x, const at::Tensor& outside, int64_t s0) {
    if (mode == PoolMode::Mean) {
      acc.add_(x.masked_fill_(outside, 0).sum(-2));
      return;
    }
    x.masked_fill_(outside, kMinusInf);
    if (mode == PoolMode::Max) {
      auto [tile_max, tile_arg] = x.max(-2);     // the first maximal query of the tile
      const at::Tensor better = tile_max > acc;  // strict: an earlier tile's equal maximum keeps its query
      acc = at::where(better, tile_max, acc);
      argmax = at::where(better, tile_arg + s0, argmax);
      return;
    }
    const at::Tensor new_max = at::maximum(acc, x.amax(-2));
    const at::Tensor shift = at::where(at::isinf(new_max), 0, new_max);  // a key no query has reached yet
    sum = sum * at::exp(acc - shift) + x.sub_(shift.unsqueeze(-2)).exp_().sum(-2);
    acc = new_max;
  }

  // The pooled values, `empty` where Ω(t) is empty.
  at::Tensor result(const at::Tensor& sizes, const at::Tensor& valid, double empty) const {
    at::Tensor pooled;
    switch (mode) {
      case PoolMode::Mean: pooled = acc / sizes.clamp_min(1); break;
      case PoolMode::Max: pooled = acc; break;
      case PoolMode::LogSumExp: pooled = acc + at::log(sum); break;
    }
    return at::where(valid, pooled, empty);
  }
};

void check_index_inputs(const at::Tensor& qI, const at::Tensor& kI, const at::Tensor& w) {
  TORCH_CHECK(qI.dim() == 4 && kI.dim() == 4 && w.dim() == 3 && kI.size(1) > 0 && qI.size(1) % kI.size(1) == 0 &&
                  w.sizes() == qI.sizes().slice(0, 3),
              "kvbound::pooled_index_score: expected qI [B, Hq, T, dI], kI [B, Hk, T, dI] with Hk | Hq, w [B, Hq, T]; "
              "got ", qI.sizes(), ", ", kI.sizes(), ", ", w.sizes());
}

// The student's scores of one query tile, [B, Hk, n, T] (scaled by 1/√dI), and with relu, when asked, the raw
// products P [B, Hk, G, n, T] the backward needs. Identity: I = q_eff·kI with q_eff = Σ_h w_h qI_h ([B, Hk, T, dI]).
struct IndexTile {
  at::Tensor scores, products;
};

IndexTile index_tile(const at::Tensor& q_grouped, const at::Tensor& q_effective, const at::Tensor& w_grouped,
                     const at::Tensor& k_t, bool relu, int64_t s0, int64_t n, double scale, bool keep_products) {
  if (!relu) return {at::matmul(q_effective.narrow(2, s0, n), k_t).mul_(scale), {}};
  at::Tensor products = at::matmul(q_grouped.narrow(3, s0, n), k_t.unsqueeze(2));  // [B, Hk, G, n, T]
  at::Tensor weighted = keep_products ? at::relu(products) : products.relu_();
  weighted.mul_(w_grouped.narrow(3, s0, n).unsqueeze(-1));
  return {weighted.sum(2).mul_(scale), keep_products ? products : at::Tensor()};
}

// target[rows[i]] += values[i] in one fixed order on either device: the CPU's index_add_ walks the indices in
// order, CUDA's accumulating index_put_ sorts them first (its index_add_ uses atomics, and the CPU's index_put_
// may run in parallel).
void accumulate_rows(const at::Tensor& target, const at::Tensor& rows, const at::Tensor& values) {
  if (target.is_cuda())
    target.index_put_({rows}, values, /*accumulate=*/true);
  else
    target.index_add_(0, rows, values);
}

// Max pooling's backward: z_t = I[a_t, t] for the forward's argmax query a_t, so each key's gradient reaches one
// query, O(B·Hq·T·dI) gathers instead of tiles over every (s, t). g: dL/dz·(1/√dI) [B, Hk, T], 0 for keys with an
// empty Ω; a: [B, Hk, T] (int64). Several keys can share a query: accumulate_rows sums the query side.
void max_pool_backward(const at::Tensor& g, const at::Tensor& a, const at::Tensor& q_grouped, const at::Tensor& q_effective,
                       const at::Tensor& w_grouped, const at::Tensor& k, bool relu, at::Tensor& grad_q, at::Tensor& grad_k,
                       at::Tensor& grad_w) {
  const int64_t B = k.size(0), Hk = k.size(1), T = k.size(2), d = k.size(3);
  const auto longs = a.options();
  if (!relu) {  // I = q_eff·kI: dq_eff[a_t] += g_t kI_t, dkI_t = g_t q_eff[a_t]
    const at::Tensor rows = at::arange(B * Hk, longs).view({B, Hk, 1}) * T + a;  // flat query row of each key
    grad_k.copy_(q_effective.reshape({B * Hk * T, d}).index_select(0, rows.flatten()).view({B, Hk, T, d}) *
                 g.unsqueeze(-1));
    accumulate_rows(grad_q.view({B * Hk * T, d}), rows.flatten(), (k * g.unsqueeze(-1)).reshape({B * Hk * T, d}));
    return;
  }
  // relu: I = Σ_h w_h relu(P_h) with P_h = qI_h·kI, recomputed at (a_t, t) only.
  const int64_t G = q_grouped.size(2);
  const at::Tensor rows = (at::arange(B * Hk * G, longs).view({B, Hk, G, 1}) * T + a.unsqueeze(2)).flatten();
  const at::Tensor q_at = q_grouped.reshape({B * Hk * G * T, d}).index_select(0, rows).view({B, Hk, G, T, d});
  const at::Tensor w_at = w_grouped.reshape({B * Hk * G * T}).index_select(0, rows).view({B, Hk, G, T});
  const at::Tensor products = (q_at * k.unsqueeze(2)).sum(-1);                     // P_h[a_t, t], [B, Hk, G, T]
  const at::Tensor e = at::where(products > 0, g.unsqueeze(2) * w_at, 0);          // dL/dP_h / √dI
  grad_k.copy_((e.unsqueeze(-1) * q_at).sum(2));
  accumulate_rows(grad_q.view({B * Hk * G * T, d}), rows, (e.unsqueeze(-1) * k.unsqueeze(2)).reshape({-1, d}));
  accumulate_rows(grad_w.view({B * Hk * G * T}), rows, (g.unsqueeze(2) * at::relu(products)).flatten());
}

}  // namespace

int64_t pooled_tile_rows(int64_t T, int64_t query_block) {
  TORCH_CHECK(query_block > 0, "pooled ops: query_block must be positive; got ", query_block);
  return std::max(query_block, (T + 255) / 256);
}

at::Tensor pooled_attention_importance_tiled(const at::Tensor& q, const at::Tensor& k, int64_t pool, int64_t window,
                                             int64_t min_gap, int64_t query_block, int64_t key_block) {
  const PoolMode mode = pool_mode_from_int(pool, "kvbound::pooled_attention_importance");
  check_window_args("kvbound::pooled_attention_importance", min_gap, query_block, key_block);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "kvbound::pooled_attention_importance: expected q [B, Hq, T, D], k [B, Hkv, T, D]; got ", q.sizes(),
              ", ", k.sizes());
  c10::NoGradGuard no_grad;
  if (q.is_cuda()) {  // bf16/fp16 with head dim 64 or 128: the tensor-core kernels (ops/pooled_importance_mma.cu)
    using TensorCorePath = bool (*)(const at::Tensor*, const at::Tensor*, int64_t, int64_t, int64_t, at::Tensor*);
    // Looked up once: a CUDA tensor here means the programs' start-up has loaded the module (or never will).
    static const auto tensor_cores = reinterpret_cast<TensorCorePath>(cuda_module_symbol("kvbound_pooled_importance_mma"));
    at::Tensor out;
    if (tensor_cores != nullptr && tensor_cores(&q, &k, pool, window, min_gap, &out)) return out;
  }
  const int64_t B = q.size(0), Hq = q.size(1), Hkv = k.size(1), G = Hq / Hkv, T = q.size(2), D = q.size(3);
  const auto options = q.options().dtype(compute_type(q));
  const at::Tensor q_grouped = q.to(options.dtype()).reshape({B, Hkv, G, T, D});
  const at::Tensor k_t = k.to(options.dtype()).transpose(-2, -1).unsqueeze(2);  // [B, Hkv, 1, D, T]
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  RunningPool pooled(mode, {B, Hkv, G, T}, options);
  const int64_t rows = pooled_tile_rows(T, query_block);
  const auto longs = options.dtype(at::kLong);
  for (int64_t s0 = first_pooled_query(T, window, min_gap); s0 < T; s0 += rows) {
    const int64_t n = std::min(rows, T - s0);
    const at::Tensor future = at::arange(T, longs).unsqueeze(0) > at::arange(s0, s0 + n, longs).unsqueeze(1);
    // Causal softmax in place: one tile [B, Hkv, G, n, T] alive.
    at::Tensor probs = at::matmul(q_grouped.narrow(3, s0, n), k_t).mul_(scale).masked_fill_(future, kMinusInf);
    probs.sub_(probs.amax(-1, true)).exp_();
    probs.div_(probs.sum(-1, true));
    pooled.add(probs, outside_window(s0, n, T, min_gap, options), s0);
  }
  const at::Tensor sizes = window_sizes(T, window, min_gap, options);
  const at::Tensor out = pooled.result(sizes, sizes > 0, 0.0).mean(2);  // [B, Hkv, T]
  return out;  // float64 for float64, else float32 (a target: rounding it to bf16 gains nothing)
}

std::tuple<at::Tensor, at::Tensor> pooled_index_score_tiled_fwd(const at::Tensor& qI, const at::Tensor& kI,
                                                                const at::Tensor& w, int64_t pool, int64_t window,
                                                                int64_t min_gap, bool relu, int64_t query_block,
                                                                int64_t key_block) {
  const PoolMode mode = pool_mode_from_int(pool, "kvbound::pooled_index_score");
  check_window_args("kvbound::pooled_index_score", min_gap, query_block, key_block);
  check_index_inputs(qI, kI, w);
  c10::NoGradGuard no_grad;
  const int64_t B = qI.size(0), Hq = qI.size(1), Hk = kI.size(1), G = Hq / Hk, T = qI.size(2), d = qI.size(3);
  TORCH_CHECK(T <= std::numeric_limits<int32_t>::max(), "kvbound::pooled_index_score: T = ", T,
              " does not fit the int32 argmax");
  if (qI.is_cuda()) {  // bf16/fp16 with index dim 32, 64 or 128: the tensor-core kernel (ops/pooled_index_score_mma.cu)
    using TensorCorePath = bool (*)(const at::Tensor*, const at::Tensor*, const at::Tensor*, int64_t, int64_t, int64_t,
                                    bool, at::Tensor*, at::Tensor*);
    static const auto tensor_cores = reinterpret_cast<TensorCorePath>(cuda_module_symbol("kvbound_pooled_index_score_mma"));
    at::Tensor z, argmax;
    if (tensor_cores != nullptr && tensor_cores(&qI, &kI, &w, pool, window, min_gap, relu, &z, &argmax))
      return {z, argmax};
  }
  const auto options = qI.options().dtype(compute_type(qI));
  const at::Tensor q_grouped = qI.to(options.dtype()).reshape({B, Hk, G, T, d});
  const at::Tensor w_grouped = w.to(options.dtype()).reshape({B, Hk, G, T});
  const at::Tensor q_effective = relu ? at::Tensor() : (q_grouped * w_grouped.unsqueeze(-1)).sum(2);
  const at::Tensor k_t = kI.to(options.dtype()).transpose(-2, -1);  // [B, Hk, d, T]
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  RunningPool pooled(mode, {B, Hk, T}, options);
  const int64_t rows = pooled_tile_rows(T, query_block);
  for (int64_t s0 = first_pooled_query(T, window, min_gap); s0 < T; s0 += rows) {
    const int64_t n = std::min(rows, T - s0);
    at::Tensor scores = index_tile(q_grouped, q_effective, w_grouped, k_t, relu, s0, n, scale, false).scores;
    pooled.add(scores, outside_window(s0, n, T, min_gap, options), s0);
  }
  const at::Tensor sizes = window_sizes(T, window, min_gap, options);
  const at::Tensor z = pooled.result(sizes, sizes > 0, kMinusInf).to(qI.scalar_type());
  // −1 for a key no query sees, as the CPU and CUDA kernels write it.
  const at::Tensor argmax = mode == PoolMode::Max ? at::where(sizes > 0, pooled.argmax, -1).to(at::kInt)
                                                  : at::empty({0, Hk, T}, qI.options().dtype(at::kInt));
  return {z, argmax};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pooled_index_score_tiled_bwd(
    const at::Tensor& grad_z, const at::Tensor& qI, const at::Tensor& kI, const at::Tensor& w, const at::Tensor& z,
    const at::Tensor& argmax, int64_t pool, int64_t window, int64_t min_gap, bool relu, int64_t query_block,
    int64_t key_block) {
  const PoolMode mode = pool_mode_from_int(pool, "kvbound::pooled_index_score");
  check_window_args("kvbound::pooled_index_score", min_gap, query_block, key_block);
  check_index_inputs(qI, kI, w);
  if (mode == PoolMode::Max)
    TORCH_CHECK(argmax.sizes() == z.sizes(), "kvbound::pooled_index_score: max pooling's backward needs the forward's "
                "argmax ", z.sizes(), "; got ", argmax.sizes());
  c10::NoGradGuard no_grad;
  const int64_t B = qI.size(0), Hq = qI.size(1), Hk = kI.size(1), G = Hq / Hk, T = qI.size(2), d = qI.size(3);
  const auto options = qI.options().dtype(compute_type(qI));
  const at::Tensor q_grouped = qI.to(options.dtype()).reshape({B, Hk, G, T, d});
  const at::Tensor w_grouped = w.to(options.dtype()).reshape({B, Hk, G, T});
  const at::Tensor q_effective = relu ? at::Tensor() : (q_grouped * w_grouped.unsqueeze(-1)).sum(2);
  const at::Tensor k = kI.to(options.dtype());
  const at::Tensor k_t = k.transpose(-2, -1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const at::Tensor sizes = window_sizes(T, window, min_gap, options);
  // z is constant on keys with an empty Ω: they pass no gradient, whatever arrives for them.
  const at::Tensor gz = at::where(sizes > 0, grad_z.to(options.dtype()), 0);
  const at::Tensor z_c = z.to(options.dtype());
  at::Tensor grad_q = at::zeros(relu ? q_grouped.sizes() : q_effective.sizes(), options);  // grouped | effective
  at::Tensor grad_k = at::zeros(k.sizes(), options);
  at::Tensor grad_w = relu ? at::zeros(w_grouped.sizes(), options) : at::Tensor();
  const int64_t rows = pooled_tile_rows(T, query_block);
  if (mode == PoolMode::Max)
    max_pool_backward(gz * scale, argmax.to(at::kLong).clamp_min(0), q_grouped, q_effective, w_grouped, k, relu, grad_q,
                      grad_k, grad_w);
  for (int64_t s0 = first_pooled_query(T, window, min_gap); mode != PoolMode::Max && s0 < T; s0 += rows) {
    const int64_t n = std::min(rows, T - s0);
    const at::Tensor outside = outside_window(s0, n, T, min_gap, options);
    IndexTile tile;
    if (relu || mode == PoolMode::LogSumExp)
      tile = index_tile(q_grouped, q_effective, w_grouped, k_t, relu, s0, n, scale, relu);
    // dL/dI[s, t]·(1/√dI) over the tile, [B, Hk, n, T].
    const at::Tensor grad_scores =
        mode == PoolMode::Mean
            ? (gz * (scale / sizes.clamp_min(1))).unsqueeze(-2).expand({B, Hk, n, T}).masked_fill(outside, 0)
            // logsumexp: dz/dI = exp(I − z) inside Ω
            : tile.scores.sub_(z_c.unsqueeze(-2)).exp_().mul_((gz * scale).unsqueeze(-2)).masked_fill_(outside, 0);
    if (!relu) {  // I = q_eff·kI (scaled): both gradients are one product each
      grad_q.narrow(2, s0, n).add_(at::matmul(grad_scores, k));
      grad_k.add_(at::matmul(grad_scores.transpose(-2, -1), q_effective.narrow(2, s0, n)));
      continue;
    }
    // One more tile besides P: relu(P)·g for grad w, then reused as grad P = g·w where P > 0.
    const at::Tensor g = grad_scores.unsqueeze(2);  // [B, Hk, 1, n, T]
    const at::Tensor negative = tile.products <= 0;
    at::Tensor buffer = at::relu(tile.products).mul_(g);
    grad_w.narrow(3, s0, n).add_(buffer.sum(-1));
    tile.products = at::Tensor();
    at::mul_out(buffer, g, w_grouped.narrow(3, s0, n).unsqueeze(-1)).masked_fill_(negative, 0);
    grad_q.narrow(3, s0, n).add_(at::matmul(buffer, k.unsqueeze(2)));
    grad_k.add_(at::matmul(buffer.transpose(-2, -1), q_grouped.narrow(3, s0, n)).sum(2));
  }
  if (!relu) {  // back through q_eff = Σ_h w_h qI_h
    grad_w = (q_grouped * grad_q.unsqueeze(2)).sum(-1);
    grad_q = w_grouped.unsqueeze(-1) * grad_q.unsqueeze(2);
  }
  const at::ScalarType dtype = qI.scalar_type();
  return {grad_q.reshape(qI.sizes()).to(dtype), grad_k.to(dtype), grad_w.reshape(w.sizes()).to(dtype)};
}

}  // namespace kvbound::ops

// The ops' CUDA kernels: tile products through cuBLAS. (The CPU keeps its own fused kernels.)
TORCH_LIBRARY_IMPL(kvbound, CUDA, m) {
  m.impl("pooled_attention_importance_fwd", &kvbound::ops::pooled_attention_importance_tiled);
  m.impl("pooled_index_score_fwd", &kvbound::ops::pooled_index_score_tiled_fwd);
  m.impl("pooled_index_score_bwd", &kvbound::ops::pooled_index_score_tiled_bwd);
}
