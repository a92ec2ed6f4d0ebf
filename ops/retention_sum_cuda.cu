// CUDA kernels of kvbound::retention_sum (ops/retention_sum.h). One thread per output position: the
// forward thread for query t sums β_i^(t−i) over i ≤ t, the backward thread for source i sums
// grad_S[t]·(t−i)·β_i^(t−i) over t ≥ i; the other side streams through a shared-memory tile of kThreads
// positions. fp32 accumulation whatever the input dtype, compensated (Kahan): a thread adds up to T terms in
// order, whose plain rounding error grows with T past the pairwise sum the reference formula gets from ATen;
// memory O(numel).
#include <ATen/Dispatch_v2.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace kvbound::ops {
namespace {

constexpr int kThreads = 256;         // positions per block, and the length of the shared tile
constexpr int64_t kMaxTiles = 65535;  // gridDim.y limit

// Kahan summation. The _rn intrinsics are never contracted into an FMA, which would lose the compensation.
struct CompensatedSum {
  float sum = 0.f, carry = 0.f;
  __device__ void add(float x) {
    const float y = __fsub_rn(x, carry), t = __fadd_rn(sum, y);
    carry = __fsub_rn(__fsub_rn(t, sum), y);
    sum = t;
  }
};

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    retention_sum_fwd_kernel(const scalar_t* __restrict__ log_beta, scalar_t* __restrict__ sums, int64_t T) {
  __shared__ float beta_tile[kThreads];
  const int64_t row = blockIdx.x, t0 = static_cast<int64_t>(blockIdx.y) * kThreads, t = t0 + threadIdx.x;
  const scalar_t* beta = log_beta + row * T;
  const int64_t last = min(t0 + kThreads, T) - 1;  // the block's last query: later sources are all masked
  CompensatedSum sum;
  for (int64_t s0 = 0; s0 <= last; s0 += kThreads) {
    __syncthreads();
    const int64_t i = s0 + threadIdx.x;
    beta_tile[threadIdx.x] = i < T ? static_cast<float>(beta[i]) : 0.f;
    __syncthreads();
    if (t < T) {
      const int64_t visible = min(static_cast<int64_t>(kThreads), t - s0 + 1);
      for (int c = 0; c < visible; ++c) sum.add(expf(static_cast<float>(t - s0 - c) * beta_tile[c]));
    }
  }
  if (t < T) sums[row * T + t] = static_cast<scalar_t>(sum.sum);
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    retention_sum_bwd_kernel(const scalar_t* __restrict__ grad_sums, const scalar_t* __restrict__ log_beta,
                             scalar_t* __restrict__ grad_log_beta, int64_t T) {
  __shared__ float grad_tile[kThreads];
  const int64_t row = blockIdx.x, s0 = static_cast<int64_t>(blockIdx.y) * kThreads, i = s0 + threadIdx.x;
  const float beta_i = i < T ? static_cast<float>(log_beta[row * T + i]) : 0.f;
  CompensatedSum acc;
  // Queries before the block's first source see none of its sources.
  for (int64_t t0 = s0; t0 < T; t0 += kThreads) {
    __syncthreads();
    const int64_t t = t0 + threadIdx.x;
    grad_tile[threadIdx.x] = t < T ? static_cast<float>(grad_sums[row * T + t]) : 0.f;
    __syncthreads();
    if (i < T) {
      const int64_t count = min(static_cast<int64_t>(kThreads), T - t0);
      for (int64_t r = max(static_cast<int64_t>(0), i - t0); r < count; ++r) {
        const float age = static_cast<float>(t0 + r - i);
        acc.add(grad_tile[r] * age * expf(age * beta_i));
      }
    }
  }
  if (i < T) grad_log_beta[row * T + i] = static_cast<scalar_t>(acc.sum);
}

void check_cuda_input(const at::Tensor& log_beta) {
  TORCH_CHECK(log_beta.is_cuda(), "kvbound::retention_sum: CUDA tensor expected");
  const at::ScalarType dtype = log_beta.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "kvbound::retention_sum: the CUDA kernel takes float32, bfloat16 or float16; got ", dtype);
  TORCH_CHECK((log_beta.size(-1) + kThreads - 1) / kThreads <= kMaxTiles,
              "kvbound::retention_sum: T = ", log_beta.size(-1), " exceeds the CUDA kernel's grid (",
              kMaxTiles * kThreads, ")");
}

// Launch geometry: x = row (leading dims flattened), y = tile of kThreads positions.
dim3 grid_of(const at::Tensor& log_beta) {
  const int64_t T = log_beta.size(-1);
  return dim3(static_cast<unsigned>(log_beta.numel() / T), static_cast<unsigned>((T + kThreads - 1) / kThreads));
}

at::Tensor retention_sum_fwd_cuda(const at::Tensor& log_beta, int64_t /*block: CPU tiles*/) {
  check_cuda_input(log_beta);
  const c10::cuda::CUDAGuard guard(log_beta.device());
  const at::Tensor beta = log_beta.contiguous();
  at::Tensor sums = at::empty_like(beta);
  if (beta.numel() == 0) return sums;
  AT_DISPATCH_V2(beta.scalar_type(), "retention_sum_fwd_cuda", AT_WRAP([&] {
                   retention_sum_fwd_kernel<scalar_t><<<grid_of(beta), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
                       beta.const_data_ptr<scalar_t>(), sums.mutable_data_ptr<scalar_t>(), beta.size(-1));
                 }),
                 at::kFloat, at::kBFloat16, at::kHalf);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return sums;
}

at::Tensor retention_sum_bwd_cuda(const at::Tensor& grad_sums, const at::Tensor& log_beta, int64_t /*block*/) {
  check_cuda_input(log_beta);
  const c10::cuda::CUDAGuard guard(log_beta.device());
  const at::Tensor beta = log_beta.contiguous();
  const at::Tensor grad = grad_sums.to(beta.scalar_type()).contiguous();
  at::Tensor grad_log_beta = at::empty_like(beta);
  if (beta.numel() == 0) return grad_log_beta;
  AT_DISPATCH_V2(beta.scalar_type(), "retention_sum_bwd_cuda", AT_WRAP([&] {
                   retention_sum_bwd_kernel<scalar_t><<<grid_of(beta), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
                       grad.const_data_ptr<scalar_t>(), beta.const_data_ptr<scalar_t>(),
                       grad_log_beta.mutable_data_ptr<scalar_t>(), beta.size(-1));
                 }),
                 at::kFloat, at::kBFloat16, at::kHalf);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad_log_beta;
}

}  // namespace
}  // namespace kvbound::ops

TORCH_LIBRARY_IMPL(kvbound, CUDA, m) {
  m.impl("retention_sum_fwd", &kvbound::ops::retention_sum_fwd_cuda);
  m.impl("retention_sum_bwd", &kvbound::ops::retention_sum_bwd_cuda);
}
