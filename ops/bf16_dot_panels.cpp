#include "ops/bf16_dot_panels.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVBOUND_BF16_DOT 1
#endif

namespace kvbound::ops::bf16_dot {
namespace {

// Rows per micro-kernel call: 6 rows × 4 vectors of 16 columns = 24 accumulators, with the 4 panel vectors and the
// broadcast pair 29 of the 32 zmm registers.
constexpr int kRows = 6;
constexpr int64_t kPairValues = 2 * kPanel;  // bfloat16 values per pair of K in a panel

#ifdef KVBOUND_BF16_DOT
// C[MR, 64] (+)= A[MR, 2·pairs] · B, B one panel's slice [pairs][64][2].
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void multiply_rows(const uint16_t* A, int64_t lda,
                                                                           const uint16_t* B, int64_t pairs, float* C,
                                                                           int64_t ldc, bool accumulate) {
  __m512 acc[MR][4];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) acc[r][q] = accumulate ? _mm512_loadu_ps(C + r * ldc + 16 * q) : _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* b = B + p * kPairValues;
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b), b1 = (__m512bh)_mm512_loadu_si512(b + 32);
    const __m512bh b2 = (__m512bh)_mm512_loadu_si512(b + 64), b3 = (__m512bh)_mm512_loadu_si512(b + 96);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + r * lda + 2 * p, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, b3);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) _mm512_storeu_ps(C + r * ldc + 16 * q, acc[r][q]);
}

using RowsKernel = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t, bool);
constexpr RowsKernel kKernels[kRows] = {&multiply_rows<1>, &multiply_rows<2>, &multiply_rows<3>,
                                        &multiply_rows<4>, &multiply_rows<5>, &multiply_rows<6>};
#endif

}  // namespace

bool available() {
#ifdef KVBOUND_BF16_DOT
  static const bool has = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  return has;
#else
  return false;
#endif
}

void pack_transposed_panels(const uint16_t* rows, int64_t ld, int64_t N, int64_t D, uint16_t* packed) {
  const int64_t panels = (N + kPanel - 1) / kPanel, pairs = D / 2;
  std::fill_n(packed, panels * pairs * kPairValues, uint16_t{0});
  for (int64_t n = 0; n < N; ++n) {
    uint16_t* panel = packed + (n / kPanel) * pairs * kPairValues + (n % kPanel) * 2;
    const uint16_t* row = rows + n * ld;
    for (int64_t p = 0; p < pairs; ++p) {
      panel[p * kPairValues] = row[2 * p];
      panel[p * kPairValues + 1] = row[2 * p + 1];
    }
  }
}

at::Tensor pack_transposed_panels(const at::Tensor& rows) {
  TORCH_CHECK(rows.dim() == 2 && rows.is_cpu() && rows.scalar_type() == at::kBFloat16 && rows.stride(1) == 1 &&
                  rows.size(1) % 2 == 0,
              "bf16_dot::pack_transposed_panels: expected CPU bfloat16 [N, D] with unit stride along D, D even; got ",
              rows.sizes(), " ", rows.scalar_type());
  const int64_t N = rows.size(0), D = rows.size(1), panels = (N + kPanel - 1) / kPanel;
  const at::Tensor packed = at::empty({panels * (D / 2) * kPairValues}, rows.options());
  pack_transposed_panels(static_cast<const uint16_t*>(rows.const_data_ptr()), rows.stride(0), N, D,
                         static_cast<uint16_t*>(packed.mutable_data_ptr()));
  return packed;
}

void multiply_panels(const uint16_t* A, int64_t M, int64_t K, int64_t lda, const uint16_t* packed, int64_t first,
                     int64_t last, float* C, int64_t ldc) {
  TORCH_CHECK(available(), "bf16_dot::multiply_panels: this CPU has no AVX512-BF16");
  TORCH_CHECK(K % 2 == 0 && K > 0, "bf16_dot::multiply_panels: K must be even and positive; got ", K);
#ifdef KVBOUND_BF16_DOT
  const int64_t panel_values = (K / 2) * kPairValues;
  for (int64_t k0 = 0; k0 < K; k0 += kKSlice) {
    const int64_t pairs = std::min(kKSlice, K - k0) / 2;
    for (int64_t j = first; j < last; ++j) {
      const uint16_t* slice = packed + j * panel_values + (k0 / 2) * kPairValues;
      for (int64_t r0 = 0; r0 < M; r0 += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, M - r0);
        kKernels[rows - 1](A + r0 * lda + k0, lda, slice, pairs, C + r0 * ldc + j * kPanel, ldc, k0 > 0);
      }
    }
  }
#else
  (void)A, (void)M, (void)lda, (void)packed, (void)first, (void)last, (void)C, (void)ldc;
#endif
}

}  // namespace kvbound::ops::bf16_dot
