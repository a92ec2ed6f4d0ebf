// kvbound::pooled_attention_importance on tensor cores, for bf16/fp16 inputs with head dim 64 or 128: IndexMem's
// teacher target (ops/pooled_attention_importance.h) in the CPU kernel's two passes, never a T×T buffer:
//   pass 1 (rows = queries of the blocks that meet some Ω): S = Q Kᵀ over the causal keys, online max and sum,
//          lse_s = m_s + log l_s (fp32 [B·Hq, T], the only intermediate in memory);
//   pass 2 (rows = keys of one KV head, walking its group's query heads over the queries of Ω): Sᵀ = K Qᵀ,
//          A[s, t] = exp(Sᵀ/√D − lse_s), pooled along s per head (a sum for mean, a max, or Σ exp(A) for
//          logsumexp: A ≤ 1 needs no shift), then averaged over the group's heads.
// Every output has one writer and a fixed order of reduction: deterministic. The products are mma.sync with
// fp32 accumulation of the input dtype's exact products; everything after them is fp32 (ops/mma_tiles.cuh).
// Called from the tiled path's CUDA dispatch (ops/pooled_ops_tiled.cpp) through kvbound_pooled_importance_mma,
// which takes the inputs it can and leaves the rest (fp32, other head dims) to that path.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "ops/mma_tiles.cuh"
#include "ops/pooled_mma_keys.cuh"
#include "ops/pooled_window.h"

namespace kvbound::ops::mma {
namespace {

// Pass 1's shared memory: two stages of K tiles (pass 2's: KeyMajorSmem, with lse as the entries).
template <int D>
constexpr size_t row_lse_smem() {
  return 2 * kTile * pitch<D>() * sizeof(uint16_t);
}

// Grid: x = query row b·Hq + h (KV row (b·Hq + h)/group), y = block of 64 queries from first_query on.
template <typename scalar_t, int D>
__global__ void __launch_bounds__(kThreads)
    row_lse_kernel(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k, float* __restrict__ lse, int T,
                   int first_query, int group, float scale) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint16_t* k_s = reinterpret_cast<uint16_t*>(smem_raw);  // [stage][kTile][pitch]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, c = lane & 3;
  const int64_t row = blockIdx.x, kv_row = row / group;
  // The last query blocks have the most keys: they start first, the short ones fill in behind them.
  const int block_q0 = first_query + static_cast<int>(gridDim.y - 1 - blockIdx.y) * kBlockRows;
  const int q0 = block_q0 + 16 * warp, t_lo = q0 + g, t_hi = t_lo + 8;
  const int last = min(block_q0 + kBlockRows, T) - 1;  // later keys are masked for every row of the block
  const uint16_t* k_head = k + kv_row * T * D;
  uint32_t qf[D / 16][4];
  load_row_fragments<D>(qf, q + row * T * D, q0, T);
  OnlineSoftmaxRows softmax;

  const int tiles = last / kTile + 1;
  auto issue = [&](int n) {
    load_tile_async<D, kTile>(k_s + (n & 1) * kTile * pitch<D>(), k_head, static_cast<int64_t>(n) * kTile, T);
    cp_async_commit();
  };
  issue(0);
  for (int n = 0; n < tiles; ++n) {
    issue_next_and_wait(n, tiles, issue);
    __syncthreads();  // tile n is visible to every warp
    const int s0 = n * kTile;
    if (q0 < T && s0 <= q0 + 15) {  // warp-uniform: some row of the warp sees some key of the tile
      const int age_lo = t_lo < T ? t_lo - s0 : -kTile, age_hi = t_hi < T ? t_hi - s0 : -kTile;
      float s[kTile / 8][4] = {};
      mma_rows_by_tile_rows<scalar_t, D>(s, qf, k_s + (n & 1) * kTile * pitch<D>());  // S = Q Kᵀ
      float tile_max_lo = -INFINITY, tile_max_hi = -INFINITY;
#pragma unroll
      for (int j = 0; j < kTile / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = 8 * j + 2 * c + (e & 1);
          const bool visible = (e < 2 ? age_lo : age_hi) - col >= 0;
          s[j][e] = visible ? s[j][e] * scale : -INFINITY;
          if (e < 2)
            tile_max_lo = fmaxf(tile_max_lo, s[j][e]);
          else
            tile_max_hi = fmaxf(tile_max_hi, s[j][e]);
        }
      }
      float rescale_lo, rescale_hi;  // only the sums are kept
      softmax.absorb(s, tile_max_lo, tile_max_hi, rescale_lo, rescale_hi);
    }
    __syncthreads();  // every warp is done with stage n & 1 before tile n + 2 is issued into it
  }
  if (q0 >= T) return;
  softmax.finish();
  if (c == 0) {
    if (t_lo < T) lse[row * T + t_lo] = softmax.lse_lo();
    if (t_hi < T) lse[row * T + t_hi] = softmax.lse_hi();
  }
}

// One key's pooled attention of one head, accumulated by a lane over its columns, then over its quad.
template <PoolMode kPool>
struct HeadPool {
  float acc = kPool == PoolMode::Max ? -INFINITY : 0.f;
  __device__ void add(float a) {
    if constexpr (kPool == PoolMode::Mean) acc += a;
    if constexpr (kPool == PoolMode::Max) acc = fmaxf(acc, a);
    if constexpr (kPool == PoolMode::LogSumExp) acc += __expf(a);
  }
  // The head's pooled value for a key whose Ω holds `size` queries (0 when it holds none); resets the pool.
  __device__ float take(int size) {
    const float total = kPool == PoolMode::Max ? quad_max(acc) : quad_sum(acc);
    acc = kPool == PoolMode::Max ? -INFINITY : 0.f;
    if (size <= 0) return 0.f;
    if constexpr (kPool == PoolMode::Mean)
      return total / static_cast<float>(size);
    else if constexpr (kPool == PoolMode::LogSumExp)
      return logf(total);
    else
      return total;
  }
};

// Grid: x = KV row b·Hkv + g (query rows (b·Hkv + g)·group ...), y = block of 64 keys (ops/pooled_mma_keys.cuh).
template <typename scalar_t, int D, PoolMode kPool>
__global__ void __launch_bounds__(kThreads)
    key_pool_kernel(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k, const float* __restrict__ lse,
                    float* __restrict__ out, int T, int window_first, int min_gap, int group, float scale) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const KeyMajorSmem<D> smem(smem_raw);
  const int warp = threadIdx.x / 32, c = threadIdx.x % 4;
  const int64_t kv_row = blockIdx.x;
  const WarpKeys keys(T, window_first, min_gap);
  const int i0 = keys.t0, i_lo = keys.t_lo, i_hi = keys.t_hi, u_first = keys.first_query;
  float* out_row = out + kv_row * T;
  if (u_first >= T) {  // block-uniform: every key of the block has an empty Ω
    if (c == 0) {
      if (i_lo < T) out_row[i_lo] = 0.f;
      if (i_hi < T) out_row[i_hi] = 0.f;
    }
    return;
  }
  load_tile_async<D, kBlockRows>(smem.keys, k + kv_row * T * D, keys.block_t0, T);
  cp_async_commit();

  // Tiles n = h·per_head + u: query head kv_row·group + h, queries u_first + 64u ...
  const int per_head = (T - u_first + kTile - 1) / kTile, tiles = group * per_head;
  float lse_next = 0.f;  // threads 0..kTile−1: lse of the issued tile
  auto issue = [&](int n) {
    const int64_t row = kv_row * group + n / per_head;
    const int u0 = u_first + (n % per_head) * kTile;
    load_tile_async<D, kTile>(smem.query_stage(n), q + row * T * D, u0, T);
    cp_async_commit();
    if (threadIdx.x < kTile) lse_next = vector_entry(lse + row * T, u0, T);
  };
  // Stage n & 1's last readers were in iteration n − 2, which a barrier closed.
  auto stage_lse = [&](int n) {
    if (threadIdx.x < kTile) smem.entry_stage(n)[threadIdx.x] = lse_next;
  };
  HeadPool<kPool> pool_lo, pool_hi;
  float total_lo = 0.f, total_hi = 0.f;  // Σ over the group's heads
  issue(0);
  stage_lse(0);
  for (int n = 0; n < tiles; ++n) {
    issue_next_and_wait(n, tiles, issue);
    __syncthreads();  // tile n (and the block's K rows, with tile 0) are visible to every warp
    const int u0 = u_first + (n % per_head) * kTile;
    const float* lse_tile = smem.entry_stage(n);
    if (i0 < T) {  // warp-uniform
      float st[kTile / 8][4] = {};
      mma_shared_rows_by_tile_rows<scalar_t, D>(st, smem.keys, 16 * warp, smem.query_stage(n));  // Sᵀ = K Qᵀ
      // Keys past T get size 0 and add nothing.
      keys.pool_window(st, u0, T, [&](float x, int col, bool hi) {
        (hi ? pool_hi : pool_lo).add(__expf(x * scale - lse_tile[col]));
      });
      if (n % per_head == per_head - 1) {  // the head's last tile
        total_lo += pool_lo.take(keys.size_lo);
        total_hi += pool_hi.take(keys.size_hi);
      }
    }
    if (n + 1 < tiles) stage_lse(n + 1);
    __syncthreads();
  }
  if (i0 >= T || c != 0) return;
  const float inv_group = 1.f / static_cast<float>(group);
  if (i_lo < T) out_row[i_lo] = total_lo * inv_group;
  if (i_hi < T) out_row[i_hi] = total_hi * inv_group;
}

bool takes(const at::Tensor& q, const at::Tensor& k) {
  const at::ScalarType dtype = q.scalar_type();
  if (!q.is_cuda() || (dtype != at::kBFloat16 && dtype != at::kHalf) || k.scalar_type() != dtype) return false;
  if (q.dim() != 4 || k.dim() != 4 || (q.size(3) != 64 && q.size(3) != 128)) return false;
  if (q.size(2) > std::numeric_limits<int32_t>::max() / 2 || (q.size(2) + kBlockRows - 1) / kBlockRows > kMaxRowBlocks)
    return false;
  for (const at::Tensor* t : {&q, &k})
    if (!t->is_contiguous() || !aligned16(*t)) return false;
  return true;
}

template <PoolMode kPool>
void launch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& lse, at::Tensor& out, int T, int window_first,
            int min_gap, int group, float scale, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(k.size(0) * k.size(1)), static_cast<unsigned>((T + kBlockRows - 1) / kBlockRows));
  dispatch(q, [&](auto dtype, auto dims) {
    using scalar_t = decltype(dtype);
    constexpr int D = decltype(dims)::value;
    const auto kernel = key_pool_kernel<scalar_t, D, kPool>;
    allow_smem(kernel, KeyMajorSmem<D>::kBytes);
    kernel<<<grid, kThreads, KeyMajorSmem<D>::kBytes, stream>>>(bits(q), bits(k), lse.const_data_ptr<float>(),
                                                            out.mutable_data_ptr<float>(), T, window_first, min_gap,
                                                            group, scale);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace kvbound::ops::mma

// The tiled path's CUDA dispatch asks here first (found with dlsym: the CPU library does not link this module).
// Returns false, and touches nothing, for inputs the kernels do not take; `pool`, window and min_gap are checked
// by the caller. out: fp32 [B, Hkv, T].
extern "C" bool kvbound_pooled_importance_mma(const at::Tensor* q_in, const at::Tensor* k_in, int64_t pool,
                                              int64_t window, int64_t min_gap, at::Tensor* out) {
  namespace mma = kvbound::ops::mma;
  using kvbound::ops::PoolMode;
  const at::Tensor& q = *q_in;
  const at::Tensor& k = *k_in;
  if (!mma::takes(q, k)) return false;
  const c10::cuda::CUDAGuard guard(q.device());
  const int T = static_cast<int>(q.size(2)), group = static_cast<int>(q.size(1) / k.size(1));
  const int window_first = window > 0 ? static_cast<int>(std::max<int64_t>(T - window, 0)) : 0;
  const int gap = static_cast<int>(std::min<int64_t>(min_gap, T));
  const int first_query = std::max(window_first, gap);  // queries before it are in no Ω
  const auto floats = q.options().dtype(at::kFloat);
  if (first_query >= T) {  // every Ω is empty (T = 0 included)
    *out = at::zeros({k.size(0), k.size(1), T}, floats);
    return true;
  }
  *out = at::empty({k.size(0), k.size(1), T}, floats);  // key_pool_kernel writes every entry
  const float scale = 1.f / std::sqrt(static_cast<float>(q.size(3)));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor lse = at::empty({q.size(0) * q.size(1), T}, floats);  // pass 2 reads [first_query, T) only
  const dim3 lse_grid(static_cast<unsigned>(q.size(0) * q.size(1)),
                      static_cast<unsigned>((T - first_query + mma::kBlockRows - 1) / mma::kBlockRows));
  mma::dispatch(q, [&](auto dtype, auto dims) {
    using scalar_t = decltype(dtype);
    constexpr int D = decltype(dims)::value;
    const auto kernel = mma::row_lse_kernel<scalar_t, D>;
    mma::allow_smem(kernel, mma::row_lse_smem<D>());
    kernel<<<lse_grid, mma::kThreads, mma::row_lse_smem<D>(), stream>>>(
        mma::bits(q), mma::bits(k), lse.mutable_data_ptr<float>(), T, first_query, group, scale);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  switch (static_cast<PoolMode>(pool)) {
    case PoolMode::Mean: mma::launch<PoolMode::Mean>(q, k, lse, *out, T, window_first, gap, group, scale, stream); break;
    case PoolMode::Max: mma::launch<PoolMode::Max>(q, k, lse, *out, T, window_first, gap, group, scale, stream); break;
    case PoolMode::LogSumExp:
      mma::launch<PoolMode::LogSumExp>(q, k, lse, *out, T, window_first, gap, group, scale, stream);
      break;
  }
  return true;
}
