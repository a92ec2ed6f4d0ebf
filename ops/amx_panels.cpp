#include "ops/amx_panels.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <vector>

namespace kvbound::ops::amx {
namespace {

namespace cpublas = at::native::cpublas;

}  // namespace

bool bf16_available() { return cpublas::could_pack(at::kBFloat16); }  // follows the mkldnn switch, so asked each time

void pack_transposed_panels(const uint16_t* rows, int64_t ld, int64_t N, int64_t D, uint16_t* packed) {
  std::vector<uint16_t> scratch(static_cast<size_t>(D * kPanel), 0);
  for (int64_t j0 = 0; j0 < N; j0 += kPanel) {
    const int64_t n = std::min(kPanel, N - j0);
    if (n < kPanel) std::fill(scratch.begin(), scratch.end(), uint16_t{0});
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < D; ++d) scratch[static_cast<size_t>(d * kPanel + j)] = rows[(j0 + j) * ld + d];
    cpublas::pack(D, kPanel, kPanel, kPanel, at::kBFloat16, at::kBFloat16, scratch.data(),
                  packed + (j0 / kPanel) * D * kPanel);
  }
}

at::Tensor pack_transposed_panels(const at::Tensor& rows) {
  TORCH_CHECK(rows.is_cpu() && rows.scalar_type() == at::kBFloat16 && rows.dim() == 2 && rows.stride(1) == 1 &&
                  rows.size(1) % 2 == 0,
              "amx::pack_transposed_panels: expected a CPU bfloat16 [N, D] matrix, unit stride along an even D; got ",
              rows.sizes(), " ", rows.scalar_type());
  const int64_t N = rows.size(0), D = rows.size(1), panels = (N + kPanel - 1) / kPanel;
  const at::Tensor packed = at::empty({panels * kPanel * D}, rows.options());
  const auto* in = static_cast<const uint16_t*>(rows.const_data_ptr());
  auto* out = static_cast<uint16_t*>(packed.mutable_data_ptr());
  at::parallel_for(0, panels, 16, [&](int64_t begin, int64_t end) {
    pack_transposed_panels(in + begin * kPanel * rows.stride(0), rows.stride(0),
                           std::min(N, end * kPanel) - begin * kPanel, D, out + begin * kPanel * D);
  });
  return packed;
}

void multiply_panels(const uint16_t* A, int64_t M, int64_t D, int64_t lda, const uint16_t* packed, int64_t first,
                     int64_t last, float* C, int64_t ldc, bool accumulate) {
  const auto* a = reinterpret_cast<const at::BFloat16*>(A);
  for (int64_t j = first; j < last; ++j)
    cpublas::brgemm(M, kPanel, D, lda, kPanel, ldc, accumulate, a,
                    reinterpret_cast<const at::BFloat16*>(packed + j * D * kPanel), C + j * kPanel);
}

void multiply_panels_k_sliced(const uint16_t* A, int64_t M, int64_t K, int64_t lda, const uint16_t* packed,
                              int64_t first, int64_t last, float* C, int64_t ldc) {
  const auto* a = reinterpret_cast<const at::BFloat16*>(A);
  // A packed panel holds its K rows in pairs ([K/2][64][2], oneDNN's VNNI layout for bfloat16), so the slice
  // starting at an even k0 begins k0·64 values in.
  for (int64_t k0 = 0; k0 < K; k0 += kKSlice) {
    const int64_t k = std::min(kKSlice, K - k0);
    for (int64_t j = first; j < last; ++j)
      cpublas::brgemm(M, kPanel, k, lda, kPanel, ldc, /*add_C=*/k0 > 0, a + k0,
                      reinterpret_cast<const at::BFloat16*>(packed + j * K * kPanel + k0 * kPanel), C + j * kPanel);
  }
}

void release() { cpublas::brgemm_release(); }

}  // namespace kvbound::ops::amx
