// kvbound::rms_norm(x, weight, eps): y = weight * (x / sqrt(mean(x^2) + eps)), statistics in float32 and
// the normalised value cast back to x's dtype before scaling (transformers' LlamaRMSNorm). A dispatcher op:
// fused row kernels on the CPU for float32 and bfloat16 (ops/rms_norm_cpu.cpp; other dtypes: the ATen
// composition, bit for bit transformers') and on CUDA (ops/rms_norm_cuda.cu), both checked against it.
#pragma once
#include <ATen/core/Tensor.h>

namespace kvbound::ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// Whether rms_norm_input_gradient serves (x, weight): CPU float32 or bfloat16, weight [x.size(-1)] of x's dtype.
bool rms_norm_input_gradient_fused(const at::Tensor& x, const at::Tensor& weight);

// ∂(Σ grad·rms_norm(x, weight, eps))/∂x in x's dtype, one fused pass per row (ops/rms_norm_cpu.cpp): what the
// op's autograd runs on the CPU when the input needs a gradient and the weight does not (a student forward
// through a frozen backbone), instead of ATen's autograd of the composition (a pass over the rows per step of the
// formula, forward and backward, and the intermediates it saves).
at::Tensor rms_norm_input_gradient(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight, double eps);

// The plain ATen formula: the CPU kernel and the reference for the CUDA one.
at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps);

}  // namespace kvbound::ops
