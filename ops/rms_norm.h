// kvbound::rms_norm(x, weight, eps): y = weight * (x / sqrt(mean(x^2) + eps)), statistics in float32 and
// the normalised value cast back to x's dtype before scaling (transformers' LlamaRMSNorm, bit for bit
// on CPU). A dispatcher op: the CPU kernel is the ATen composition, the CUDA kernel a fused one-pass
// row reduction (ops/rms_norm_cuda.cu) checked against it.
#pragma once
#include <ATen/core/Tensor.h>

namespace kvbound::ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// The plain ATen formula: the CPU kernel and the reference for the CUDA one.
at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps);

}  // namespace kvbound::ops
