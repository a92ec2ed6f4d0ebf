// oneDNN's float32 linear (ops/onednn_linear.h): x·Wᵀ + b against float64 on the same values within a small
// multiple of ATen's float32 GEMM error on them (3-d inputs, a transposed weight view, one row), the gradients
// dY·W, dYᵀ·x and Σ dY the same way, and mismatched operands refused. Runs on any CPU with this LibTorch's
// oneDNN; the backbone takes it only where float32_preferred() says (DESIGN.md).
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "ops/onednn_linear.h"

using namespace kvbound;

namespace {

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

void expect_linear_matches_float64(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  const at::Tensor exact = at::linear(x.to(at::kDouble), w.to(at::kDouble), b.defined() ? b.to(at::kDouble) : b);
  const double aten_error = max_abs_diff(at::linear(x, w, b), exact);
  const double error = max_abs_diff(ops::onednn::linear(x, w, b), exact);
  EXPECT_LE(error, 4 * aten_error + 1e-6) << "x " << x.sizes() << " W " << w.sizes();
}

}  // namespace

TEST(OnednnLinear, MatchesFloat64WithinTheFloat32GemmError) {
  if (!ops::onednn::available()) GTEST_SKIP() << "this LibTorch has no oneDNN linear";
  at::manual_seed(3);
  expect_linear_matches_float64(at::randn({2, 37, 576}), at::randn({192, 576}), at::randn({192}));
  expect_linear_matches_float64(at::randn({1, 576}), at::randn({1536, 576}), {});
  expect_linear_matches_float64(at::randn({65, 1536}), at::randn({1536, 576}).t(), {});  // a transposed view
  const at::Tensor a = at::randn({33, 200}), m = at::randn({200, 70});
  const double aten_error = max_abs_diff(at::mm(a, m), at::mm(a.to(at::kDouble), m.to(at::kDouble)));
  EXPECT_LE(max_abs_diff(ops::onednn::mm(a, m), at::mm(a.to(at::kDouble), m.to(at::kDouble))), 4 * aten_error + 1e-6);
}

TEST(OnednnLinear, InputGradientIsDyTimesW) {
  if (!ops::onednn::available()) GTEST_SKIP() << "this LibTorch has no oneDNN linear";
  at::manual_seed(4);
  const at::Tensor x = at::randn({3, 17, 96}).requires_grad_(true), w = at::randn({80, 96}), b = at::randn({80});
  const at::Tensor dy = at::randn({3, 17, 80});
  const at::Tensor y = ops::onednn::linear(x, w, b);
  ASSERT_TRUE(y.requires_grad());
  const at::Tensor dx = torch::autograd::grad({y}, {x}, {dy})[0];
  const at::Tensor exact = at::matmul(dy.to(at::kDouble), w.to(at::kDouble));
  const double aten_error = max_abs_diff(at::matmul(dy, w), exact);
  EXPECT_LE(max_abs_diff(dx, exact), 4 * aten_error + 1e-6);
}

TEST(OnednnLinear, WeightAndBiasGradientsAreDyTransposedTimesXAndTheRowSum) {
  if (!ops::onednn::available()) GTEST_SKIP() << "this LibTorch has no oneDNN linear";
  at::manual_seed(5);
  const at::Tensor x = at::randn({2, 511, 576}), dy = at::randn({2, 511, 96});
  const at::Tensor w = (at::randn({96, 576}) * 0.02).requires_grad_(true), b = at::randn({96}).requires_grad_(true);
  const at::Tensor y = ops::onednn::linear(x, w, b);
  ASSERT_TRUE(y.requires_grad());
  const auto grads = torch::autograd::grad({y}, {w, b}, {dy});
  const at::Tensor dy_rows = dy.reshape({-1, 96}), x_rows = x.reshape({-1, 576});
  const at::Tensor exact_w = at::mm(dy_rows.t().to(at::kDouble), x_rows.to(at::kDouble));
  EXPECT_LE(max_abs_diff(grads[0], exact_w), 4 * max_abs_diff(at::mm(dy_rows.t(), x_rows), exact_w) + 1e-6);
  const at::Tensor exact_b = dy_rows.to(at::kDouble).sum(0);
  EXPECT_LE(max_abs_diff(grads[1], exact_b), 4 * max_abs_diff(dy_rows.sum(0), exact_b) + 1e-6);
  // Without a bias, and with x trained too: every gradient from one backward.
  const at::Tensor x2 = at::randn({33, 64}).requires_grad_(true), w2 = at::randn({40, 64}).requires_grad_(true);
  const at::Tensor dy2 = at::randn({33, 40});
  const auto both = torch::autograd::grad({ops::onednn::linear(x2, w2)}, {x2, w2}, {dy2});
  EXPECT_LE(max_abs_diff(both[0], at::mm(dy2.to(at::kDouble), w2.to(at::kDouble))), 1e-4);
  EXPECT_LE(max_abs_diff(both[1], at::mm(dy2.t().to(at::kDouble), x2.to(at::kDouble))), 1e-4);
}

TEST(OnednnLinear, RefusesMismatchedOperands) {
  if (!ops::onednn::available()) GTEST_SKIP() << "this LibTorch has no oneDNN linear";
  EXPECT_THROW(ops::onednn::linear(at::randn({2, 5}), at::randn({8, 4})), c10::Error);  // K mismatch
  EXPECT_THROW(ops::onednn::linear(at::randn({2, 4}), at::randn({8, 4}), at::randn({7})), c10::Error);  // bias size
  EXPECT_THROW(ops::onednn::linear(at::randn({2, 4}).to(at::kDouble), at::randn({8, 4})), c10::Error);
}
