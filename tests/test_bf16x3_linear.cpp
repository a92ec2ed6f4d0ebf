// float32 linear layers as three bfloat16 tile passes (ops/bf16x3_linear.h): the kernel forms exactly the three
// terms x_hi·W_hiᵀ + x_lo·W_hiᵀ + x_hi·W_loᵀ (within float32 accumulation of them), so its error against float64
// stays within a small multiple of ATen's float32 GEMM's; each output depends on its own row and column alone
// (rows computed apart or with other thread counts come out bit for bit the same); partial panels, odd K,
// bias, leading dimensions and strided inputs; the input gradient, through the float32 weight; bad inputs are
// errors. Skipped, saying so, on a CPU whose oneDNN does not pack bfloat16 (no AMX). tests/test_backbone.cpp runs it through the backbone against the goldens.
#include <ATen/Parallel.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "ops/bf16x3_linear.h"
#include "ops/gated_activation.h"

using namespace kvbound;

namespace {

#define REQUIRE_AMX()                                                                                   \
  if (!ops::bf16x3_available())                                                                          \
  GTEST_SKIP() << "this CPU's oneDNN does not pack bfloat16 (no AMX): the bf16x3 products never run here"

// x as its bfloat16 head and the rounded rest, both widened back to float64.
std::pair<at::Tensor, at::Tensor> split64(const at::Tensor& x) {
  const at::Tensor hi = x.to(at::kBFloat16).to(at::kFloat);
  return {hi.to(at::kDouble), (x - hi).to(at::kBFloat16).to(at::kDouble)};
}

// Per output element, Σ_k |x_ik|·|w_jk|: the scale that a dot product's rounding errors are relative to.
at::Tensor magnitude(const at::Tensor& x, const at::Tensor& w) {
  return at::linear(x.to(at::kDouble).abs(), w.to(at::kDouble).abs());
}

class Bf16x3Shapes : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t>> {};

TEST_P(Bf16x3Shapes, FormsTheThreeTermsAndStaysNearTheFloat32Gemm) {
  REQUIRE_AMX();
  const auto [M, N, K] = GetParam();
  at::manual_seed(M * 7919 + N * 31 + K);
  const at::Tensor x = at::randn({M, K}), w = at::randn({N, K}) * 0.05, bias = at::randn({N});
  const at::Tensor out = ops::bf16x3_linear(ops::split_rows(x), ops::Bf16x3Weight(w), bias);
  ASSERT_EQ(out.sizes(), (at::IntArrayRef{M, N}));
  const auto [x_hi, x_lo] = split64(x);
  const auto [w_hi, w_lo] = split64(w);
  const at::Tensor b = bias.to(at::kDouble);
  const at::Tensor terms = at::linear(x_hi, w_hi) + at::linear(x_lo, w_hi) + at::linear(x_hi, w_lo) + b;
  const at::Tensor scale = magnitude(x, w) + b.abs();
  // The three terms summed in float32: within 4·√K float32 roundings of their magnitude (random-sign roundings
  // grow as √K; measured ≤ 2^-21.4 here; a term left out or misplaced is ~2^-9 of it).
  const double accumulation = ((out.to(at::kDouble) - terms).abs() / scale).max().item<double>();
  EXPECT_LE(accumulation, 4 * std::sqrt(double(K)) * 0x1p-24) << "M " << M << " N " << N << " K " << K;
  // Against the exact product: |x_lo| ≤ 2^-8·|x| and |x − x_hi − x_lo| ≤ 2^-17·|x|, so the dropped terms (x_lo·w_lo
  // and both remainders) are at most ~2^-15 of Σ|x|·|w|, the worst case; ATen's float32 GEMM is the yardstick
  // of what random signs give (measured 7–38× its largest error with these seeds, the most at M = 1, where the
  // maximum is over few elements).
  const at::Tensor exact = at::linear(x.to(at::kDouble), w.to(at::kDouble), b);
  const double error = ((out.to(at::kDouble) - exact).abs() / scale).max().item<double>();
  const double float32_error = ((at::linear(x, w, bias).to(at::kDouble) - exact).abs() / scale).max().item<double>();
  EXPECT_LE(error, 0x1p-15) << "M " << M << " N " << N << " K " << K;
  EXPECT_LE(error, 64 * float32_error) << "float32 GEMM " << float32_error;
}

INSTANTIATE_TEST_SUITE_P(Shapes, Bf16x3Shapes,
                         ::testing::Values(std::make_tuple(8, 64, 64), std::make_tuple(129, 192, 576),
                                           std::make_tuple(512, 1536, 576), std::make_tuple(300, 576, 1536),
                                           std::make_tuple(37, 100, 63), std::make_tuple(256, 16, 1537),
                                           std::make_tuple(1, 576, 576)));

TEST(Bf16x3Linear, EachOutputDependsOnItsRowAloneWhateverTheThreads) {
  REQUIRE_AMX();
  at::manual_seed(3);
  const at::Tensor x = at::randn({300, 576}), w = at::randn({200, 576});
  const ops::Bf16x3Weight weight(w);
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  const at::Tensor all = ops::bf16x3_linear(ops::split_rows(x), weight);
  at::set_num_threads(1);
  const at::Tensor one_thread = ops::bf16x3_linear(ops::split_rows(x), weight);
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(all, one_thread));
  // Rows 130…196 alone: another row-block split and another last block.
  const at::Tensor part = ops::bf16x3_linear(ops::split_rows(x.narrow(0, 130, 67)), weight);
  EXPECT_TRUE(at::equal(part, all.narrow(0, 130, 67)));
}

TEST(Bf16x3Linear, KeepsLeadingDimensionsAndReadsStridedInputs) {
  REQUIRE_AMX();
  at::manual_seed(4);
  const at::Tensor x = at::randn({64, 3, 96}).transpose(0, 1);  // [3, 64, 96], not contiguous
  const at::Tensor w = at::randn({80, 96});
  const at::Tensor out = ops::bf16x3_linear(ops::split_rows(x), ops::Bf16x3Weight(w));
  ASSERT_EQ(out.sizes(), (at::IntArrayRef{3, 64, 80}));
  const at::Tensor flat = ops::bf16x3_linear(ops::split_rows(x.contiguous().view({192, 96})), ops::Bf16x3Weight(w));
  EXPECT_TRUE(at::equal(out.view({192, 80}), flat));
}

TEST(Bf16x3Linear, RejectsWhatItCannotMultiply) {
  EXPECT_THROW(ops::split_rows(at::randn({8, 32}).to(at::kBFloat16)), c10::Error);
  REQUIRE_AMX();
  const ops::Bf16x3Weight weight(at::randn({64, 32}));
  EXPECT_THROW(ops::bf16x3_linear(ops::split_rows(at::randn({8, 48})), weight), c10::Error);
  ops::Bf16x3Rows rows = ops::split_rows(at::randn({8, 32}));
  rows.lo = rows.lo.narrow(0, 0, 4);
  EXPECT_THROW(ops::bf16x3_linear(rows, weight), c10::Error);
  const at::Tensor trained = at::randn({64, 32}).requires_grad_(true);
  const at::Tensor x = at::randn({8, 32});
  EXPECT_THROW(ops::bf16x3_linear(x, ops::split_rows(x), weight, trained), c10::Error);
  EXPECT_THROW(ops::Bf16x3Weight(at::randn({64, 32}).to(at::kDouble)), c10::Error);
  EXPECT_THROW(ops::Bf16x3Weight(at::randn({64})), c10::Error);
}

// Where x carries a gradient, it is x's gradient through the float32 weight: dY·W, as ATen's linear gives it.
TEST(Bf16x3Linear, TheInputGradientIsTheFloat32Gemms) {
  REQUIRE_AMX();
  at::manual_seed(5);
  const at::Tensor w = at::randn({192, 96}), bias = at::randn({192}), dy = at::randn({2, 40, 192});
  const at::Tensor x = at::randn({2, 40, 96}).requires_grad_(true);
  const at::Tensor out = ops::bf16x3_linear(x, ops::split_rows(x.detach()), ops::Bf16x3Weight(w), w, bias);
  EXPECT_TRUE(at::equal(out.detach(), ops::bf16x3_linear(ops::split_rows(x.detach()), ops::Bf16x3Weight(w), bias)));
  out.backward(dy);
  const at::Tensor x_ref = x.detach().clone().requires_grad_(true);
  at::linear(x_ref, w, bias).backward(dy);
  EXPECT_TRUE(at::allclose(x.grad(), x_ref.grad(), 1e-5, 1e-5));
  // Its output is no view: a later in-place op on it (or on a view of it) stays differentiable.
  x.mutable_grad() = at::Tensor();
  at::Tensor scaled = ops::bf16x3_linear(x, ops::split_rows(x.detach()), ops::Bf16x3Weight(w), w, bias);
  scaled.view({80, 192}).mul_(2);
  scaled.backward(dy);
  EXPECT_TRUE(at::allclose(x.grad(), 2 * x_ref.grad(), 1e-5, 1e-5));
}

}  // namespace

// SwiGLU's product written straight as tile rows (ops/gated_activation.h): split_rows of silu_gate's float32
// product, bit for bit, for an even and an odd width (the padded column zero), and only without a gradient.
TEST(Bf16x3Linear, SiluGateRowsAreTheSplitOfTheProduct) {
  at::manual_seed(31);
  for (const int64_t K : {1536, 37}) {
    const at::Tensor gate = at::randn({2, 5, K}) * 4, up = at::randn({2, 5, K}) * 3;
    const ops::Bf16x3Rows fused = ops::silu_gate_rows(gate, up), split = ops::split_rows(ops::silu_gate(gate, up));
    EXPECT_TRUE(at::equal(fused.hi, split.hi)) << K;
    EXPECT_TRUE(at::equal(fused.lo, split.lo)) << K;
    EXPECT_EQ(fused.leading, split.leading) << K;
    EXPECT_EQ(fused.in_features, K);
  }
  const at::Tensor needs_grad = at::randn({4, 8}).requires_grad_(true);
  EXPECT_THROW(ops::silu_gate_rows(needs_grad, at::randn({4, 8})), c10::Error);
  EXPECT_THROW(ops::silu_gate_rows(at::randn({4, 8}).to(at::kBFloat16), at::randn({4, 8}).to(at::kBFloat16)), c10::Error);
}
