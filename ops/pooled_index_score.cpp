#include "ops/pooled_index_score.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "ops/gathered_row_dot.h"

namespace kvbound::ops {
namespace {

constexpr const char* kOpName = "kvbound::pooled_index_score";

// `last_queries`: qI and w may hold only the last R ≤ T of the T queries (pooled_index_score; the kernels take all).
void check_inputs(const at::Tensor& qI, const at::Tensor& kI, const at::Tensor& w, bool last_queries = false) {
  TORCH_CHECK(qI.dim() == 4 && kI.dim() == 4 && w.dim() == 3, kOpName,
              ": expected qI [B, Hq, T, dI], kI [B, Hk, T, dI], w [B, Hq, T]; got qI ", qI.sizes(), ", kI ", kI.sizes(),
              ", w ", w.sizes());
  const bool rows_match = last_queries ? qI.size(2) <= kI.size(2) : qI.size(2) == kI.size(2);
  TORCH_CHECK(kI.size(0) == qI.size(0) && rows_match && kI.size(3) == qI.size(3), kOpName,
              ": kI must be [B, Hk, T, dI] matching qI ", qI.sizes(), last_queries ? " (qI: T or fewer rows)" : "",
              "; got kI ", kI.sizes());
  TORCH_CHECK(w.sizes() == qI.sizes().slice(0, 3), kOpName, ": w must be [B, Hq, T] = ", qI.sizes().slice(0, 3),
              "; got ", w.sizes());
  TORCH_CHECK(qI.size(3) > 0, kOpName, ": index dim must be positive; got qI ", qI.sizes());
  TORCH_CHECK(kI.size(1) > 0 && qI.size(1) % kI.size(1) == 0, kOpName, ": query heads (", qI.size(1),
              ") must be a positive multiple of key heads (", kI.size(1), ")");
  TORCH_CHECK(at::isFloatingType(qI.scalar_type()) && kI.scalar_type() == qI.scalar_type() &&
                  w.scalar_type() == qI.scalar_type(),
              kOpName, ": qI, kI and w must share one floating dtype; got ", qI.scalar_type(), ", ", kI.scalar_type(),
              ", ", w.scalar_type());
  TORCH_CHECK(kI.device() == qI.device() && w.device() == qI.device(), kOpName, ": qI, kI and w must be on one device");
}

// The inputs as the kernels see them, in the arithmetic type (float64 stays, everything else float32).
// With relu, query rows are qI's [B·Hq, T, dI] and the weights w's [B·Hq, T]; key row b·Hk + g serves query
// rows (b·Hk + g)·G + j. With identity, I_g = (Σ_h w_h qI_h)·kI/√dI: the query rows are the G-fold
// smaller effective queries [B·Hk, T, dI] and there are no weights.
struct KernelInputs {
  at::Tensor qI, w;  // contiguous, original shapes
  at::Tensor q, k;   // [rows, T, dI], [B·Hk, T, dI]
  int64_t heads;     // query rows per key row
};

KernelInputs kernel_inputs(const at::Tensor& qI, const at::Tensor& kI, const at::Tensor& w, bool relu) {
  const at::ScalarType compute = qI.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t B = qI.size(0), Hq = qI.size(1), Hk = kI.size(1), T = qI.size(2), d = qI.size(3);
  KernelInputs in;
  in.qI = qI.to(compute).contiguous();
  in.w = w.to(compute).contiguous();
  in.k = kI.to(compute).contiguous().view({B * Hk, T, d});
  in.heads = relu ? Hq / Hk : 1;
  in.q = relu ? in.qI.view({B * Hq, T, d})
              : (in.qI * in.w.unsqueeze(-1)).view({B, Hk, Hq / Hk, T, d}).sum(2).view({B * Hk, T, d});
  return in;
}

template <typename scalar_t>
struct ScoreKernel {
  const at::Tensor& q;  // query rows [rows, T, d]
  const at::Tensor& k;  // key rows [kv_rows, T, d]
  const scalar_t* w;    // relu: per-row weights [rows, T]; identity: nullptr (folded into q)
  int64_t heads;
  PoolMode pool;
  PoolWindow omega;
  int64_t query_block, key_block;

  int64_t T() const { return q.size(1); }
  scalar_t scale() const { return scalar_t(1) / std::sqrt(static_cast<scalar_t>(q.size(2))); }
  const scalar_t* w_row(int64_t row) const { return w + row * T(); }
  // Per-thread scratch: raw[j] holds head j's products q_j·k of the current tile (relu only).
  at::Tensor scratch() const { return at::empty({w ? heads : 0, query_block * key_block}, q.options()); }
  static at::Tensor tile_of(const at::Tensor& buffer, int64_t nq, int64_t nk) {
    return buffer.narrow(0, 0, nq * nk).view({nq, nk});
  }

  // I over queries s0.. (nq) × keys t0.. (nk) of key row kv_row into `out`; relu keeps the products in raw.
  void scores(int64_t kv_row, int64_t s0, int64_t nq, int64_t t0, int64_t nk, const at::Tensor& raw,
              at::Tensor out) const {
    const at::Tensor k_rows = k[kv_row].narrow(0, t0, nk);
    if (!w) {
      at::mm_out(out, q[kv_row].narrow(0, s0, nq), k_rows.t());
      out.mul_(scale());
      return;
    }
    out.zero_();
    scalar_t* x = out.mutable_data_ptr<scalar_t>();
    for (int64_t j = 0; j < heads; ++j) {
      const int64_t row = kv_row * heads + j;
      at::Tensor u = tile_of(raw[j], nq, nk);
      at::mm_out(u, q[row].narrow(0, s0, nq), k_rows.t());
      const scalar_t* up = u.const_data_ptr<scalar_t>();
      for (int64_t r = 0; r < nq; ++r) {
        const scalar_t ws = w_row(row)[s0 + r] * scale();
        for (int64_t c = 0; c < nk; ++c) x[r * nk + c] += ws * std::max(up[r * nk + c], scalar_t(0));
      }
    }
  }

  // z (and argmax for max) per key: parallel over (key row, key block), so each key's accumulator has one
  // writer. logsumexp keeps a running max m and sum l of exp(I − m) per key, rescaled once per tile.
  void forward(scalar_t* z, int32_t* argmax) const {
    const int64_t kv_rows = k.size(0), key_blocks = (T() + key_block - 1) / key_block;
    const scalar_t minus_inf = -std::numeric_limits<scalar_t>::infinity();
    at::parallel_for(0, kv_rows * key_blocks, 1, [&](int64_t begin, int64_t end) {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      const at::Tensor tile = at::empty({query_block * key_block}, q.options()), raw = scratch();
      std::vector<scalar_t> acc(key_block), sum(key_block), tile_max(key_block);
      std::vector<int32_t> arg(key_block);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t kv_row = task / key_blocks;
        const int64_t t0 = interleaved_block(task % key_blocks, key_blocks) * key_block;
        const int64_t nk = std::min(key_block, T() - t0);
        std::fill_n(acc.begin(), nk, pool == PoolMode::Mean ? scalar_t(0) : minus_inf);
        std::fill_n(sum.begin(), nk, scalar_t(0));
        std::fill_n(arg.begin(), nk, -1);
        for (int64_t s0 = omega.start(t0); s0 < T(); s0 += query_block) {
          const int64_t nq = std::min(query_block, T() - s0);
          const at::Tensor I = tile_of(tile, nq, nk);
          scores(kv_row, s0, nq, t0, nk, raw, I);
          scalar_t* x = I.mutable_data_ptr<scalar_t>();
          if (pool == PoolMode::LogSumExp) std::fill_n(tile_max.begin(), nk, minus_inf);
          for (int64_t r = 0; r < nq; ++r) {
            const int64_t seen = omega.keys_seen_by(s0 + r, t0, nk);
            const scalar_t* xr = x + r * nk;
            if (pool == PoolMode::Mean) {
              for (int64_t c = 0; c < seen; ++c) acc[c] += xr[c];
            } else if (pool == PoolMode::Max) {
              for (int64_t c = 0; c < seen; ++c) {
                if (xr[c] > acc[c]) {  // strict: the first maximising query wins ties
                  acc[c] = xr[c];
                  arg[c] = static_cast<int32_t>(s0 + r);
                }
              }
            } else {
              for (int64_t c = 0; c < seen; ++c) tile_max[c] = std::max(tile_max[c], xr[c]);
            }
          }
          if (pool != PoolMode::LogSumExp) continue;
          for (int64_t c = 0; c < nk; ++c) {
            if (tile_max[c] <= acc[c]) continue;  // includes keys this tile does not reach
            sum[c] *= std::exp(acc[c] - tile_max[c]);
            acc[c] = tile_max[c];
          }
          for (int64_t r = 0; r < nq; ++r) {
            const int64_t seen = omega.keys_seen_by(s0 + r, t0, nk);
            for (int64_t c = 0; c < seen; ++c) x[r * nk + c] -= acc[c];
            std::fill(x + r * nk + seen, x + (r + 1) * nk, minus_inf);
          }
          I.exp_();
          for (int64_t r = 0; r < nq; ++r)
            for (int64_t c = 0; c < nk; ++c) sum[c] += x[r * nk + c];
        }
        for (int64_t c = 0; c < nk; ++c) {
          const int64_t n = omega.size(t0 + c), out = kv_row * T() + t0 + c;
          z[out] = n == 0                   ? minus_inf
                   : pool == PoolMode::Mean ? acc[c] / static_cast<scalar_t>(n)
                   : pool == PoolMode::Max  ? acc[c]
                                            : acc[c] + std::log(sum[c]);
          if (argmax) argmax[out] = arg[c];
        }
      }
    });
  }

  // Overwrites a tile of I with dL/dI = grad_z[t]·∂z_t/∂I[s,t] inside Ω (mean: 1/|Ω(t)|; logsumexp:
  // exp(I − z_t)), 0 outside. gz, z: the key row's [T]. Keys with empty Ω are never inside, so their −inf z
  // and any incoming gradient are never read.
  void pool_grad(const at::Tensor& I, int64_t s0, int64_t nq, int64_t t0, int64_t nk, const scalar_t* gz,
                 const scalar_t* z) const {
    scalar_t* x = I.mutable_data_ptr<scalar_t>();
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t seen = omega.keys_seen_by(s0 + r, t0, nk);
      scalar_t* xr = x + r * nk;
      if (pool == PoolMode::Mean) {
        for (int64_t c = 0; c < seen; ++c) xr[c] = gz[t0 + c] / static_cast<scalar_t>(omega.size(t0 + c));
        std::fill(xr + seen, xr + nk, scalar_t(0));
      } else {
        for (int64_t c = 0; c < seen; ++c) xr[c] -= z[t0 + c];
        std::fill(xr + seen, xr + nk, -std::numeric_limits<scalar_t>::infinity());
      }
    }
    if (pool == PoolMode::Mean) return;
    I.exp_();
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t seen = omega.keys_seen_by(s0 + r, t0, nk);  // outside stays 0, even if grad_z is not finite
      for (int64_t c = 0; c < seen; ++c) x[r * nk + c] *= gz[t0 + c];
    }
  }

  // relu: turns head j's products u (in place) into dL/du / scale = dI·w_j[s]·[u > 0], and adds
  // dL/dw_j[s] = scale·Σ_t dI·relu(u) into grad_w_row when given.
  void head_grad(const at::Tensor& u, const at::Tensor& dI, int64_t row, int64_t s0, scalar_t* grad_w_row) const {
    const int64_t nq = u.size(0), nk = u.size(1);
    scalar_t* up = u.mutable_data_ptr<scalar_t>();
    const scalar_t* g = dI.const_data_ptr<scalar_t>();
    for (int64_t r = 0; r < nq; ++r) {
      const scalar_t ws = w_row(row)[s0 + r];
      scalar_t dw = 0;
      for (int64_t c = 0; c < nk; ++c) {
        const int64_t e = r * nk + c;
        const bool active = up[e] > 0;
        dw += active ? g[e] * up[e] : scalar_t(0);
        up[e] = active ? g[e] * ws : scalar_t(0);
      }
      if (grad_w_row) grad_w_row[s0 + r] += dw * scale();
    }
  }

  // grad k, mean and logsumexp: parallel over (key row, key block), recomputing I over Ω's query blocks.
  void backward_keys(const scalar_t* gz, const scalar_t* z, const at::Tensor& grad_k) const {
    const int64_t kv_rows = k.size(0), key_blocks = (T() + key_block - 1) / key_block;
    at::parallel_for(0, kv_rows * key_blocks, 1, [&](int64_t begin, int64_t end) {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      const at::Tensor tile = at::empty({query_block * key_block}, q.options()), raw = scratch();
      for (int64_t task = begin; task < end; ++task) {
        const int64_t kv_row = task / key_blocks;
        const int64_t t0 = interleaved_block(task % key_blocks, key_blocks) * key_block;
        const int64_t nk = std::min(key_block, T() - t0);
        const at::Tensor dk = grad_k[kv_row].narrow(0, t0, nk);
        for (int64_t s0 = omega.start(t0); s0 < T(); s0 += query_block) {
          const int64_t nq = std::min(query_block, T() - s0);
          const at::Tensor dI = tile_of(tile, nq, nk);
          scores(kv_row, s0, nq, t0, nk, raw, dI);
          pool_grad(dI, s0, nq, t0, nk, gz + kv_row * T(), z + kv_row * T());
          if (!w) {
            dk.addmm_(dI.t(), q[kv_row].narrow(0, s0, nq), 1, scale());
            continue;
          }
          for (int64_t j = 0; j < heads; ++j) {
            const int64_t row = kv_row * heads + j;
            const at::Tensor du = tile_of(raw[j], nq, nk);
            head_grad(du, dI, row, s0, nullptr);
            dk.addmm_(du.t(), q[row].narrow(0, s0, nq), 1, scale());
          }
        }
      }
    });
  }

  // grad q (and w), mean and logsumexp: parallel over (key row, query block): the key row's query rows
  // belong to it alone. Only queries from Ω(0)'s start on are in any window.
  void backward_queries(const scalar_t* gz, const scalar_t* z, const at::Tensor& grad_q, scalar_t* grad_w) const {
    const int64_t kv_rows = k.size(0), first_query = std::min(omega.start(0), T());
    const int64_t query_blocks = (T() - first_query + query_block - 1) / query_block;
    at::parallel_for(0, kv_rows * query_blocks, 1, [&](int64_t begin, int64_t end) {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      const at::Tensor tile = at::empty({query_block * key_block}, q.options()), raw = scratch();
      for (int64_t task = begin; task < end; ++task) {
        const int64_t kv_row = task / query_blocks;
        const int64_t s0 = first_query + interleaved_block(task % query_blocks, query_blocks) * query_block;
        const int64_t nq = std::min(query_block, T() - s0);
        // The block's last query sees keys t ≤ s − min_gap; later key blocks see none of it.
        for (int64_t t0 = 0; t0 <= s0 + nq - 1 - omega.min_gap; t0 += key_block) {
          const int64_t nk = std::min(key_block, T() - t0);
          const at::Tensor k_rows = k[kv_row].narrow(0, t0, nk);
          const at::Tensor dI = tile_of(tile, nq, nk);
          scores(kv_row, s0, nq, t0, nk, raw, dI);
          pool_grad(dI, s0, nq, t0, nk, gz + kv_row * T(), z + kv_row * T());
          if (!w) {
            grad_q[kv_row].narrow(0, s0, nq).addmm_(dI, k_rows, 1, scale());
            continue;
          }
          for (int64_t j = 0; j < heads; ++j) {
            const int64_t row = kv_row * heads + j;
            const at::Tensor du = tile_of(raw[j], nq, nk);
            head_grad(du, dI, row, s0, grad_w + row * T());
            grad_q[row].narrow(0, s0, nq).addmm_(du, k_rows, 1, scale());
          }
        }
      }
    });
  }

  // Max: dz_t/dI[s,t] is 1 at the saved argmax s* only, so each key scatters into one query's rows.
  // Parallel over key rows: a key row's query rows are its own.
  void backward_argmax(const scalar_t* gz, const int32_t* argmax, const at::Tensor& grad_q, const at::Tensor& grad_k,
                       scalar_t* grad_w) const {
    const int64_t d = q.size(2);
    const scalar_t* q_data = q.const_data_ptr<scalar_t>();
    const scalar_t* k_data = k.const_data_ptr<scalar_t>();
    scalar_t* dq_data = grad_q.mutable_data_ptr<scalar_t>();
    scalar_t* dk_data = grad_k.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, k.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t kv_row = begin; kv_row < end; ++kv_row) {
        for (int64_t t = 0; t < T(); ++t) {
          const int64_t s = argmax[kv_row * T() + t];
          if (s < 0) continue;  // empty Ω(t)
          const scalar_t g = gz[kv_row * T() + t] * scale();
          const scalar_t* kt = k_data + (kv_row * T() + t) * d;
          scalar_t* dkt = dk_data + (kv_row * T() + t) * d;
          for (int64_t j = 0; j < heads; ++j) {
            const int64_t row = kv_row * heads + j;
            const scalar_t* qs = q_data + (row * T() + s) * d;
            scalar_t* dqs = dq_data + (row * T() + s) * d;
            scalar_t e = g;
            if (w) {
              scalar_t u = 0;
              for (int64_t i = 0; i < d; ++i) u += qs[i] * kt[i];
              if (u <= 0) continue;
              grad_w[row * T() + s] += g * u;
              e = g * w_row(row)[s];
            }
            for (int64_t i = 0; i < d; ++i) {
              dkt[i] += e * qs[i];
              dqs[i] += e * kt[i];
            }
          }
        }
      }
    });
  }
};

std::tuple<at::Tensor, at::Tensor> pooled_index_score_fwd_cpu(const at::Tensor& qI, const at::Tensor& kI,
                                                              const at::Tensor& w, int64_t pool, int64_t window,
                                                              int64_t min_gap, bool relu, int64_t query_block,
                                                              int64_t key_block) {
  const PoolMode mode = pool_mode_from_int(pool, kOpName);
  check_window_args(kOpName, min_gap, query_block, key_block);
  const int64_t B = kI.size(0), Hk = kI.size(1), T = kI.size(2);
  TORCH_CHECK(T <= std::numeric_limits<int32_t>::max(), kOpName, ": T = ", T, " does not fit the int32 argmax");
  const KernelInputs in = kernel_inputs(qI, kI, w, relu);
  const at::Tensor z = at::empty({B, Hk, T}, in.q.options());
  // Only max pooling has an argmax; the others return an empty placeholder.
  const at::Tensor argmax = at::empty({mode == PoolMode::Max ? B : 0, Hk, T}, qI.options().dtype(at::kInt));
  const PoolWindow omega{T, window, min_gap};
  AT_DISPATCH_FLOATING_TYPES(in.q.scalar_type(), "pooled_index_score_fwd_cpu", [&] {
    const scalar_t* weights = relu ? in.w.const_data_ptr<scalar_t>() : nullptr;
    const ScoreKernel<scalar_t> kernel{in.q, in.k, weights, in.heads, mode, omega, query_block, key_block};
    int32_t* argmax_data = mode == PoolMode::Max ? argmax.mutable_data_ptr<int32_t>() : nullptr;
    kernel.forward(z.mutable_data_ptr<scalar_t>(), argmax_data);
  });
  return {z.to(qI.scalar_type()), argmax};
}

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // grad qI, grad kI, grad w

Grads pooled_index_score_bwd_cpu(const at::Tensor& grad_z, const at::Tensor& qI, const at::Tensor& kI,
                                 const at::Tensor& w, const at::Tensor& z, const at::Tensor& argmax, int64_t pool,
                                 int64_t window, int64_t min_gap, bool relu, int64_t query_block, int64_t key_block) {
  const PoolMode mode = pool_mode_from_int(pool, kOpName);
  check_window_args(kOpName, min_gap, query_block, key_block);
  const int64_t B = qI.size(0), Hq = qI.size(1), Hk = kI.size(1), T = qI.size(2), d = qI.size(3);
  const KernelInputs in = kernel_inputs(qI, kI, w, relu);
  const at::Tensor gz = grad_z.to(in.q.scalar_type()).contiguous(), z_c = z.to(in.q.scalar_type()).contiguous();
  const at::Tensor grad_q = at::zeros_like(in.q), grad_k = at::zeros_like(in.k);
  const at::Tensor grad_w_rows = at::zeros({relu ? B * Hq : 0, T}, in.q.options());
  const PoolWindow omega{T, window, min_gap};
  AT_DISPATCH_FLOATING_TYPES(in.q.scalar_type(), "pooled_index_score_bwd_cpu", [&] {
    const scalar_t* weights = relu ? in.w.const_data_ptr<scalar_t>() : nullptr;
    const ScoreKernel<scalar_t> kernel{in.q, in.k, weights, in.heads, mode, omega, query_block, key_block};
    scalar_t* grad_w = relu ? grad_w_rows.mutable_data_ptr<scalar_t>() : nullptr;
    if (mode == PoolMode::Max) {
      TORCH_CHECK(argmax.sizes() == z.sizes() && argmax.scalar_type() == at::kInt, kOpName,
                  ": max pooling's backward needs the forward's int32 argmax ", z.sizes(), "; got ", argmax.sizes());
      kernel.backward_argmax(gz.const_data_ptr<scalar_t>(), argmax.contiguous().const_data_ptr<int32_t>(), grad_q,
                             grad_k, grad_w);
    } else {
      kernel.backward_keys(gz.const_data_ptr<scalar_t>(), z_c.const_data_ptr<scalar_t>(), grad_k);
      kernel.backward_queries(gz.const_data_ptr<scalar_t>(), z_c.const_data_ptr<scalar_t>(), grad_q, grad_w);
    }
  });
  at::Tensor grad_qI, grad_w;
  if (relu) {
    grad_qI = grad_q.view(qI.sizes());
    grad_w = grad_w_rows.view(w.sizes());
  } else {  // chain rule through the effective query q_g = Σ_{h∈g} w_h qI_h
    const at::Tensor grad_eff = grad_q.view({B, Hk, 1, T, d});
    grad_qI = (grad_eff * in.w.view({B, Hk, Hq / Hk, T, 1})).view(qI.sizes());
    grad_w = (in.qI.view({B, Hk, Hq / Hk, T, d}) * grad_eff).sum(-1).view(w.sizes());
  }
  const at::ScalarType dtype = qI.scalar_type();
  return {grad_qI.to(dtype), grad_k.view(kI.sizes()).to(dtype), grad_w.to(dtype)};
}

using ForwardOp = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                                     int64_t, int64_t, bool, int64_t, int64_t);
using BackwardOp = Grads(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, int64_t, int64_t, int64_t, bool, int64_t, int64_t);

class PooledIndexScoreFunction : public torch::autograd::Function<PooledIndexScoreFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& qI, const at::Tensor& kI,
                            const at::Tensor& w, int64_t pool, int64_t window, int64_t min_gap, bool relu,
                            int64_t query_block, int64_t key_block) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("kvbound::pooled_index_score_fwd", "").typed<ForwardOp>();
    auto [z, argmax] = op.call(qI, kI, w, pool, window, min_gap, relu, query_block, key_block);
    ctx->save_for_backward({qI, kI, w, z, argmax});
    ctx->saved_data["pool"] = pool;
    ctx->saved_data["window"] = window;
    ctx->saved_data["min_gap"] = min_gap;
    ctx->saved_data["relu"] = relu;
    ctx->saved_data["query_block"] = query_block;
    ctx->saved_data["key_block"] = key_block;
    return z;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("kvbound::pooled_index_score_bwd", "").typed<BackwardOp>();
    const auto saved = ctx->get_saved_variables();
    const auto& data = ctx->saved_data;
    auto [grad_qI, grad_kI, grad_w] =
        op.call(grad_outputs[0], saved[0], saved[1], saved[2], saved[3], saved[4], data.at("pool").toInt(),
                data.at("window").toInt(), data.at("min_gap").toInt(), data.at("relu").toBool(),
                data.at("query_block").toInt(), data.at("key_block").toInt());
    torch::autograd::variable_list grads(9);  // none for pool, window, min_gap, relu and the block sizes
    grads[0] = grad_qI;
    grads[1] = grad_kI;
    grads[2] = grad_w;
    return grads;
  }
};

// With act = identity, mean pooling is linear in the queries: mean_{s∈Ω(t)} q_g[s]·kI[t]/√dI =
// kI[t]·(Σ_{s ≥ start(t)} q_g[s]) / (|Ω(t)|·√dI), q_g = Σ_{h∈g} w_h qI_h. One suffix sum over the queries gives
// every key's sum: O(B·Hq·T·dI) work and memory instead of the kernels' O(B·Hq·T²·dI) products, the same value
// up to the order of the sums. Autograd differentiates the few ops (the backward is a prefix sum).
// Arithmetic in float32 (float64 stays float64), like the kernels.
// `first`: the earliest start of any Ω (PoolWindow::start(0), at most T), which pooled_index_score has checked.
at::Tensor linear_mean_score(const at::Tensor& qI, const at::Tensor& kI, const at::Tensor& w, int64_t window,
                             int64_t min_gap, int64_t first) {
  const at::ScalarType compute = qI.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t B = qI.size(0), Hq = qI.size(1), Hk = kI.size(1), T = kI.size(2), d = qI.size(3), G = Hq / Hk;
  const int64_t offset = T - qI.size(2);  // qI's row r is query offset + r
  // Only the queries from the earliest start on are in any Ω (a window's last W, for IndexMem's training): the
  // sums run over those alone, the same additions in the same order (the suffix sum starts at the last row).
  const int64_t S = T - first;
  const at::Tensor q_eff = (qI.narrow(2, first - offset, S).to(compute).reshape({B, Hk, G, S, d}) *
                            w.narrow(2, first - offset, S).to(compute).reshape({B, Hk, G, S, 1}))
                               .sum(2);  // [B, Hk, S, d]
  // Row r: Σ_{s ≥ first + r} q_g[s], for r = 0..S (row S is the empty sum of keys whose Ω is empty).
  const at::Tensor suffix =
      at::cat({q_eff.flip({2}).cumsum(2).flip({2}), at::zeros({B, Hk, 1, d}, q_eff.options())}, 2);
  const at::Tensor starts = window_starts(T, window, min_gap, q_eff.options()).clamp_max(T);
  const at::Tensor sizes = (T - starts).to(compute);
  const at::Tensor mean = gathered_row_dot(suffix, starts - first, kI.to(compute)) /
                          (sizes.clamp_min(1) * std::sqrt(static_cast<double>(d)));
  return at::where(sizes > 0, mean, -std::numeric_limits<double>::infinity()).to(qI.scalar_type());
}

}  // namespace

at::Tensor pooled_index_score(const at::Tensor& qI, const at::Tensor& kI, const at::Tensor& w, PoolMode pool,
                              int64_t window, int64_t min_gap, bool relu, int64_t query_block, int64_t key_block) {
  check_inputs(qI, kI, w, /*last_queries=*/true);
  // Checked here before the window's start is computed and the linear path taken; the registered forward checks
  // again, as it is callable through the dispatcher on its own.
  check_window_args(kOpName, min_gap, query_block, key_block);
  const int64_t T = kI.size(2), missing = T - qI.size(2);
  const int64_t first = std::min(PoolWindow{T, window, min_gap}.start(0), T);
  TORCH_CHECK(missing <= first, kOpName, ": qI and w hold the last ", qI.size(2), " of ", T,
              " queries, but the windows start at query ", first);
  if (!relu && pool == PoolMode::Mean) return linear_mean_score(qI, kI, w, window, min_gap, first);
  // The kernels take every query: the missing ones, which no Ω holds, as zeros.
  const at::Tensor q_all = missing > 0 ? at::constant_pad_nd(qI, {0, 0, missing, 0}) : qI;
  const at::Tensor w_all = missing > 0 ? at::constant_pad_nd(w, {missing, 0}) : w;
  return PooledIndexScoreFunction::apply(q_all, kI, w_all, static_cast<int64_t>(pool), window, min_gap, relu,
                                         query_block, key_block);
}

at::Tensor pooled_index_score_reference(const at::Tensor& qI, const at::Tensor& kI, const at::Tensor& w, PoolMode pool,
                                        int64_t window, int64_t min_gap, bool relu) {
  check_inputs(qI, kI, w);
  TORCH_CHECK(min_gap >= 0, kOpName, ": min_gap must be ≥ 0; got ", min_gap);
  const int64_t B = qI.size(0), Hk = kI.size(1), group = qI.size(1) / Hk, T = qI.size(2);
  at::Tensor products = at::matmul(qI, kI.repeat_interleave(group, 1).transpose(-2, -1));  // [B, Hq, T (s), T (t)]
  if (relu) products = at::relu(products);
  const at::Tensor scores =
      (products * w.unsqueeze(-1)).reshape({B, Hk, group, T, T}).sum(2) / std::sqrt(static_cast<double>(qI.size(3)));
  return pool_window_reference(scores, pool, window, min_gap, -std::numeric_limits<double>::infinity());
}

}  // namespace kvbound::ops

TORCH_LIBRARY_FRAGMENT(kvbound, m) {
  m.def(
      "pooled_index_score_fwd(Tensor qI, Tensor kI, Tensor w, int pool, int window, int min_gap, bool relu, "
      "int query_block, int key_block) -> (Tensor z, Tensor argmax)");
  m.def(
      "pooled_index_score_bwd(Tensor grad_z, Tensor qI, Tensor kI, Tensor w, Tensor z, Tensor argmax, int pool, "
      "int window, int min_gap, bool relu, int query_block, int key_block) -> (Tensor grad_qI, Tensor grad_kI, "
      "Tensor grad_w)");
}

TORCH_LIBRARY_IMPL(kvbound, CPU, m) {
  m.impl("pooled_index_score_fwd", &kvbound::ops::pooled_index_score_fwd_cpu);
  m.impl("pooled_index_score_bwd", &kvbound::ops::pooled_index_score_bwd_cpu);
}
