// The AVX512-BF16 panel products (ops/bf16_dot_panels.h): the packing's layout, and C = A·Bᵀ against float64 on
// the same bfloat16 values within a small multiple of ATen's float32 GEMM error on them — row counts that leave a
// partial micro-kernel block (1 to 6 rows), a partial last panel, a depth of one slice, of several and of a partial
// one, row strides wider than the depth — and the same C whichever panels a call covers. Skipped on a CPU without
// AVX512-BF16 (DistillationHead then takes the AMX tiles or float32; tests/test_distillation.cpp runs every engine
// this CPU has).
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>

#include <string>

#include "ops/bf16_dot_panels.h"

using namespace kvbound;

namespace {

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// C [M, 64·panels] from A [M, K] (bfloat16, any row stride) and B [N, K] bfloat16 packed: panels [first, last).
at::Tensor product(const at::Tensor& A, const at::Tensor& packed, int64_t panels, int64_t first, int64_t last,
                   at::Tensor C = {}) {
  if (!C.defined()) C = at::empty({A.size(0), panels * ops::bf16_dot::kPanel});
  ops::bf16_dot::multiply_panels(static_cast<const uint16_t*>(A.const_data_ptr()), A.size(0), A.size(1), A.stride(0),
                                 static_cast<const uint16_t*>(packed.const_data_ptr()), first, last,
                                 C.mutable_data_ptr<float>(), C.stride(0));
  return C;
}

}  // namespace

TEST(Bf16DotPanels, PacksPairsOfEachRowInPanelsOf64) {
  if (!ops::bf16_dot::available()) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  const at::Tensor rows = at::randn({70, 6}).to(at::kBFloat16);  // a partial second panel
  const at::Tensor packed = ops::bf16_dot::pack_transposed_panels(rows);
  ASSERT_EQ(packed.numel(), 2 * 3 * 128);
  const auto* p = static_cast<const uint16_t*>(packed.const_data_ptr());
  const auto* r = static_cast<const uint16_t*>(rows.const_data_ptr());
  for (int64_t n = 0; n < 128; ++n)
    for (int64_t pair = 0; pair < 3; ++pair)
      for (int64_t i = 0; i < 2; ++i) {
        const uint16_t got = p[(n / 64) * 3 * 128 + pair * 128 + (n % 64) * 2 + i];
        EXPECT_EQ(got, n < 70 ? r[n * 6 + 2 * pair + i] : 0) << "row " << n << " pair " << pair;
      }
}

TEST(Bf16DotPanels, MatchesFloat64WithinTheFloat32GemmError) {
  if (!ops::bf16_dot::available()) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  at::manual_seed(41);
  struct Case { int64_t M, N, K, lda; };
  for (const Case c : {Case{1, 64, 16, 16}, Case{5, 100, 576, 576}, Case{6, 64, 256, 300}, Case{13, 130, 1002, 1002},
                       Case{37, 192, 514, 520}}) {
    const std::string where = "M " + std::to_string(c.M) + " N " + std::to_string(c.N) + " K " + std::to_string(c.K);
    const at::Tensor A = at::randn({c.M, c.lda}).to(at::kBFloat16).narrow(1, 0, c.K);
    const at::Tensor B = at::randn({c.N, c.K}).to(at::kBFloat16);
    const int64_t panels = (c.N + 63) / 64;
    const at::Tensor C = product(A, ops::bf16_dot::pack_transposed_panels(B), panels, 0, panels).narrow(1, 0, c.N);
    const at::Tensor exact = at::matmul(A.to(at::kDouble), B.to(at::kDouble).t());
    const double gemm_error = max_abs_diff(at::matmul(A.to(at::kFloat), B.to(at::kFloat).t()), exact);
    const double error = max_abs_diff(C, exact);
    EXPECT_LE(error, 4 * gemm_error + 1e-6) << where;
    EXPECT_LE(error, 1e-5 * std::sqrt(static_cast<double>(c.K))) << where;
  }
}

TEST(Bf16DotPanels, EachPanelTheSameWhicheverCallCoversIt) {
  if (!ops::bf16_dot::available()) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  at::manual_seed(42);
  const at::Tensor A = at::randn({20, 600}).to(at::kBFloat16), B = at::randn({320, 600}).to(at::kBFloat16);
  const at::Tensor packed = ops::bf16_dot::pack_transposed_panels(B);
  const at::Tensor all = product(A, packed, 5, 0, 5);
  at::Tensor split = at::empty({20, 320});
  product(A, packed, 5, 0, 2, split);
  product(A, packed, 5, 2, 5, split);
  EXPECT_TRUE(at::equal(all, split));
  // Rows split between calls, as DistillationHead splits the products into the head over threads.
  at::Tensor by_rows = at::empty({20, 320});
  product(A.narrow(0, 0, 7), packed, 5, 0, 5, by_rows.narrow(0, 0, 7));
  product(A.narrow(0, 7, 13), packed, 5, 0, 5, by_rows.narrow(0, 7, 13));
  EXPECT_TRUE(at::equal(all, by_rows));
}
