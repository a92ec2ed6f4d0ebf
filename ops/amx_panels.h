// bfloat16 products on the AMX tile units through oneDNN's micro-kernels (ATen's cpublas::pack / brgemm), for a
// right-hand matrix that many products read: Bᵀ of a row-major [N, D] matrix (a head's keys, the LM head) is
// packed once into panels of 64 of its rows, each [D, 64] in oneDNN's layout, and C = A·Bᵀ is then formed in
// float32 panel by panel. The products are exact bfloat16 × bfloat16 terms summed in float32, as a float32
// GEMM of the same values computes them (in another order).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kvbound::ops::amx {

constexpr int64_t kPanel = 64;  // oneDNN's pack writes leading dimensions 16, 32, 48 and 64 only

// n rounded up to a multiple of `multiple`: whole panels of columns, and an even depth K (bfloat16 pairs).
constexpr int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// Whether this CPU's oneDNN packs bfloat16 for its micro-kernels (AMX), with oneDNN enabled.
bool bf16_available();

// rows [N, D] bfloat16 bits (row stride ld, D even) → ceil(N / 64) panels of [D, 64], rows past N zero, into
// `packed` (ceil(N / 64)·64·D values).
void pack_transposed_panels(const uint16_t* rows, int64_t ld, int64_t N, int64_t D, uint16_t* packed);

// The same for a CPU bfloat16 tensor [N, D] with unit stride along D: a new [ceil(N / 64)·64·D] bfloat16 tensor.
at::Tensor pack_transposed_panels(const at::Tensor& rows);

// C[:, 64·j, 64·j + 64) = A·panel j for panels [first, last) (or += with `accumulate`): A [M, D] bfloat16 bits
// (row stride lda), C float32 (row stride ldc, 64·last columns). Call release() when a thread is done with these
// products.
void multiply_panels(const uint16_t* A, int64_t M, int64_t D, int64_t lda, const uint16_t* packed, int64_t first,
                     int64_t last, float* C, int64_t ldc, bool accumulate = false);

// The same product for a K far beyond the cache (a vocabulary): K in slices of kKSlice, each slice of A read
// from memory once while every panel's slice streams past, C accumulating in float32. The panels' split over
// threads does not change any value (each C element sums its slices in one order). K even, C fully written.
constexpr int64_t kKSlice = 256;
void multiply_panels_k_sliced(const uint16_t* A, int64_t M, int64_t K, int64_t lda, const uint16_t* packed,
                              int64_t first, int64_t last, float* C, int64_t ldc);

// Hands the tile configuration back (cpublas::brgemm_release), after a thread's last product.
void release();

}  // namespace kvbound::ops::amx
