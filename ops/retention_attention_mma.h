// Tensor-core path of kvbound::retention_attention on CUDA (ops/retention_attention_mma.cu), used by the
// dispatcher's CUDA kernel (ops/retention_attention_cuda.cu) for the inputs it takes; everything else runs
// the fp32 SIMT kernels there.
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

namespace kvbound::ops::mma {

// bfloat16 or float16, head dim 64 or 128, contiguous, the data of q, k and v 16-byte aligned.
bool takes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& log_beta);

// Same contract as the dispatcher ops: (out, lse [B, Hq, T] fp32) and (dq, dk, dv, d log_beta). Inputs must
// satisfy takes(); grad_out in q's dtype, contiguous.
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& log_beta);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& grad_out, const at::Tensor& q,
                                                                    const at::Tensor& k, const at::Tensor& v,
                                                                    const at::Tensor& log_beta, const at::Tensor& out,
                                                                    const at::Tensor& lse);

}  // namespace kvbound::ops::mma
