// The forward of kvbound::pooled_index_score on tensor cores, for bf16/fp16 inputs with index dim 32, 64 or 128:
// IndexMem's student score (ops/pooled_index_score.h)
//   I_g[s, t] = Σ_{h∈g} w_h[s]·act(qI_h[s]·kI_g[t]) / √dI,   z_g[t] = pool_{s∈Ω(t)} I_g[s, t],
// one block per 64 keys of an index-key row g, walking the queries of the block's Ω tile by tile and, inside a
// query tile, the group's heads: P_h = kI qI_hᵀ by mma.sync (fp32 accumulation of exact products), act and the
// weight in fp32 registers, summed over the heads, then pooled per key: a sum (mean), a max with the first query
// that reaches it (the argmax max pooling's backward scatters through), or an online max and sum (logsumexp).
// No T×T buffer, one writer per output, a fixed order of reduction: deterministic. Called from the tiled path's
// CUDA dispatch (ops/pooled_ops_tiled.cpp) through kvbound_pooled_index_score_mma, which takes what it can (the
// backward stays there).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
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

// One key's running pool over the queries a lane sees, then merged over its quad.
template <PoolMode kPool>
struct KeyPool {
  float value = kPool == PoolMode::Mean ? 0.f : -INFINITY;  // sum | max | running max of the logsumexp
  float sum = 0.f;                                            // logsumexp: Σ exp(I − value)
  int query = -1;                                             // max: the first query reaching the max
  __device__ void add(float x, int s) {
    if constexpr (kPool == PoolMode::Mean) {
      value += x;
    } else if constexpr (kPool == PoolMode::Max) {
      if (x > value) value = x, query = s;  // queries arrive in increasing order: strict keeps the first
    } else {
      if (x > value) sum *= __expf(value - x), value = x;
      sum += __expf(x - value);
    }
  }
  // Merges the quad's four pools (every lane ends with the merged one).
  __device__ void merge_quad() {
#pragma unroll
    for (int lane_mask = 1; lane_mask <= 2; lane_mask <<= 1) {
      const float other_value = __shfl_xor_sync(0xffffffffu, value, lane_mask);
      if constexpr (kPool == PoolMode::Mean) {
        value += other_value;
      } else if constexpr (kPool == PoolMode::Max) {
        const int other_query = __shfl_xor_sync(0xffffffffu, query, lane_mask);
        if (other_value > value || (other_value == value && other_query >= 0 && (query < 0 || other_query < query)))
          value = other_value, query = other_query;
      } else {
        const float other_sum = __shfl_xor_sync(0xffffffffu, sum, lane_mask);
        const float top = fmaxf(value, other_value);
        if (top != -INFINITY) sum = sum * __expf(value - top) + other_sum * __expf(other_value - top);
        value = top;
      }
    }
  }
  // z for a key whose Ω holds `size` queries (−inf when it holds none).
  __device__ float result(int size) const {
    if (size <= 0) return -INFINITY;
    if constexpr (kPool == PoolMode::Mean)
      return value / static_cast<float>(size);
    else if constexpr (kPool == PoolMode::Max)
      return value;
    else
      return value + logf(sum);
  }
};

// Grid: x = index-key row b·Hk + g (query rows (b·Hk + g)·group ...), y = block of 64 keys (ops/pooled_mma_keys.cuh).
template <typename scalar_t, int D, PoolMode kPool, bool kRelu>
__global__ void __launch_bounds__(kThreads)
    index_score_kernel(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k, const uint16_t* __restrict__ w,
                       uint16_t* __restrict__ z, int32_t* __restrict__ argmax, int T, int window_first, int min_gap,
                       int group, float scale) {
  using Tp = Dtype<scalar_t>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const KeyMajorSmem<D> smem(smem_raw);  // the entries: the query head's weights
  const int warp = threadIdx.x / 32, c = threadIdx.x % 4;
  const int64_t key_row = blockIdx.x;
  const WarpKeys keys(T, window_first, min_gap);
  const int t0 = keys.t0, t_lo = keys.t_lo, t_hi = keys.t_hi, u_first = keys.first_query;
  uint16_t* z_row = z + key_row * T;
  int32_t* argmax_row = argmax == nullptr ? nullptr : argmax + key_row * T;
  if (u_first >= T) {  // block-uniform: every key of the block has an empty Ω
    if (c == 0 && t_lo < T) {
      z_row[t_lo] = Tp::from_float(-INFINITY);
      if (argmax_row != nullptr) argmax_row[t_lo] = -1;
    }
    if (c == 0 && t_hi < T) {
      z_row[t_hi] = Tp::from_float(-INFINITY);
      if (argmax_row != nullptr) argmax_row[t_hi] = -1;
    }
    return;
  }
  load_tile_async<D, kBlockRows>(smem.keys, k + key_row * T * D, keys.block_t0, T);
  cp_async_commit();

  // Tiles n = u·group + h: queries u_first + 64u ..., query head key_row·group + h.
  const int query_tiles = (T - u_first + kTile - 1) / kTile, tiles = query_tiles * group;
  float w_next = 0.f;  // threads 0..kTile−1: the weights of the issued tile
  auto issue = [&](int n) {
    const int64_t row = key_row * group + n % group;
    const int u0 = u_first + (n / group) * kTile;
    load_tile_async<D, kTile>(smem.query_stage(n), q + row * T * D, u0, T);
    cp_async_commit();
    if (threadIdx.x < kTile) w_next = vector_entry<scalar_t>(w + row * T, u0, T);
  };
  // Stage n & 1's last readers were in iteration n − 2, which a barrier closed.
  auto stage_weights = [&](int n) {
    if (threadIdx.x < kTile) smem.entry_stage(n)[threadIdx.x] = w_next;
  };
  KeyPool<kPool> pool_lo, pool_hi;
  float scores[kTile / 8][4] = {};  // Σ_h w_h·act(P_h) of the current query tile
  issue(0);
  stage_weights(0);
  for (int n = 0; n < tiles; ++n) {
    issue_next_and_wait(n, tiles, issue);
    __syncthreads();  // tile n (and the block's kI rows, with tile 0) are visible to every warp
    if (t0 < T) {  // warp-uniform
      const float* w_tile = smem.entry_stage(n);
      float products[kTile / 8][4] = {};
      mma_shared_rows_by_tile_rows<scalar_t, D>(products, smem.keys, 16 * warp, smem.query_stage(n));
#pragma unroll
      for (int j = 0; j < kTile / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = kRelu ? fmaxf(products[j][e], 0.f) : products[j][e];
          scores[j][e] = fmaf(w_tile[8 * j + 2 * c + (e & 1)], p, scores[j][e]);
        }
      }
      if (n % group == group - 1) {  // the query tile's last head: pool its scores
        const int u0 = u_first + (n / group) * kTile;
        keys.pool_window(scores, u0, T, [&](float x, int col, bool hi) { (hi ? pool_hi : pool_lo).add(x * scale, u0 + col); });
#pragma unroll
        for (int j = 0; j < kTile / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) scores[j][e] = 0.f;
      }
    }
    if (n + 1 < tiles) stage_weights(n + 1);
    __syncthreads();
  }
  if (t0 >= T) return;
  pool_lo.merge_quad();
  pool_hi.merge_quad();
  if (c != 0) return;
  if (t_lo < T) {
    z_row[t_lo] = Tp::from_float(pool_lo.result(keys.size_lo));
    if (argmax_row != nullptr) argmax_row[t_lo] = keys.size_lo > 0 ? pool_lo.query : -1;
  }
  if (t_hi < T) {
    z_row[t_hi] = Tp::from_float(pool_hi.result(keys.size_hi));
    if (argmax_row != nullptr) argmax_row[t_hi] = keys.size_hi > 0 ? pool_hi.query : -1;
  }
}

bool takes(const at::Tensor& qI, const at::Tensor& kI, const at::Tensor& w) {
  const at::ScalarType dtype = qI.scalar_type();
  if (!qI.is_cuda() || (dtype != at::kBFloat16 && dtype != at::kHalf)) return false;
  if (kI.scalar_type() != dtype || w.scalar_type() != dtype) return false;
  const int64_t d = qI.size(3);
  if (d != 32 && d != 64 && d != 128) return false;
  if (qI.size(2) > std::numeric_limits<int32_t>::max() / 2 || (qI.size(2) + kBlockRows - 1) / kBlockRows > kMaxRowBlocks)
    return false;
  for (const at::Tensor* t : {&qI, &kI})
    if (!t->is_contiguous() || !aligned16(*t)) return false;
  return w.is_contiguous();
}

// Calls f(scalar_t{}, std::integral_constant<int, D>{}) for the input dtype and index dim (32, 64 or 128).
template <typename F>
void dispatch_index_dim(const at::Tensor& qI, F&& f) {
  const auto with_dim = [&](auto dtype) {
    switch (qI.size(3)) {
      case 32: f(dtype, std::integral_constant<int, 32>{}); break;
      case 64: f(dtype, std::integral_constant<int, 64>{}); break;
      default: f(dtype, std::integral_constant<int, 128>{}); break;
    }
  };
  if (qI.scalar_type() == at::kBFloat16)
    with_dim(c10::BFloat16{});
  else
    with_dim(c10::Half{});
}

template <PoolMode kPool, bool kRelu>
void launch(const at::Tensor& qI, const at::Tensor& kI, const at::Tensor& w, at::Tensor& z, at::Tensor& argmax,
            int window_first, int min_gap) {
  const int T = static_cast<int>(qI.size(2)), group = static_cast<int>(qI.size(1) / kI.size(1));
  const dim3 grid(static_cast<unsigned>(kI.size(0) * kI.size(1)), static_cast<unsigned>((T + kBlockRows - 1) / kBlockRows));
  const float scale = 1.f / std::sqrt(static_cast<float>(qI.size(3)));
  dispatch_index_dim(qI, [&](auto dtype, auto dims) {
    using scalar_t = decltype(dtype);
    constexpr int D = decltype(dims)::value;
    const auto kernel = index_score_kernel<scalar_t, D, kPool, kRelu>;
    allow_smem(kernel, KeyMajorSmem<D>::kBytes);
    kernel<<<grid, kThreads, KeyMajorSmem<D>::kBytes, at::cuda::getCurrentCUDAStream()>>>(
        bits(qI), bits(kI), bits(w), mutable_bits(z),
        kPool == PoolMode::Max ? argmax.mutable_data_ptr<int32_t>() : nullptr, T, window_first, min_gap, group, scale);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <PoolMode kPool>
void launch_pool(const at::Tensor& qI, const at::Tensor& kI, const at::Tensor& w, bool relu, at::Tensor& z,
                 at::Tensor& argmax, int window_first, int min_gap) {
  if (relu)
    launch<kPool, true>(qI, kI, w, z, argmax, window_first, min_gap);
  else
    launch<kPool, false>(qI, kI, w, z, argmax, window_first, min_gap);
}

}  // namespace
}  // namespace kvbound::ops::mma

// The tiled path's CUDA forward asks here first (found with dlsym: the CPU library does not link this module).
// Returns false, and touches nothing, for inputs the kernel does not take; the caller has checked the arguments.
// z: [B, Hk, T] in qI's dtype (−inf for keys with an empty Ω); argmax: int32 [B, Hk, T] for max pooling (−1 for
// those keys), else an empty [0, Hk, T] placeholder, as from the other kernels.
extern "C" bool kvbound_pooled_index_score_mma(const at::Tensor* qI_in, const at::Tensor* kI_in, const at::Tensor* w_in,
                                               int64_t pool, int64_t window, int64_t min_gap, bool relu, at::Tensor* z,
                                               at::Tensor* argmax) {
  namespace mma = kvbound::ops::mma;
  using kvbound::ops::PoolMode;
  const at::Tensor &qI = *qI_in, &kI = *kI_in, &w = *w_in;
  if (!mma::takes(qI, kI, w)) return false;
  const c10::cuda::CUDAGuard guard(qI.device());
  const int64_t B = kI.size(0), Hk = kI.size(1), T = kI.size(2);
  const int window_first = window > 0 ? static_cast<int>(std::max<int64_t>(T - window, 0)) : 0;
  const int gap = static_cast<int>(std::min<int64_t>(min_gap, T));
  const auto mode = static_cast<PoolMode>(pool);
  *z = at::empty({B, Hk, T}, qI.options());
  *argmax = at::empty({mode == PoolMode::Max ? B : 0, Hk, T}, qI.options().dtype(at::kInt));
  if (T == 0) return true;
  switch (mode) {
    case PoolMode::Mean: mma::launch_pool<PoolMode::Mean>(qI, kI, w, relu, *z, *argmax, window_first, gap); break;
    case PoolMode::Max: mma::launch_pool<PoolMode::Max>(qI, kI, w, relu, *z, *argmax, window_first, gap); break;
    case PoolMode::LogSumExp:
      mma::launch_pool<PoolMode::LogSumExp>(qI, kI, w, relu, *z, *argmax, window_first, gap);
      break;
  }
  return true;
}
