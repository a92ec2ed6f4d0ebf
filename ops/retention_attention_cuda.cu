// CUDA kernels of kvbound::retention_attention (ops/retention_attention.h). bf16/fp16 inputs with head dim 64 or
// 128 go to the tensor-core kernels (ops/retention_attention_mma.cu); the rest (fp32, other head dims, unaligned
// data) run the kernels below, FlashAttention-2 in its simplest SIMT form: a block of kRows warps owns kRows rows,
// each warp one row; the other side of the T×T pattern streams through shared memory kTile = 32 rows at a time, one
// per lane. A lane computes its row pair's logit q_t·k_i/√D + (t−i)·log β_i (a D-long dot product from shared
// memory, rows padded to D+1 floats so the 32 lanes hit 32 banks), warp shuffles broadcast the 32 probabilities,
// and each lane accumulates the output dims d ≡ lane (mod 32) in registers. Everything is fp32 whatever the input
// dtype; no buffer larger than [B, H, T] besides the inputs and outputs.
//   forward  (row = query t):  online softmax over key tiles, saves lse_t.
//   dQ       (row = query t):  dQ_t = (1/√D)·Σ_i dS[t,i]·k_i,  dS = P∘(dP − Δ_t),  dP = dO·Vᵀ.
//   dK, dV, d log β (row = key i, walking the group's query heads):
//            dV_i = Σ_t P[t,i]·dO_t,  dK_i = (1/√D)·Σ_t dS[t,i]·q_t,  d log β_i = Σ_t dS[t,i]·(t−i).
// Splitting dQ from dK/dV gives every output element one writer: no atomics, deterministic.
#include <ATen/Dispatch_v2.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sum.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "ops/retention_attention_mma.h"

#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

namespace kvbound::ops {
namespace {

constexpr int kWarpSize = 32;
constexpr int kRows = 8;                     // warps per block, one row each
constexpr int kThreads = kRows * kWarpSize;  // threads per block
constexpr int kTile = kWarpSize;             // streamed rows per shared tile, one per lane
constexpr int kMaxHeadDim = 256;             // 8 output dims per lane
constexpr int64_t kMaxRowBlocks = 65535;     // gridDim.y limit
constexpr unsigned kFullMask = 0xffffffffu;

__device__ float warp_max(float x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

__device__ float warp_sum(float x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

__device__ float dot(const float* a, const float* b, int D) {
  float sum = 0.f;
  for (int d = 0; d < D; ++d) sum = fmaf(a[d], b[d], sum);
  return sum;
}

// Rows first .. first+count−1 of a [T, D] matrix into shared memory as fp32 with row pitch `pitch`; rows past
// T read as 0. Called by the whole block.
template <typename scalar_t>
__device__ void load_rows(float* dst, int pitch, const scalar_t* src, int64_t first, int count, int64_t T, int D) {
  for (int idx = threadIdx.x; idx < count * D; idx += blockDim.x) {
    const int r = idx / D, d = idx % D;
    const int64_t t = first + r;
    dst[r * pitch + d] = t < T ? static_cast<float>(src[t * D + d]) : 0.f;
  }
}

// `count` entries of a length-T vector from `first` into shared memory as fp32; past T reads as 0.
template <typename scalar_t>
__device__ void load_vector(float* dst, const scalar_t* src, int64_t first, int count, int64_t T) {
  for (int c = threadIdx.x; c < count; c += blockDim.x)
    dst[c] = first + c < T ? static_cast<float>(src[first + c]) : 0.f;
}

// Grid: x = query row b·Hq + h (its KV row is (b·Hq + h)/group), y = block of kRows queries.
template <typename scalar_t, int kDims>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k, const scalar_t* __restrict__ v,
                   const scalar_t* __restrict__ log_beta, scalar_t* __restrict__ out, float* __restrict__ lse,
                   int64_t T, int D, int group, float scale) {
  extern __shared__ float smem[];
  const int pitch = D + 1;
  float* k_tile = smem;                    // [kTile][pitch]
  float* v_tile = k_tile + kTile * pitch;  // [kTile][D]
  float* beta_tile = v_tile + kTile * D;   // [kTile]
  float* q_rows = beta_tile + kTile;       // [kRows][D]
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t row = blockIdx.x, kv_row = row / group;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kRows, t = t0 + warp;
  const int64_t last = min(t0 + kRows, T) - 1;  // later keys are masked for every row of the block
  const scalar_t* k_head = k + kv_row * T * D;
  const scalar_t* v_head = v + kv_row * T * D;
  const scalar_t* beta_head = log_beta + kv_row * T;
  load_rows(q_rows, D, q + row * T * D, t0, kRows, T, D);
  const float* q_row = q_rows + warp * D;
  float row_max = -INFINITY, row_sum = 0.f, acc[kDims] = {};
  for (int64_t s0 = 0; s0 <= last; s0 += kTile) {
    __syncthreads();  // the previous tile is consumed (and q_rows written, on the first pass)
    load_rows(k_tile, pitch, k_head, s0, kTile, T, D);
    load_rows(v_tile, D, v_head, s0, kTile, T, D);
    load_vector(beta_tile, beta_head, s0, kTile, T);
    __syncthreads();
    if (t > last || s0 > t) continue;  // warp-uniform
    const int64_t i = s0 + lane;
    const bool visible = i <= t;
    const float logit = visible
                            ? dot(q_row, k_tile + lane * pitch, D) * scale + static_cast<float>(t - i) * beta_tile[lane]
                            : -INFINITY;
    // Finite: lane 0 holds key s0 ≤ t. The old max is −inf on the first tile, making the rescale 0.
    const float new_max = fmaxf(row_max, warp_max(logit));
    const float p = visible ? expf(logit - new_max) : 0.f;
    const float rescale = expf(row_max - new_max);
    row_sum = row_sum * rescale + warp_sum(p);
    row_max = new_max;
#pragma unroll
    for (int c = 0; c < kDims; ++c) acc[c] *= rescale;
    for (int j = 0; j < kTile; ++j) {
      const float p_j = __shfl_sync(kFullMask, p, j);
#pragma unroll
      for (int c = 0; c < kDims; ++c) {
        const int d = lane + c * kWarpSize;
        if (d < D) acc[c] = fmaf(p_j, v_tile[j * D + d], acc[c]);
      }
    }
  }
  if (t > last) return;
  const float inv_sum = 1.f / row_sum;
#pragma unroll
  for (int c = 0; c < kDims; ++c) {
    const int d = lane + c * kWarpSize;
    if (d < D) out[(row * T + t) * D + d] = static_cast<scalar_t>(acc[c] * inv_sum);
  }
  if (lane == 0) lse[row * T + t] = row_max + logf(row_sum);
}

// Grid as the forward's.
template <typename scalar_t, int kDims>
__global__ void __launch_bounds__(kThreads)
    grad_q_kernel(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                  const scalar_t* __restrict__ v, const scalar_t* __restrict__ log_beta, const float* __restrict__ lse,
                  const float* __restrict__ delta, scalar_t* __restrict__ grad_q, int64_t T, int D, int group,
                  float scale) {
  extern __shared__ float smem[];
  const int pitch = D + 1;
  float* k_tile = smem;                       // [kTile][pitch]
  float* v_tile = k_tile + kTile * pitch;     // [kTile][pitch]
  float* beta_tile = v_tile + kTile * pitch;  // [kTile]
  float* q_rows = beta_tile + kTile;          // [kRows][D]
  float* grad_rows = q_rows + kRows * D;      // [kRows][D]
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t row = blockIdx.x, kv_row = row / group;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kRows, t = t0 + warp;
  const int64_t last = min(t0 + kRows, T) - 1;
  const scalar_t* k_head = k + kv_row * T * D;
  const scalar_t* v_head = v + kv_row * T * D;
  const scalar_t* beta_head = log_beta + kv_row * T;
  load_rows(q_rows, D, q + row * T * D, t0, kRows, T, D);
  load_rows(grad_rows, D, grad_out + row * T * D, t0, kRows, T, D);
  const float* q_row = q_rows + warp * D;
  const float* grad_row = grad_rows + warp * D;
  const float lse_t = t <= last ? lse[row * T + t] : 0.f;
  const float delta_t = t <= last ? delta[row * T + t] : 0.f;
  float acc[kDims] = {};
  for (int64_t s0 = 0; s0 <= last; s0 += kTile) {
    __syncthreads();
    load_rows(k_tile, pitch, k_head, s0, kTile, T, D);
    load_rows(v_tile, pitch, v_head, s0, kTile, T, D);
    load_vector(beta_tile, beta_head, s0, kTile, T);
    __syncthreads();
    if (t > last || s0 > t) continue;  // warp-uniform
    const int64_t i = s0 + lane;
    float dlogit = 0.f;
    if (i <= t) {
      const float logit = dot(q_row, k_tile + lane * pitch, D) * scale + static_cast<float>(t - i) * beta_tile[lane];
      dlogit = expf(logit - lse_t) * (dot(grad_row, v_tile + lane * pitch, D) - delta_t);
    }
    for (int j = 0; j < kTile; ++j) {
      const float dlogit_j = __shfl_sync(kFullMask, dlogit, j);
#pragma unroll
      for (int c = 0; c < kDims; ++c) {
        const int d = lane + c * kWarpSize;
        if (d < D) acc[c] = fmaf(dlogit_j, k_tile[j * pitch + d], acc[c]);
      }
    }
  }
  if (t > last) return;
#pragma unroll
  for (int c = 0; c < kDims; ++c) {
    const int d = lane + c * kWarpSize;
    if (d < D) grad_q[(row * T + t) * D + d] = static_cast<scalar_t>(acc[c] * scale);
  }
}

// Grid: x = KV row b·Hkv + g (query rows (b·Hkv + g)·group ...), y = block of kRows keys.
template <typename scalar_t, int kDims>
__global__ void __launch_bounds__(kThreads)
    grad_kv_kernel(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ q,
                   const scalar_t* __restrict__ k, const scalar_t* __restrict__ v,
                   const scalar_t* __restrict__ log_beta, const float* __restrict__ lse,
                   const float* __restrict__ delta, scalar_t* __restrict__ grad_k, scalar_t* __restrict__ grad_v,
                   scalar_t* __restrict__ grad_log_beta, int64_t T, int D, int group, float scale) {
  extern __shared__ float smem[];
  const int pitch = D + 1;
  float* q_tile = smem;                         // [kTile][pitch]
  float* grad_tile = q_tile + kTile * pitch;    // [kTile][pitch]
  float* lse_tile = grad_tile + kTile * pitch;  // [kTile]
  float* delta_tile = lse_tile + kTile;         // [kTile]
  float* k_rows = delta_tile + kTile;           // [kRows][D]
  float* v_rows = k_rows + kRows * D;           // [kRows][D]
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t kv_row = blockIdx.x;
  const int64_t s0 = static_cast<int64_t>(blockIdx.y) * kRows, i = s0 + warp;
  load_rows(k_rows, D, k + kv_row * T * D, s0, kRows, T, D);
  load_rows(v_rows, D, v + kv_row * T * D, s0, kRows, T, D);
  const float* k_row = k_rows + warp * D;
  const float* v_row = v_rows + warp * D;
  const float beta_i = i < T ? static_cast<float>(log_beta[kv_row * T + i]) : 0.f;
  float acc_k[kDims] = {}, acc_v[kDims] = {}, dbeta = 0.f;
  for (int64_t row = kv_row * group; row < (kv_row + 1) * group; ++row) {
    // Queries before the block's first key see none of its keys.
    for (int64_t u0 = s0; u0 < T; u0 += kTile) {
      __syncthreads();
      load_rows(q_tile, pitch, q + row * T * D, u0, kTile, T, D);
      load_rows(grad_tile, pitch, grad_out + row * T * D, u0, kTile, T, D);
      load_vector(lse_tile, lse + row * T, u0, kTile, T);
      load_vector(delta_tile, delta + row * T, u0, kTile, T);
      __syncthreads();
      if (i >= T) continue;  // warp-uniform
      const int64_t t = u0 + lane;
      float p = 0.f, dlogit = 0.f;
      if (t < T && t >= i) {
        const float logit = dot(q_tile + lane * pitch, k_row, D) * scale + static_cast<float>(t - i) * beta_i;
        p = expf(logit - lse_tile[lane]);
        dlogit = p * (dot(grad_tile + lane * pitch, v_row, D) - delta_tile[lane]);
        dbeta = fmaf(dlogit, static_cast<float>(t - i), dbeta);
      }
      for (int j = 0; j < kTile; ++j) {
        const float p_j = __shfl_sync(kFullMask, p, j);
        const float dlogit_j = __shfl_sync(kFullMask, dlogit, j);
#pragma unroll
        for (int c = 0; c < kDims; ++c) {
          const int d = lane + c * kWarpSize;
          if (d < D) {
            acc_v[c] = fmaf(p_j, grad_tile[j * pitch + d], acc_v[c]);
            acc_k[c] = fmaf(dlogit_j, q_tile[j * pitch + d], acc_k[c]);
          }
        }
      }
    }
  }
  if (i >= T) return;
#pragma unroll
  for (int c = 0; c < kDims; ++c) {
    const int d = lane + c * kWarpSize;
    if (d < D) {
      grad_k[(kv_row * T + i) * D + d] = static_cast<scalar_t>(acc_k[c] * scale);
      grad_v[(kv_row * T + i) * D + d] = static_cast<scalar_t>(acc_v[c]);
    }
  }
  dbeta = warp_sum(dbeta);
  if (lane == 0) grad_log_beta[kv_row * T + i] = static_cast<scalar_t>(dbeta);
}

size_t forward_smem_bytes(int D) { return sizeof(float) * (kTile * (D + 1) + kTile * D + kTile + kRows * D); }
size_t grad_q_smem_bytes(int D) { return sizeof(float) * (2 * kTile * (D + 1) + kTile + 2 * kRows * D); }
size_t grad_kv_smem_bytes(int D) { return sizeof(float) * (2 * kTile * (D + 1) + 2 * kTile + 2 * kRows * D); }

// Calls f(std::integral_constant<int, kDims>) with kDims = output dims per lane, the smallest of 1, 2, 4, 8
// that covers D.
template <typename F>
void dispatch_dims_per_lane(int D, F&& f) {
  if (D <= 1 * kWarpSize)
    f(std::integral_constant<int, 1>{});
  else if (D <= 2 * kWarpSize)
    f(std::integral_constant<int, 2>{});
  else if (D <= 4 * kWarpSize)
    f(std::integral_constant<int, 4>{});
  else
    f(std::integral_constant<int, 8>{});
}

// Dynamic shared memory past the default 48 KiB needs an opt-in per kernel.
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

void check_cuda_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& log_beta) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda() && log_beta.is_cuda(),
              "kvbound::retention_attention: CUDA tensors expected");
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "kvbound::retention_attention: the CUDA kernel takes float32, bfloat16 or float16; got ", dtype);
  TORCH_CHECK(q.size(3) <= kMaxHeadDim, "kvbound::retention_attention: the CUDA kernel takes head_dim <= ", kMaxHeadDim,
              "; got ", q.size(3));
  TORCH_CHECK((q.size(2) + kRows - 1) / kRows <= kMaxRowBlocks, "kvbound::retention_attention: T = ", q.size(2),
              " exceeds the CUDA kernel's grid (", kMaxRowBlocks * kRows, ")");
}

std::tuple<at::Tensor, at::Tensor> retention_attention_fwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                                                const at::Tensor& v, const at::Tensor& log_beta,
                                                                int64_t /*query_block: CPU tiles*/,
                                                                int64_t /*key_block: CPU tiles*/) {
  check_cuda_inputs(q, k, v, log_beta);
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), bc = log_beta.contiguous();
  at::Tensor out = at::empty_like(qc);
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (q.numel() == 0) return {out, lse};
  if (mma::takes(qc, kc, vc, bc)) {
    mma::forward(qc, kc, vc, bc, out, lse);
    return {out, lse};
  }
  const int64_t T = q.size(2);
  const int D = static_cast<int>(q.size(3)), group = static_cast<int>(q.size(1) / k.size(1));
  const dim3 grid(static_cast<unsigned>(q.size(0) * q.size(1)), static_cast<unsigned>((T + kRows - 1) / kRows));
  const size_t smem = forward_smem_bytes(D);
  AT_DISPATCH_V2(q.scalar_type(), "retention_attention_fwd_cuda", AT_WRAP([&] {
                   dispatch_dims_per_lane(D, [&](auto dims) {
                     const auto kernel = forward_kernel<scalar_t, decltype(dims)::value>;
                     allow_smem(kernel, smem);
                     kernel<<<grid, kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
                         qc.const_data_ptr<scalar_t>(), kc.const_data_ptr<scalar_t>(), vc.const_data_ptr<scalar_t>(),
                         bc.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), lse.mutable_data_ptr<float>(),
                         T, D, group, 1.f / std::sqrt(static_cast<float>(D)));
                     C10_CUDA_KERNEL_LAUNCH_CHECK();
                   });
                 }),
                 at::kFloat, at::kBFloat16, at::kHalf);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> retention_attention_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& log_beta, const at::Tensor& out, const at::Tensor& lse, int64_t /*query_block*/,
    int64_t /*key_block*/) {
  check_cuda_inputs(q, k, v, log_beta);
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), bc = log_beta.contiguous();
  const at::Tensor grad = grad_out.to(q.scalar_type()).contiguous();
  const at::Tensor lse_f = lse.to(at::kFloat).contiguous();
  at::Tensor grad_q = at::empty_like(qc), grad_k = at::empty_like(kc), grad_v = at::empty_like(vc);
  at::Tensor grad_log_beta = at::empty_like(bc);
  if (q.numel() == 0) return {grad_q, grad_k.zero_(), grad_v.zero_(), grad_log_beta.zero_()};
  // Δ_t = dO_t·O_t, the softmax backward's row term, in fp32: [B, Hq, T].
  const at::Tensor delta = at::sum(at::mul(grad.to(at::kFloat), out.to(at::kFloat)), {-1}).contiguous();
  if (mma::takes(qc, kc, vc, bc) && reinterpret_cast<std::uintptr_t>(grad.const_data_ptr()) % 16 == 0) {
    mma::backward(grad, qc, kc, vc, bc, lse_f, delta, grad_q, grad_k, grad_v, grad_log_beta);
    return {grad_q, grad_k, grad_v, grad_log_beta};
  }
  const int64_t T = q.size(2);
  const int D = static_cast<int>(q.size(3)), group = static_cast<int>(q.size(1) / k.size(1));
  const unsigned row_blocks = static_cast<unsigned>((T + kRows - 1) / kRows);
  const dim3 q_grid(static_cast<unsigned>(q.size(0) * q.size(1)), row_blocks);
  const dim3 kv_grid(static_cast<unsigned>(k.size(0) * k.size(1)), row_blocks);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  AT_DISPATCH_V2(q.scalar_type(), "retention_attention_bwd_cuda", AT_WRAP([&] {
                   dispatch_dims_per_lane(D, [&](auto dims) {
                     const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
                     const auto q_kernel = grad_q_kernel<scalar_t, decltype(dims)::value>;
                     allow_smem(q_kernel, grad_q_smem_bytes(D));
                     q_kernel<<<q_grid, kThreads, grad_q_smem_bytes(D), stream>>>(
                         grad.const_data_ptr<scalar_t>(), qc.const_data_ptr<scalar_t>(), kc.const_data_ptr<scalar_t>(),
                         vc.const_data_ptr<scalar_t>(), bc.const_data_ptr<scalar_t>(), lse_f.const_data_ptr<float>(),
                         delta.const_data_ptr<float>(), grad_q.mutable_data_ptr<scalar_t>(), T, D, group, scale);
                     C10_CUDA_KERNEL_LAUNCH_CHECK();
                     const auto kv_kernel = grad_kv_kernel<scalar_t, decltype(dims)::value>;
                     allow_smem(kv_kernel, grad_kv_smem_bytes(D));
                     kv_kernel<<<kv_grid, kThreads, grad_kv_smem_bytes(D), stream>>>(
                         grad.const_data_ptr<scalar_t>(), qc.const_data_ptr<scalar_t>(), kc.const_data_ptr<scalar_t>(),
                         vc.const_data_ptr<scalar_t>(), bc.const_data_ptr<scalar_t>(), lse_f.const_data_ptr<float>(),
                         delta.const_data_ptr<float>(), grad_k.mutable_data_ptr<scalar_t>(),
                         grad_v.mutable_data_ptr<scalar_t>(), grad_log_beta.mutable_data_ptr<scalar_t>(), T, D, group,
                         scale);
                     C10_CUDA_KERNEL_LAUNCH_CHECK();
                   });
                 }),
                 at::kFloat, at::kBFloat16, at::kHalf);
  return {grad_q, grad_k, grad_v, grad_log_beta};
}

}  // namespace
}  // namespace kvbound::ops

TORCH_LIBRARY_IMPL(kvbound, CUDA, m) {
  m.impl("retention_attention_fwd", &kvbound::ops::retention_attention_fwd_cuda);
  m.impl("retention_attention_bwd", &kvbound::ops::retention_attention_bwd_cuda);
}
