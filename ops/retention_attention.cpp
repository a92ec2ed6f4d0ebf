#include "ops/retention_attention.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/softmax.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "ops/cpu_vector.h"

namespace kvbound::ops {
namespace {

constexpr const char* kOpName = "kvbound::retention_attention";

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& log_beta) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && log_beta.dim() == 3, kOpName,
              ": expected q [B, Hq, T, D], k and v [B, Hkv, T, D], log_beta [B, Hkv, T]; got q ", q.sizes(), ", k ",
              k.sizes(), ", v ", v.sizes(), ", log_beta ", log_beta.sizes());
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.size(3) == q.size(3),
              kOpName, ": k and v must be [B, Hkv, T, D] matching q ", q.sizes(), "; got k ", k.sizes(), ", v ",
              v.sizes());
  TORCH_CHECK(log_beta.size(0) == k.size(0) && log_beta.size(1) == k.size(1) && log_beta.size(2) == k.size(2), kOpName,
              ": log_beta must be [B, Hkv, T] = ", k.sizes().slice(0, 3), "; got ", log_beta.sizes());
  TORCH_CHECK(q.size(3) > 0, kOpName, ": head_dim must be positive; got q ", q.sizes());
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, kOpName, ": query heads (", q.size(1),
              ") must be a positive multiple of KV heads (", k.size(1), ")");
  TORCH_CHECK(at::isFloatingType(q.scalar_type()) && k.scalar_type() == q.scalar_type() &&
                  v.scalar_type() == q.scalar_type() && log_beta.scalar_type() == q.scalar_type(),
              kOpName, ": q, k, v and log_beta must share one floating dtype; got ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type(), ", ", log_beta.scalar_type());
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device() && log_beta.device() == q.device(), kOpName,
              ": q, k, v and log_beta must be on one device");
}

// The CPU kernel's arithmetic type: float64 stays float64, everything else accumulates in float32.
at::ScalarType cpu_compute_type(at::ScalarType dtype) { return dtype == at::kDouble ? at::kDouble : at::kFloat; }

// Rows flattened as [B·H, T, D]: batch b, query head h is row b·Hq + h, and since Hq = group·Hkv its KV row
// b·Hkv + h/group is exactly (b·Hq + h) / group.
at::Tensor flat_rows(const at::Tensor& x, at::ScalarType compute) {
  const at::Tensor c = x.to(compute).contiguous();
  return x.dim() == 4 ? c.view({x.size(0) * x.size(1), x.size(2), x.size(3)})
                      : c.view({x.size(0) * x.size(1), x.size(2)});
}

// C[M×N] = (accumulate ? C : 0) + A[M×K]·B[K×N], row-major with leading dimensions: every product of a tile.
// float runs oneDNN's batch-reduce GEMM micro-kernel on the raw pointers (cpublas::brgemm: no tensor views, no
// dispatcher, no packing per call; at::mm per tile made the op 5× slower, DESIGN.md); double, which the tests'
// tight comparisons use, a plain loop.
void tile_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
               int64_t ldc, bool accumulate) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, A, B, C, /*is_vnni=*/false);
}

void tile_gemm(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B, int64_t ldb, double* C,
               int64_t ldc, bool accumulate) {
  for (int64_t m = 0; m < M; ++m) {
    double* c = C + m * ldc;
    if (!accumulate) std::fill_n(c, N, 0.0);
    for (int64_t k = 0; k < K; ++k) {
      const double a = A[m * lda + k];
      const double* b = B + k * ldb;
      for (int64_t n = 0; n < N; ++n) c[n] += a * b[n];
    }
  }
}

// x ← e^x in place for x ≤ 0 (−∞ gives 0): float by ops/cpu_vector.h's exp2 polynomial (~1 ulp, vectorized),
// double by std::exp.
KVBOUND_VECTOR_CLONES void exp_nonpositive_in_place(float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = cpu::exp2_nonpositive(x[i] * 1.44269504088896341f);
}

void exp_nonpositive_in_place(double* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
}

// [rows, T, D] → [rows, D, T]: the right-hand operand of products against the transposed matrix (q·kᵀ, dO·vᵀ).
at::Tensor transposed_rows(const at::Tensor& x) { return x.transpose(1, 2).contiguous(); }

// Online-softmax forward over key blocks (FlashAttention-2, Alg. 1): per query row keep the running max m
// and sum l of exp(logit − m); a new key block with max m' rescales l and the output row by exp(m − m').
// Saves lse = m + log l per row.
template <typename scalar_t>
void forward_blocked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& log_beta,
                     const at::Tensor& out, const at::Tensor& lse, int64_t query_block, int64_t key_block) {
  const int64_t rows = q.size(0), T = q.size(1), D = q.size(2);
  const int64_t group = rows / k.size(0);
  const int64_t query_blocks = (T + query_block - 1) / query_block;
  const scalar_t scale = scalar_t(1) / std::sqrt(static_cast<scalar_t>(D));
  const scalar_t minus_inf = -std::numeric_limits<scalar_t>::infinity();
  const at::Tensor k_t = transposed_rows(k);
  const scalar_t *q_data = q.const_data_ptr<scalar_t>(), *kt_data = k_t.const_data_ptr<scalar_t>();
  const scalar_t *v_data = v.const_data_ptr<scalar_t>(), *log_beta_data = log_beta.const_data_ptr<scalar_t>();
  scalar_t *out_data = out.mutable_data_ptr<scalar_t>(), *lse_data = lse.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, rows * query_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> tile(static_cast<size_t>(query_block * key_block)), row_max(query_block), row_sum(query_block);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / query_blocks, kv_row = row / group;
      const int64_t t0 = (task % query_blocks) * query_block, nq = std::min(query_block, T - t0);
      const scalar_t* beta = log_beta_data + kv_row * T;
      const scalar_t* q_rows = q_data + (row * T + t0) * D;
      scalar_t* o = out_data + (row * T + t0) * D;
      std::fill_n(o, nq * D, scalar_t(0));
      std::fill_n(row_max.begin(), nq, minus_inf);
      std::fill_n(row_sum.begin(), nq, scalar_t(0));
      // Causal: key blocks starting after the block's last query hold only masked logits.
      for (int64_t s0 = 0; s0 < t0 + nq; s0 += key_block) {
        const int64_t nk = std::min(key_block, T - s0);
        scalar_t* x = tile.data();
        tile_gemm(nq, nk, D, q_rows, D, kt_data + kv_row * D * T + s0, T, x, nk, false);
        for (int64_t r = 0; r < nq; ++r) {
          const int64_t t = t0 + r, visible = std::clamp<int64_t>(t - s0 + 1, 0, nk);
          scalar_t* xr = x + r * nk;
          scalar_t block_max = minus_inf;
          for (int64_t c = 0; c < visible; ++c) {
            xr[c] = xr[c] * scale + static_cast<scalar_t>(t - s0 - c) * beta[s0 + c];
            block_max = std::max(block_max, xr[c]);
          }
          std::fill(xr + visible, xr + nk, minus_inf);
          // Finite: the first key block holds key 0 ≤ t, so every row has a finite max from then on.
          const scalar_t new_max = std::max(row_max[r], block_max);
          const scalar_t rescale = std::exp(row_max[r] - new_max);
          row_max[r] = new_max;
          row_sum[r] *= rescale;
          for (int64_t c = 0; c < nk; ++c) xr[c] -= new_max;
          for (int64_t d = 0; d < D; ++d) o[r * D + d] *= rescale;
        }
        exp_nonpositive_in_place(x, nq * nk);  // masked entries become 0
        for (int64_t r = 0; r < nq; ++r) {
          const scalar_t* pr = x + r * nk;
          scalar_t sum = 0;
          for (int64_t c = 0; c < nk; ++c) sum += pr[c];
          row_sum[r] += sum;
        }
        tile_gemm(nq, D, nk, x, nk, v_data + (kv_row * T + s0) * D, D, o, D, true);
      }
      for (int64_t r = 0; r < nq; ++r) {
        const scalar_t inv_sum = scalar_t(1) / row_sum[r];
        for (int64_t d = 0; d < D; ++d) o[r * D + d] *= inv_sum;
        lse_data[row * T + t0 + r] = row_max[r] + std::log(row_sum[r]);
      }
    }
  });
}

// Backward in two parallel passes so that every output element has one writer (no atomics, deterministic):
// pass 1 over (row, query block) accumulates dQ = scale·dS·K; pass 2 over (KV row, key block) sums the
// group's query heads into dV = Pᵀ·dO, dK = scale·dSᵀ·Q and d log_beta_i = Σ_t dS[t,i]·(t−i) (the bias
// (t−i)·log_beta_i enters the logit unscaled). Each pass recomputes its tiles of P = exp(logit − lse) and
// dS = P ∘ (dO·vᵀ − Δ_t) (FlashAttention-2, Alg. 2); pass 2 forms them transposed, keys along the rows, so that
// its products and the d log_beta sums read them row by row.
template <typename scalar_t>
void backward_blocked(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& log_beta, const at::Tensor& out, const at::Tensor& lse,
                      const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& grad_v,
                      const at::Tensor& grad_log_beta, int64_t query_block, int64_t key_block) {
  const int64_t rows = q.size(0), kv_rows = k.size(0), T = q.size(1), D = q.size(2);
  const int64_t group = rows / kv_rows;
  const int64_t query_blocks = (T + query_block - 1) / query_block;
  const int64_t key_blocks = (T + key_block - 1) / key_block;
  const scalar_t scale = scalar_t(1) / std::sqrt(static_cast<scalar_t>(D));
  const scalar_t minus_inf = -std::numeric_limits<scalar_t>::infinity();
  const scalar_t *q_data = q.const_data_ptr<scalar_t>(), *k_data = k.const_data_ptr<scalar_t>();
  const scalar_t *v_data = v.const_data_ptr<scalar_t>(), *g_data = grad_out.const_data_ptr<scalar_t>();
  const scalar_t *log_beta_data = log_beta.const_data_ptr<scalar_t>(), *lse_data = lse.const_data_ptr<scalar_t>();

  // Δ_t = dO_t·O_t = Σ_i P[t,i]·dP[t,i], the softmax backward's row term.
  const at::Tensor delta = at::empty({rows, T}, q.options());
  {
    const scalar_t* o = out.const_data_ptr<scalar_t>();
    scalar_t* dl = delta.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows * T, 256, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        scalar_t sum = 0;
        for (int64_t d = 0; d < D; ++d) sum += g_data[t * D + d] * o[t * D + d];
        dl[t] = sum;
      }
    });
  }
  const scalar_t* delta_data = delta.const_data_ptr<scalar_t>();

  // Pass 1: dQ. P and dP = dO·vᵀ per (query block, key block) tile.
  {
    const at::Tensor k_t = transposed_rows(k), v_t = transposed_rows(v);
    const scalar_t *kt_data = k_t.const_data_ptr<scalar_t>(), *vt_data = v_t.const_data_ptr<scalar_t>();
    scalar_t* dq_data = grad_q.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows * query_blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> probs(static_cast<size_t>(query_block * key_block)), dlogits(probs.size());
      for (int64_t task = begin; task < end; ++task) {
        const int64_t row = task / query_blocks, kv_row = row / group;
        const int64_t t0 = (task % query_blocks) * query_block, nq = std::min(query_block, T - t0);
        const scalar_t *beta = log_beta_data + kv_row * T, *row_lse = lse_data + row * T, *row_delta = delta_data + row * T;
        scalar_t* dq = dq_data + (row * T + t0) * D;
        for (int64_t s0 = 0; s0 < t0 + nq; s0 += key_block) {
          const int64_t nk = std::min(key_block, T - s0);
          scalar_t *p = probs.data(), *ds = dlogits.data();
          tile_gemm(nq, nk, D, q_data + (row * T + t0) * D, D, kt_data + kv_row * D * T + s0, T, p, nk, false);
          tile_gemm(nq, nk, D, g_data + (row * T + t0) * D, D, vt_data + kv_row * D * T + s0, T, ds, nk, false);
          for (int64_t r = 0; r < nq; ++r) {
            const int64_t t = t0 + r, visible = std::clamp<int64_t>(t - s0 + 1, 0, nk);
            scalar_t* pr = p + r * nk;
            for (int64_t c = 0; c < visible; ++c)
              pr[c] = pr[c] * scale + static_cast<scalar_t>(t - s0 - c) * beta[s0 + c] - row_lse[t];
            std::fill(pr + visible, pr + nk, minus_inf);
          }
          exp_nonpositive_in_place(p, nq * nk);
          for (int64_t r = 0; r < nq; ++r) {
            const scalar_t delta_t = row_delta[t0 + r];
            for (int64_t c = 0; c < nk; ++c) ds[r * nk + c] = p[r * nk + c] * (ds[r * nk + c] - delta_t);
          }
          tile_gemm(nq, D, nk, ds, nk, k_data + (kv_row * T + s0) * D, D, dq, D, s0 > 0);
        }
        for (int64_t i = 0; i < nq * D; ++i) dq[i] *= scale;
      }
    });
  }

  // Pass 2: dK, dV, d log_beta. Tiles transposed: Pᵀ = exp(k·qᵀ·scale + bias − lse) and dSᵀ, [key, query].
  const at::Tensor q_t = transposed_rows(q), g_t = transposed_rows(grad_out);
  const scalar_t *qt_data = q_t.const_data_ptr<scalar_t>(), *gt_data = g_t.const_data_ptr<scalar_t>();
  scalar_t *dk_data = grad_k.mutable_data_ptr<scalar_t>(), *dv_data = grad_v.mutable_data_ptr<scalar_t>();
  scalar_t* grad_log_beta_data = grad_log_beta.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, kv_rows * key_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> probs(static_cast<size_t>(query_block * key_block)), dlogits(probs.size());
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv_row = task / key_blocks;
      const int64_t s0 = (task % key_blocks) * key_block, nk = std::min(key_block, T - s0);
      const scalar_t* beta = log_beta_data + kv_row * T;
      const scalar_t *k_rows = k_data + (kv_row * T + s0) * D, *v_rows = v_data + (kv_row * T + s0) * D;
      scalar_t *dk = dk_data + (kv_row * T + s0) * D, *dv = dv_data + (kv_row * T + s0) * D;
      scalar_t* dbeta = grad_log_beta_data + kv_row * T + s0;
      std::fill_n(dk, nk * D, scalar_t(0));
      std::fill_n(dv, nk * D, scalar_t(0));
      std::fill_n(dbeta, nk, scalar_t(0));
      for (int64_t row = kv_row * group; row < (kv_row + 1) * group; ++row) {
        const scalar_t *row_lse = lse_data + row * T, *row_delta = delta_data + row * T;
        // Query blocks ending before s0 only see earlier keys.
        for (int64_t t0 = s0 / query_block * query_block; t0 < T; t0 += query_block) {
          const int64_t nq = std::min(query_block, T - t0);
          scalar_t *pt = probs.data(), *dst = dlogits.data();
          tile_gemm(nk, nq, D, k_rows, D, qt_data + row * D * T + t0, T, pt, nq, false);
          tile_gemm(nk, nq, D, v_rows, D, gt_data + row * D * T + t0, T, dst, nq, false);
          for (int64_t c = 0; c < nk; ++c) {
            const int64_t i = s0 + c, first = std::clamp<int64_t>(i - t0, 0, nq);  // queries t ≥ i see key i
            scalar_t* pc = pt + c * nq;
            std::fill(pc, pc + first, minus_inf);
            for (int64_t r = first; r < nq; ++r)
              pc[r] = pc[r] * scale + static_cast<scalar_t>(t0 + r - i) * beta[i] - row_lse[t0 + r];
          }
          exp_nonpositive_in_place(pt, nk * nq);
          for (int64_t c = 0; c < nk; ++c) {
            const int64_t i = s0 + c;
            scalar_t* dsc = dst + c * nq;
            const scalar_t* pc = pt + c * nq;
            scalar_t sum = 0;
            // Masked entries have P = 0, so dS = 0 there and their negative ages add nothing.
            for (int64_t r = 0; r < nq; ++r) {
              dsc[r] = pc[r] * (dsc[r] - row_delta[t0 + r]);
              sum += dsc[r] * static_cast<scalar_t>(t0 + r - i);
            }
            dbeta[c] += sum;
          }
          tile_gemm(nk, D, nq, pt, nq, g_data + (row * T + t0) * D, D, dv, D, true);
          tile_gemm(nk, D, nq, dst, nq, q_data + (row * T + t0) * D, D, dk, D, true);
        }
      }
      for (int64_t i = 0; i < nk * D; ++i) dk[i] *= scale;
    }
  });
}

std::tuple<at::Tensor, at::Tensor> retention_attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v, const at::Tensor& log_beta,
                                                               int64_t query_block, int64_t key_block) {
  TORCH_CHECK(query_block > 0 && key_block > 0, kOpName, ": block sizes must be positive; got ", query_block, " and ",
              key_block);
  const at::ScalarType compute = cpu_compute_type(q.scalar_type());
  const at::Tensor q_flat = flat_rows(q, compute), k_flat = flat_rows(k, compute), v_flat = flat_rows(v, compute);
  const at::Tensor log_beta_flat = flat_rows(log_beta, compute);
  const at::Tensor out = at::empty_like(q_flat);
  const at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q_flat.options());
  AT_DISPATCH_FLOATING_TYPES(compute, "retention_attention_fwd_cpu", [&] {
    forward_blocked<scalar_t>(q_flat, k_flat, v_flat, log_beta_flat, out, lse.view({q_flat.size(0), q.size(2)}),
                              query_block, key_block);
  });
  return {out.view(q.sizes()).to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> retention_attention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& log_beta, const at::Tensor& out, const at::Tensor& lse, int64_t query_block, int64_t key_block) {
  TORCH_CHECK(query_block > 0 && key_block > 0, kOpName, ": block sizes must be positive; got ", query_block, " and ",
              key_block);
  const at::ScalarType compute = cpu_compute_type(q.scalar_type());
  const at::Tensor q_flat = flat_rows(q, compute), k_flat = flat_rows(k, compute), v_flat = flat_rows(v, compute);
  const at::Tensor grad_q = at::empty_like(q_flat), grad_k = at::empty_like(k_flat), grad_v = at::empty_like(v_flat);
  const at::Tensor grad_log_beta = at::empty({log_beta.size(0) * log_beta.size(1), log_beta.size(2)}, q_flat.options());
  AT_DISPATCH_FLOATING_TYPES(compute, "retention_attention_bwd_cpu", [&] {
    backward_blocked<scalar_t>(flat_rows(grad_out, compute), q_flat, k_flat, v_flat, flat_rows(log_beta, compute),
                               flat_rows(out, compute), flat_rows(lse, compute), grad_q, grad_k, grad_v, grad_log_beta,
                               query_block, key_block);
  });
  const at::ScalarType dtype = q.scalar_type();
  return {grad_q.view(q.sizes()).to(dtype), grad_k.view(k.sizes()).to(dtype), grad_v.view(v.sizes()).to(dtype),
          grad_log_beta.view(log_beta.sizes()).to(dtype)};
}

using ForwardOp = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, int64_t, int64_t);
using BackwardOp = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                              const at::Tensor&, const at::Tensor&,
                                                                              const at::Tensor&, const at::Tensor&,
                                                                              const at::Tensor&, int64_t, int64_t);

class RetentionAttentionFunction : public torch::autograd::Function<RetentionAttentionFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& log_beta, int64_t query_block, int64_t key_block) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("kvbound::retention_attention_fwd", "").typed<ForwardOp>();
    auto [out, lse] = op.call(q, k, v, log_beta, query_block, key_block);
    ctx->save_for_backward({q, k, v, log_beta, out, lse});
    ctx->saved_data["query_block"] = query_block;
    ctx->saved_data["key_block"] = key_block;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("kvbound::retention_attention_bwd", "").typed<BackwardOp>();
    const auto saved = ctx->get_saved_variables();
    auto [grad_q, grad_k, grad_v, grad_log_beta] =
        op.call(grad_outputs[0], saved[0], saved[1], saved[2], saved[3], saved[4], saved[5],
                ctx->saved_data["query_block"].toInt(), ctx->saved_data["key_block"].toInt());
    return {grad_q, grad_k, grad_v, grad_log_beta, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor retention_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& log_beta, int64_t query_block, int64_t key_block) {
  check_inputs(q, k, v, log_beta);
  return RetentionAttentionFunction::apply(q, k, v, log_beta, query_block, key_block);
}

at::Tensor retention_attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& log_beta) {
  check_inputs(q, k, v, log_beta);
  const int64_t group = q.size(1) / k.size(1), T = q.size(2);
  const at::Tensor k_heads = k.repeat_interleave(group, 1), v_heads = v.repeat_interleave(group, 1);
  const at::Tensor log_beta_heads = log_beta.repeat_interleave(group, 1).unsqueeze(-2);  // [B, Hq, 1, T]: key i
  // Integer ages t − i, so the bias is rounded once, in q's dtype.
  const at::Tensor positions = at::arange(T, q.options().dtype(at::kLong));
  const at::Tensor age = positions.unsqueeze(1) - positions.unsqueeze(0);
  const at::Tensor logits = (at::matmul(q, k_heads.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(3))) +
                             age.clamp_min(0) * log_beta_heads)
                                .masked_fill(age.lt(0), -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(logits, -1), v_heads);
}

}  // namespace kvbound::ops

TORCH_LIBRARY_FRAGMENT(kvbound, m) {
  m.def(
      "retention_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor log_beta, int query_block, int key_block) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "retention_attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor log_beta, Tensor out, "
      "Tensor lse, int query_block, int key_block) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, "
      "Tensor grad_log_beta)");
}

TORCH_LIBRARY_IMPL(kvbound, CPU, m) {
  m.impl("retention_attention_fwd", &kvbound::ops::retention_attention_fwd_cpu);
  m.impl("retention_attention_bwd", &kvbound::ops::retention_attention_bwd_cpu);
}
