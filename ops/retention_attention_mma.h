// Tensor-core path of kvbound::retention_attention on CUDA (ops/retention_attention_mma.cu), used by the
// dispatcher's CUDA kernel (ops/retention_attention_cuda.cu) for the inputs it takes; everything else runs
// the fp32 SIMT kernels there.
#pragma once
#include <ATen/core/Tensor.h>

namespace kvbound::ops::mma {

// bfloat16 or float16, head dim 64 or 128, contiguous, the data of q, k and v 16-byte aligned.
bool takes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& log_beta);

// The forward into allocated outputs: out (q's shape and dtype) and lse (fp32 [B, Hq, T]), both contiguous.
// Inputs must satisfy takes(); the caller holds the device guard (as for backward).
void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& log_beta, at::Tensor& out,
             at::Tensor& lse);

// The backward into allocated gradients (shapes and dtypes of q, k, v, log_beta), given lse and
// Δ_t = dO_t·O_t (both fp32 [B, Hq, T], contiguous) and grad_out in q's dtype, contiguous, 16-byte aligned.
void backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& log_beta, const at::Tensor& lse, const at::Tensor& delta, at::Tensor& grad_q,
              at::Tensor& grad_k, at::Tensor& grad_v, at::Tensor& grad_log_beta);

}  // namespace kvbound::ops::mma
