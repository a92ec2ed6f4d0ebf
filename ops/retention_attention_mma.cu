// kvbound::retention_attention on tensor cores, FlashAttention-2 style, for bf16/fp16 inputs with head dim
// 64 or 128 (ops/retention_attention_mma.h; the fp32 SIMT kernels of retention_attention_cuda.cu take the
// rest). Every product is mma.sync m16n8k16 with fp32 accumulation (sm_80+); operands come from shared
// memory through ldmatrix, tiles arrive by cp.async one tile ahead of the one being used.
//
// A block has 4 warps; a warp owns 16 rows (queries, or keys in the dK/dV kernel) and streams the other side
// in tiles of 64 rows. The logit q_t·k_i/√D + (t−i)·log β_i is formed in fp32 registers from the mma result;
// P and dS are rounded to the input dtype only as operands of the next mma (as FlashAttention does).
//   forward  (rows = queries): S = QKᵀ, online softmax, O += P V; saves lse_t = m_t + log l_t.
//   dQ       (rows = queries): dP = dO Vᵀ, dS = P∘(dP − Δ), dQ += dS K.
//   dK, dV, d log β (rows = keys of one KV head, walking its group's query heads):
//            Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, dV += Pᵀ dO, dK += dSᵀ Q, d log β_i += Σ_t dSᵀ[i,t]·(t−i).
// Every output element has one writer and a fixed summation order: no atomics, deterministic. The building
// blocks (fragments, ldmatrix, cp.async tiles) are ops/mma_tiles.cuh's.
#include "ops/retention_attention_mma.h"
#include "ops/mma_tiles.cuh"

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

namespace kvbound::ops::mma {
namespace {

// Shared memory of the query-row kernels: two stages of K and V tiles and of log β; dQ also holds the block's
// Q and dO rows (as operands from shared memory they leave registers for the accumulators: no spills at D = 128).
template <int D, bool kGrad>
constexpr size_t query_rows_smem() {
  return 2 * (2 * kTile * pitch<D>() * sizeof(uint16_t) + kTile * sizeof(float)) +
         (kGrad ? 2 * kBlockRows * pitch<D>() * sizeof(uint16_t) : 0);
}
// dK/dV: the block's own K and V rows, and two stages of Q, dO, lse and Δ tiles.
template <int D>
constexpr size_t key_rows_smem() {
  return 2 * kBlockRows * pitch<D>() * sizeof(uint16_t) + 2 * (2 * kTile * pitch<D>() * sizeof(uint16_t) + 2 * kTile * sizeof(float));
}

// Grid: x = query row b·Hq + h (KV row (b·Hq + h)/group), y = block of 64 queries. kGrad = false: forward
// (writes out, lse_out); true: dQ (reads grad_out, lse_in, Δ; writes grad_q into `out`).
template <typename scalar_t, int D, bool kGrad>
__global__ void __launch_bounds__(kThreads)
    query_rows_kernel(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k, const uint16_t* __restrict__ v,
                      const uint16_t* __restrict__ log_beta, const uint16_t* __restrict__ grad_out,
                      const float* __restrict__ lse_in, const float* __restrict__ delta, uint16_t* __restrict__ out,
                      float* __restrict__ lse_out, int64_t T, int group, float scale) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint16_t* kv_s = reinterpret_cast<uint16_t*>(smem_raw);  // [stage][K | V][kTile][pitch]
  float* beta_s = reinterpret_cast<float*>(kv_s + 2 * 2 * kTile * pitch<D>());  // [stage][kTile]
  uint16_t* q_rows = reinterpret_cast<uint16_t*>(beta_s + 2 * kTile);  // dQ: [Q | dO][kBlockRows][pitch]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, c = lane & 3;
  const int64_t row = blockIdx.x, kv_row = row / group;
  // The last query blocks have the most keys: they start first, the short ones fill in behind them.
  const int64_t block_q0 = static_cast<int64_t>(gridDim.y - 1 - blockIdx.y) * kBlockRows, q0 = block_q0 + 16 * warp;
  const int64_t t_lo = q0 + g, t_hi = t_lo + 8;
  const int64_t last = min(block_q0 + kBlockRows, T) - 1;  // later keys are masked for every row of the block
  const uint16_t* k_head = k + kv_row * T * D;
  const uint16_t* v_head = v + kv_row * T * D;
  const uint16_t* beta_head = log_beta + kv_row * T;

  uint32_t qf[kGrad ? 1 : D / 16][4];  // forward: Q in registers
  float lse_lo = 0.f, lse_hi = 0.f, delta_lo = 0.f, delta_hi = 0.f;
  if constexpr (!kGrad) {
    load_row_fragments<D>(qf, q + row * T * D, q0, T);
  } else {
    // One cp.async group ahead of tile 0's: the first wait covers both.
    load_tile_async<D, kBlockRows>(q_rows, q + row * T * D, block_q0, T);
    load_tile_async<D, kBlockRows>(q_rows + kBlockRows * pitch<D>(), grad_out + row * T * D, block_q0, T);
    cp_async_commit();
    if (t_lo < T) lse_lo = lse_in[row * T + t_lo], delta_lo = delta[row * T + t_lo];
    if (t_hi < T) lse_hi = lse_in[row * T + t_hi], delta_hi = delta[row * T + t_hi];
  }
  float acc[D / 8][4] = {};
  OnlineSoftmaxRows softmax;  // forward only

  const int tiles = static_cast<int>(last / kTile) + 1;
  float beta_next = 0.f;  // threads 0..kTile−1: log β of the issued tile
  auto issue = [&](int n) {
    uint16_t* stage = kv_s + (n & 1) * 2 * kTile * pitch<D>();
    load_tile_async<D, kTile>(stage, k_head, static_cast<int64_t>(n) * kTile, T);
    load_tile_async<D, kTile>(stage + kTile * pitch<D>(), v_head, static_cast<int64_t>(n) * kTile, T);
    cp_async_commit();
    if (threadIdx.x < kTile) beta_next = vector_entry<scalar_t>(beta_head, static_cast<int64_t>(n) * kTile, T);
  };
  // Stage n & 1's last readers were in iteration n − 2, which a barrier closed.
  auto stage_vectors = [&](int n) {
    if (threadIdx.x < kTile) beta_s[(n & 1) * kTile + threadIdx.x] = beta_next;
  };
  issue(0);
  stage_vectors(0);
  for (int n = 0; n < tiles; ++n) {
    issue_next_and_wait(n, tiles, issue);
    __syncthreads();  // tile n (and its log β) is visible to every warp
    const int64_t s0 = static_cast<int64_t>(n) * kTile;
    const uint16_t* k_s = kv_s + (n & 1) * 2 * kTile * pitch<D>();
    const uint16_t* v_s = k_s + kTile * pitch<D>();
    const float* b_s = beta_s + (n & 1) * kTile;
    if (q0 < T && s0 <= q0 + 15) {  // warp-uniform: some row of the warp sees some key of the tile
      // Ages t − i = (t − s0) − col in 32 bits; a row past T sees nothing.
      const int age_lo = t_lo < T ? static_cast<int>(t_lo - s0) : -kTile;
      const int age_hi = t_hi < T ? static_cast<int>(t_hi - s0) : -kTile;
      float s[kTile / 8][4] = {};
      float dp[kGrad ? kTile / 8 : 1][4] = {};
      if constexpr (kGrad) {
        mma_shared_rows_by_tile_rows<scalar_t, D>(s, q_rows, 16 * warp, k_s);                               // S = Q Kᵀ
        mma_shared_rows_by_tile_rows<scalar_t, D>(dp, q_rows + kBlockRows * pitch<D>(), 16 * warp, v_s);  // dP = dO Vᵀ
      } else {
        mma_rows_by_tile_rows<scalar_t, D>(s, qf, k_s);  // S = Q Kᵀ
      }
      float tile_max_lo = -INFINITY, tile_max_hi = -INFINITY;
#pragma unroll
      for (int j = 0; j < kTile / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = 8 * j + 2 * c + (e & 1);
          const int age = (e < 2 ? age_lo : age_hi) - col;
          const float logit = age >= 0 ? s[j][e] * scale + static_cast<float>(age) * b_s[col] : -INFINITY;
          if constexpr (kGrad) {
            const float p = age >= 0 ? __expf(logit - (e < 2 ? lse_lo : lse_hi)) : 0.f;
            s[j][e] = p * (dp[j][e] - (e < 2 ? delta_lo : delta_hi));  // dS
          } else {
            s[j][e] = logit;
            if (e < 2)
              tile_max_lo = fmaxf(tile_max_lo, logit);
            else
              tile_max_hi = fmaxf(tile_max_hi, logit);
          }
        }
      }
      if constexpr (kGrad) {
        mma_fragments_by_tile<scalar_t, D>(acc, s, k_s);  // dQ += dS K
      } else {
        float rescale_lo, rescale_hi;
        softmax.absorb(s, tile_max_lo, tile_max_hi, rescale_lo, rescale_hi);  // s = P
#pragma unroll
        for (int d = 0; d < D / 8; ++d) {
          acc[d][0] *= rescale_lo;
          acc[d][1] *= rescale_lo;
          acc[d][2] *= rescale_hi;
          acc[d][3] *= rescale_hi;
        }
        mma_fragments_by_tile<scalar_t, D>(acc, s, v_s);  // O += P V
      }
    }
    if (n + 1 < tiles) stage_vectors(n + 1);
    __syncthreads();  // every warp is done with stage n & 1 before tile n + 2 is issued into it
  }
  if (q0 >= T) return;
  if constexpr (kGrad) {
    store_rows<scalar_t, D>(out + row * T * D, acc, q0, T, scale, scale);
  } else {
    softmax.finish();
    store_rows<scalar_t, D>(out + row * T * D, acc, q0, T, 1.f / softmax.l_lo, 1.f / softmax.l_hi);
    if (c == 0) {
      if (t_lo < T) lse_out[row * T + t_lo] = softmax.lse_lo();
      if (t_hi < T) lse_out[row * T + t_hi] = softmax.lse_hi();
    }
  }
}

// Grid: x = KV row b·Hkv + g (query rows (b·Hkv + g)·group ...), y = block of 64 keys.
template <typename scalar_t, int D>
__global__ void __launch_bounds__(kThreads)
    key_rows_kernel(const uint16_t* __restrict__ grad_out, const uint16_t* __restrict__ q,
                    const uint16_t* __restrict__ k, const uint16_t* __restrict__ v,
                    const uint16_t* __restrict__ log_beta, const float* __restrict__ lse,
                    const float* __restrict__ delta, uint16_t* __restrict__ grad_k, uint16_t* __restrict__ grad_v,
                    uint16_t* __restrict__ grad_log_beta, int64_t T, int group, float scale) {
  using Tp = Dtype<scalar_t>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint16_t* k_s = reinterpret_cast<uint16_t*>(smem_raw);   // [kBlockRows][pitch]
  uint16_t* v_s = k_s + kBlockRows * pitch<D>();            // [kBlockRows][pitch]
  uint16_t* qdo_s = v_s + kBlockRows * pitch<D>();          // [stage][Q | dO][kTile][pitch]
  float* stats_s = reinterpret_cast<float*>(qdo_s + 2 * 2 * kTile * pitch<D>());  // [stage][lse | Δ][kTile]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, c = lane & 3;
  const int64_t kv_row = blockIdx.x;
  const int64_t block_i0 = static_cast<int64_t>(blockIdx.y) * kBlockRows, i0 = block_i0 + 16 * warp;
  const int64_t i_lo = i0 + g, i_hi = i_lo + 8;
  load_tile_async<D, kBlockRows>(k_s, k + kv_row * T * D, block_i0, T);
  load_tile_async<D, kBlockRows>(v_s, v + kv_row * T * D, block_i0, T);
  cp_async_commit();
  const float beta_lo = i_lo < T ? Tp::to_float(log_beta[kv_row * T + i_lo]) : 0.f;
  const float beta_hi = i_hi < T ? Tp::to_float(log_beta[kv_row * T + i_hi]) : 0.f;
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  float dbeta_lo = 0.f, dbeta_hi = 0.f;

  // Tiles n = h·per_head + u: query head kv_row·group + h, queries block_i0 + 64u .. (earlier ones see no key).
  const int per_head = static_cast<int>((T - block_i0 + kTile - 1) / kTile);
  const int tiles = group * per_head;
  float stat_next = 0.f;  // threads 0..63: lse, 64..127: Δ of the issued tile
  auto issue = [&](int n) {
    const int64_t row = kv_row * group + n / per_head, u0 = block_i0 + static_cast<int64_t>(n % per_head) * kTile;
    uint16_t* stage = qdo_s + (n & 1) * 2 * kTile * pitch<D>();
    load_tile_async<D, kTile>(stage, q + row * T * D, u0, T);
    load_tile_async<D, kTile>(stage + kTile * pitch<D>(), grad_out + row * T * D, u0, T);
    cp_async_commit();
    stat_next = vector_entry((threadIdx.x < kTile ? lse : delta) + row * T, u0, T);
  };
  // Stage n & 1's last readers were in iteration n − 2, which a barrier closed.
  auto stage_vectors = [&](int n) { stats_s[(n & 1) * 2 * kTile + threadIdx.x] = stat_next; };
  static_assert(kThreads == 2 * kTile, "one lse or Δ entry per thread");
  issue(0);
  stage_vectors(0);
  for (int n = 0; n < tiles; ++n) {
    issue_next_and_wait(n, tiles, issue);
    __syncthreads();
    const int64_t u0 = block_i0 + static_cast<int64_t>(n % per_head) * kTile;
    const uint16_t* q_s = qdo_s + (n & 1) * 2 * kTile * pitch<D>();
    const uint16_t* do_s = q_s + kTile * pitch<D>();
    const float* lse_s = stats_s + (n & 1) * 2 * kTile;
    const float* delta_s = lse_s + kTile;
    if (i0 < T) {  // warp-uniform
      // Ages t − i = (u0 − i) + col in 32 bits; a key past T is seen by nothing, a query past T sees nothing.
      const int age_lo = i_lo < T ? static_cast<int>(u0 - i_lo) : -(kTile + 16);
      const int age_hi = i_hi < T ? static_cast<int>(u0 - i_hi) : -(kTile + 16);
      const int queries = static_cast<int>(min(static_cast<int64_t>(kTile), T - u0));
      float st[kTile / 8][4] = {}, dpt[kTile / 8][4] = {};
      mma_shared_rows_by_tile_rows<scalar_t, D>(st, k_s, 16 * warp, q_s);    // Sᵀ = K Qᵀ
      mma_shared_rows_by_tile_rows<scalar_t, D>(dpt, v_s, 16 * warp, do_s);  // dPᵀ = V dOᵀ
#pragma unroll
      for (int j = 0; j < kTile / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = 8 * j + 2 * c + (e & 1);
          const int age_int = (e < 2 ? age_lo : age_hi) + col;
          const bool visible = age_int >= 0 && col < queries;
          const float age = static_cast<float>(age_int);
          const float p = visible ? __expf(st[j][e] * scale + age * (e < 2 ? beta_lo : beta_hi) - lse_s[col]) : 0.f;
          const float ds = p * (dpt[j][e] - delta_s[col]);
          if (e < 2)
            dbeta_lo = fmaf(ds, age, dbeta_lo);
          else
            dbeta_hi = fmaf(ds, age, dbeta_hi);
          st[j][e] = p;
          dpt[j][e] = ds;
        }
      }
      mma_fragments_by_tile<scalar_t, D>(dv, st, do_s);  // dV += Pᵀ dO
      mma_fragments_by_tile<scalar_t, D>(dk, dpt, q_s);  // dK += dSᵀ Q
    }
    if (n + 1 < tiles) stage_vectors(n + 1);
    __syncthreads();
  }
  if (i0 >= T) return;
  store_rows<scalar_t, D>(grad_k + kv_row * T * D, dk, i0, T, scale, scale);
  store_rows<scalar_t, D>(grad_v + kv_row * T * D, dv, i0, T, 1.f, 1.f);
  dbeta_lo = quad_sum(dbeta_lo);
  dbeta_hi = quad_sum(dbeta_hi);
  if (c == 0) {
    if (i_lo < T) grad_log_beta[kv_row * T + i_lo] = Tp::from_float(dbeta_lo);
    if (i_hi < T) grad_log_beta[kv_row * T + i_hi] = Tp::from_float(dbeta_hi);
  }
}


}  // namespace

bool takes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& log_beta) {
  const at::ScalarType dtype = q.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return false;
  if (k.scalar_type() != dtype || v.scalar_type() != dtype || log_beta.scalar_type() != dtype) return false;
  if (q.size(3) != 64 && q.size(3) != 128) return false;
  if ((q.size(2) + kBlockRows - 1) / kBlockRows > kMaxRowBlocks) return false;
  // q, k, v move in 16-byte chunks; log β is read one value at a time.
  for (const at::Tensor* t : {&q, &k, &v})
    if (!t->is_contiguous() || !aligned16(*t)) return false;
  return log_beta.is_contiguous();
}

void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& log_beta, at::Tensor& out,
             at::Tensor& lse) {
  const int64_t T = q.size(2);
  const int group = static_cast<int>(q.size(1) / k.size(1));
  const dim3 grid(static_cast<unsigned>(q.size(0) * q.size(1)), static_cast<unsigned>((T + kBlockRows - 1) / kBlockRows));
  dispatch(q, [&](auto dtype, auto dims) {
    using scalar_t = decltype(dtype);
    constexpr int D = decltype(dims)::value;
    const auto kernel = query_rows_kernel<scalar_t, D, false>;
    allow_smem(kernel, query_rows_smem<D, false>());
    kernel<<<grid, kThreads, query_rows_smem<D, false>(), at::cuda::getCurrentCUDAStream()>>>(
        bits(q), bits(k), bits(v), bits(log_beta), nullptr, nullptr, nullptr, mutable_bits(out),
        lse.mutable_data_ptr<float>(), T, group, 1.f / std::sqrt(static_cast<float>(D)));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& log_beta, const at::Tensor& lse, const at::Tensor& delta, at::Tensor& grad_q,
              at::Tensor& grad_k, at::Tensor& grad_v, at::Tensor& grad_log_beta) {
  const int64_t T = q.size(2);
  const int group = static_cast<int>(q.size(1) / k.size(1));
  const unsigned row_blocks = static_cast<unsigned>((T + kBlockRows - 1) / kBlockRows);
  const float scale = 1.f / std::sqrt(static_cast<float>(q.size(3)));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch(q, [&](auto dtype, auto dims) {
    using scalar_t = decltype(dtype);
    constexpr int D = decltype(dims)::value;
    const auto q_kernel = query_rows_kernel<scalar_t, D, true>;
    allow_smem(q_kernel, query_rows_smem<D, true>());
    q_kernel<<<dim3(static_cast<unsigned>(q.size(0) * q.size(1)), row_blocks), kThreads, query_rows_smem<D, true>(),
               stream>>>(
        bits(q), bits(k), bits(v), bits(log_beta), bits(grad_out), lse.const_data_ptr<float>(),
        delta.const_data_ptr<float>(), mutable_bits(grad_q), nullptr, T, group, scale);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const auto kv_kernel = key_rows_kernel<scalar_t, D>;
    allow_smem(kv_kernel, key_rows_smem<D>());
    kv_kernel<<<dim3(static_cast<unsigned>(k.size(0) * k.size(1)), row_blocks), kThreads, key_rows_smem<D>(), stream>>>(
        bits(grad_out), bits(q), bits(k), bits(v), bits(log_beta), lse.const_data_ptr<float>(),
        delta.const_data_ptr<float>(), mutable_bits(grad_k), mutable_bits(grad_v), mutable_bits(grad_log_beta), T, group,
        scale);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace kvbound::ops::mma
