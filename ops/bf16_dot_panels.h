// bfloat16 × bfloat16 → float32 products on a CPU with AVX512-BF16 but no AMX (AMD Zen 4, Intel Cooper Lake):
// VDPBF16PS, 16 float32 lanes each adding two bfloat16 products per instruction, on a register-blocked micro-kernel
// over B packed once in panels of 64 columns. ATen offers nothing between here: its bfloat16 matmul rounds the
// result to bfloat16, MKL's bfloat16 GEMM on a CPU it does not tune for converts both operands and runs sgemm, and
// oneDNN's micro-kernels (cpublas::brgemm) pack bfloat16 on AMX only. The interface mirrors ops/amx_panels.h, so
// a caller holds one packing and picks the engine at construction. A bfloat16 product is exact in float32; the
// sums are float32 in another order than a GEMM's, and VDPBF16PS treats denormal inputs and results as zero.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kvbound::ops::bf16_dot {

constexpr int64_t kPanel = 64;

// Whether this CPU executes VDPBF16PS (and this build compiled the kernel).
bool available();

// rows [N, D] bfloat16 bits (row stride ld, D even) → ceil(N / 64) panels of [D / 2][64][2] (the layout below),
// rows past N zero, into `packed` (ceil(N / 64)·64·D values).
void pack_transposed_panels(const uint16_t* rows, int64_t ld, int64_t N, int64_t D, uint16_t* packed);

// rows [N, D] bfloat16 (CPU, unit stride along D, D even) → ceil(N / 64) panels, panel j holding rows 64·j … 64·j + 63
// as [D / 2][64][2] (row n's pair 2p, 2p + 1 at [p][n − 64·j]), rows past N zero: a new bfloat16 tensor.
at::Tensor pack_transposed_panels(const at::Tensor& rows);

// C[:, 64·j, 64·j + 64) = A·panel jᵀ for panels [first, last): A [M, K] bfloat16 bits (row stride lda, K even, the
// D of the packing), C float32 (row stride ldc, 64·last columns), fully written. K in slices of kKSlice, so that a
// slice of every panel stays in cache while the rows stream past (a vocabulary-long K included); each C element sums
// its slices in one order, so the split of the panels over threads changes no value. Single-threaded.
constexpr int64_t kKSlice = 256;
void multiply_panels(const uint16_t* A, int64_t M, int64_t K, int64_t lda, const uint16_t* packed, int64_t first,
                     int64_t last, float* C, int64_t ldc);

}  // namespace kvbound::ops::bf16_dot
