// float32 linear layers on oneDNN, for CPUs where ATen's float32 GEMM leaves AVX-512 idle. ATen sends a float32
// matmul to MKL's sgemm, and MKL runs its AVX2 kernels on a CPU that is not Intel's (on an AMD EPYC, Zen 5, the
// profile shows mkl_blas_def_sgemm_kernel_0_zen); oneDNN, also inside LibTorch, JIT-compiles AVX-512 kernels
// for the same CPU: 2.0–2.3× MKL's speed on SmolLM2's projection shapes at 1 and 2 threads (scripts/bench.sh
// prints the model's products on both). Reached through the dispatcher's mkldnn::_linear_pointwise, the op PyTorch's
// own compiler emits for CPU linear layers; the result is float32 in another summation order than MKL's.
#pragma once
#include <ATen/core/Tensor.h>

namespace kvbound::ops::onednn {

// Whether this LibTorch has oneDNN's linear (any CPU can run it; float32_preferred says where it is faster).
bool available();

// Whether float32 products take oneDNN here: an x86 CPU not made by Intel, with AVX-512, and a LibTorch built
// with oneDNN. On Intel CPUs MKL's sgemm is AVX-512 already and keeps the products (measured there).
bool float32_preferred();

// x·Wᵀ (+ bias) for float32 x [..., K] and W [N, K] (any strides; a transposed view too), on oneDNN. Differentiable
// in x, W and the bias: dY·W and dYᵀ·x on oneDNN as well (the trained modules' projections: the indexer's keys
// at 2.1× MKL's speed forward, 1.8× for their weight gradient, SmolLM2 shapes, 2 threads, Zen 5).
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {});

// x·Wᵀ (+ bias) on the faster float32 GEMM of this CPU: linear() above for float32 CPU operands where
// float32_preferred(), at::linear otherwise (any dtype or device); differentiable in every operand either way.
at::Tensor preferred_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {});

// a·b for float32 a [M, K] and b [K, N]: linear(a, bᵀ), without a gradient.
at::Tensor mm(const at::Tensor& a, const at::Tensor& b);

}  // namespace kvbound::ops::onednn
