// kvbound::rms_norm: the fused CPU kernel (float32, bfloat16) and the CUDA kernel stay within a small multiple of
// the plain same-precision formula's error against float64; other dtypes on the CPU are the formula itself. And
// the fused RoPE rotation equals the formula bit for bit.
#include <ATen/Context.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/rsqrt.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <string>
#include <tuple>
#include <utility>

#include "cuda_available.h"
#include "ops/gated_activation.h"
#include "ops/rms_norm.h"
#include "ops/rope.h"

using namespace kvbound;

TEST(RmsNormOp, CpuMatchesTheFormula) {
  const at::Tensor x = at::randn({3, 5, 64});
  const at::Tensor w = at::randn({64});
  const at::Tensor expected = w * (x / (x.pow(2).mean({-1}, true) + 1e-5).sqrt());
  EXPECT_LE((ops::rms_norm(x, w, 1e-5) - expected).abs().max().item<double>(), 1e-5);
  const at::Tensor x64 = x.to(at::kDouble), w64 = w.to(at::kDouble);
  EXPECT_TRUE(at::equal(ops::rms_norm(x64, w64, 1e-5), ops::rms_norm_reference(x64, w64, 1e-5)));  // not fused
}

// Rows of several lengths (vector tails), strided input, many rows (parallel tasks), scales far from 1.
TEST(RmsNormOp, FusedCpuKernelWithinThePlainError) {
  at::manual_seed(3);
  for (const int64_t cols : {1, 7, 64, 576, 1000})
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      const at::Tensor x64 = at::randn({2, 300, cols}, at::kDouble) * 30;
      const at::Tensor w64 = at::randn({cols}, at::kDouble);
      const at::Tensor exact = ops::rms_norm_reference(x64, w64, 1e-5);
      const at::Tensor x = x64.to(dtype), w = w64.to(dtype);
      const at::Tensor fused = ops::rms_norm(x, w, 1e-5), plain = ops::rms_norm_reference(x, w, 1e-5);
      const std::string what = std::string(c10::toString(dtype)) + " cols " + std::to_string(cols);
      ASSERT_EQ(fused.scalar_type(), dtype) << what;
      ASSERT_EQ(fused.sizes(), x.sizes()) << what;
      const double fused_err = (fused.to(at::kDouble) - exact).abs().max().item<double>();
      const double plain_err = (plain.to(at::kDouble) - exact).abs().max().item<double>();
      EXPECT_LE(fused_err, 2 * plain_err + 1e-6) << what;
      // Only the summation order differs: the two agree to a few float32 roundings (float32) or, in bfloat16,
      // on all but the entries where that moves a rounding boundary (one ulp).
      const double ulp = dtype == at::kFloat ? 1e-6 : 1.0 / 128;
      EXPECT_LE(((fused - plain).abs() / plain.abs().clamp_min(1e-3)).max().item<double>(), 4 * ulp) << what;
      const at::Tensor strided = x.transpose(0, 1);  // [300, 2, cols], not contiguous
      EXPECT_TRUE(at::equal(ops::rms_norm(strided, w, 1e-5), fused.transpose(0, 1))) << what;
    }
}

// The same values give the same result wherever they sit: at any alignment in memory, alone or among other rows
// (vector bodies and scalar tails, lanes of any width, compute the same arithmetic).
TEST(FusedCpuKernels, ResultsDoNotDependOnPlacement) {
  at::manual_seed(6);
  const int64_t rows = 5, cols = 37;
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor x = (at::randn({rows, cols}) * 4).to(dtype), w = at::randn({cols}).to(dtype);
    const at::Tensor up = at::randn({rows, cols}).to(dtype);
    const at::Tensor norm = ops::rms_norm(x, w, 1e-5), gated = ops::silu_gate(x, up);
    for (int64_t offset = 1; offset < 16; ++offset) {
      const at::Tensor buffer = at::zeros({rows * cols + 16}, dtype), up_buffer = at::zeros({rows * cols + 16}, dtype);
      const at::Tensor moved = buffer.narrow(0, offset, rows * cols).view({rows, cols}).copy_(x);
      const at::Tensor up_moved = up_buffer.narrow(0, offset, rows * cols).view({rows, cols}).copy_(up);
      ASSERT_TRUE(moved.is_contiguous());
      EXPECT_TRUE(at::equal(ops::rms_norm(moved, w, 1e-5), norm)) << c10::toString(dtype) << " offset " << offset;
      EXPECT_TRUE(at::equal(ops::silu_gate(moved, up_moved), gated)) << c10::toString(dtype) << " offset " << offset;
    }
    for (int64_t r = 0; r < rows; ++r) {
      EXPECT_TRUE(at::equal(ops::rms_norm(x.narrow(0, r, 1), w, 1e-5), norm.narrow(0, r, 1))) << r;
      EXPECT_TRUE(at::equal(ops::silu_gate(x.narrow(0, r, 1).narrow(1, 3, 20), up.narrow(0, r, 1).narrow(1, 3, 20)),
                            gated.narrow(0, r, 1).narrow(1, 3, 20)))
          << r;
    }
  }
}

TEST(RopeRotate, FusedPathEqualsTheFormulaBitForBit) {
  at::manual_seed(4);
  for (const auto dtype : {at::kFloat, at::kBFloat16})
    for (const int64_t D : {2, 64, 128}) {
      const int64_t B = 2, H = 3, T = 37;
      const at::Tensor angles = at::randn({T, D}, at::kDouble) * 20;
      const at::Tensor cos = angles.cos().to(dtype), sin = angles.sin().to(dtype);
      // As the backbone hands it over: heads transposed out of [B, T, H, D].
      const at::Tensor x = (at::randn({B, T, H, D}) * 5).to(dtype).transpose(1, 2);
      const at::Tensor formula = x * cos + ops::rotate_half(x) * sin;
      const at::Tensor fused = ops::rope_rotate(x, cos, sin);
      const std::string what = std::string(c10::toString(dtype)) + " D " + std::to_string(D);
      EXPECT_TRUE(at::equal(fused, formula)) << what;
      EXPECT_EQ(fused.strides(), x.strides()) << what;  // the layout it came in
      EXPECT_TRUE(at::equal(ops::rope_rotate(x.contiguous(), cos, sin), formula)) << what;
    }
}

TEST(RopeRotate, CarriesGradientsThroughTheFormula) {
  const at::Tensor x = at::randn({1, 2, 5, 8}).set_requires_grad(true);
  const at::Tensor angles = at::randn({5, 8});
  const at::Tensor y = ops::rope_rotate(x, angles.cos(), angles.sin());
  ASSERT_TRUE(y.requires_grad());
  y.sum().backward();
  const at::Tensor expected = angles.cos() + at::cat({angles.sin().narrow(-1, 4, 4), -angles.sin().narrow(-1, 0, 4)}, -1);
  EXPECT_TRUE(at::allclose(x.grad(), expected.expand_as(x), 1e-6, 1e-6));
}

// A float32 input that needs a gradient takes the fused pass both ways: the output and x's gradient equal
// the formula's (ATen's autograd of it) bit for bit, for a head-transposed x, an incoming gradient that is not
// dense, and angles that are not the backbone's (each frequency twice) — the backward assumes nothing of them.
TEST(RopeRotate, FusedGradientEqualsTheFormulasBitForBit) {
  at::manual_seed(9);
  for (const int64_t D : {8, 32, 64}) {
    const at::Tensor angles = at::randn({7, D}) * 3;
    const at::Tensor cos = angles.cos(), sin = angles.sin();
    const at::Tensor base = (at::randn({2, 7, 3, D}) * 5).transpose(1, 2);  // [2, 3, 7, D]
    const at::Tensor grad = at::randn({2, 3, 7, 2 * D}).narrow(-1, 0, D);  // unit stride along D, not dense
    const at::Tensor x = base.detach().requires_grad_(true), x_formula = base.detach().requires_grad_(true);
    const at::Tensor fused = ops::rope_rotate(x, cos, sin);
    const at::Tensor formula = x_formula * cos + ops::rotate_half(x_formula) * sin;
    EXPECT_TRUE(at::equal(fused, formula)) << D;
    // x's gradient comes out in x's (head-transposed) layout, so a norm before RoPE reads it in place.
    const at::Tensor grad_x = torch::autograd::grad({fused}, {x}, {grad}, /*retain_graph=*/true)[0];
    EXPECT_EQ(grad_x.strides(), x.strides()) << D;
    fused.backward(grad);  // the strided gradient itself reaches the backward
    formula.backward(grad);
    EXPECT_TRUE(at::equal(x.grad(), x_formula.grad())) << D;
    EXPECT_TRUE(at::equal(grad_x, x_formula.grad())) << D;
  }
}

TEST(RmsNormOp, GradientsFlowThroughTheOp) {
  // The student forward of training backpropagates through every RMSNorm (weights frozen, input live).
  // float32: the op keeps its statistics in float32 whatever the input dtype (as transformers does).
  const at::Tensor x = at::randn({3, 5, 16}).set_requires_grad(true);
  const at::Tensor w = at::randn({16}).set_requires_grad(true);
  const at::Tensor g = at::randn({3, 5, 16});
  (kvbound::ops::rms_norm(x, w, 1e-5) * g).sum().backward();
  const at::Tensor gx = x.grad().clone(), gw = w.grad().clone();
  x.mutable_grad().zero_();
  w.mutable_grad().zero_();
  const at::Tensor xf = x * at::rsqrt(x.pow(2).mean({-1}, true) + 1e-5);
  (w * xf * g).sum().backward();
  EXPECT_LT((gx - x.grad()).abs().max().item<double>(), 1e-5);
  EXPECT_LT((gw - w.grad()).abs().max().item<double>(), 1e-5);
  EXPECT_FALSE(kvbound::ops::rms_norm(x.detach(), w.detach(), 1e-5).requires_grad());
}

TEST(RmsNormOp, CudaKernelWithinTwiceThePlainError) {
  if (const std::string why = test::why_no_cuda(); !why.empty()) GTEST_SKIP() << why;
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const at::Tensor x64 = at::randn({257, 576}, at::kDouble) * 3;
    const at::Tensor w64 = at::randn({576}, at::kDouble);
    const at::Tensor exact = ops::rms_norm_reference(x64, w64, 1e-5);
    const at::Tensor x = x64.to(dtype).cuda(), w = w64.to(dtype).cuda();
    const double kernel_err = (ops::rms_norm(x, w, 1e-5).cpu().to(at::kDouble) - exact).abs().max().item<double>();
    const double plain_err =
        (ops::rms_norm_reference(x, w, 1e-5).cpu().to(at::kDouble) - exact).abs().max().item<double>();
    EXPECT_LE(kernel_err, 2 * plain_err + 1e-6) << c10::toString(dtype);
  }
}

// The SwiGLU gate: fused on the CPU in float32 and bfloat16 (vector tails, several parallel tasks, inputs up to
// ±90 where exp over- and underflows), within twice the plain formula's error against float64.
TEST(SiluGate, FusedCpuPathWithinThePlainError) {
  at::manual_seed(5);
  for (const int64_t n : {1, 15, 70000})
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      const at::Tensor g64 = at::randn({n}, at::kDouble) * 30, u64 = at::randn({n}, at::kDouble);
      g64.narrow(0, 0, 1).fill_(n > 1 ? 90.0 : -90.0);
      const at::Tensor g = g64.to(dtype), u = u64.to(dtype);
      const at::Tensor exact = at::silu(g.to(at::kDouble)) * u.to(at::kDouble);
      const at::Tensor fused = ops::silu_gate(g, u), plain = at::silu(g) * u;
      const std::string what = std::string(c10::toString(dtype)) + " n " + std::to_string(n);
      ASSERT_EQ(fused.scalar_type(), dtype) << what;
      ASSERT_TRUE(fused.isfinite().all().item<bool>()) << what;
      const double fused_err = (fused.to(at::kDouble) - exact).abs().max().item<double>();
      const double plain_err = (plain.to(at::kDouble) - exact).abs().max().item<double>();
      EXPECT_LE(fused_err, 2 * plain_err + 1e-6) << what;
    }
}

// Gradients of a gated activation the student forward differentiates: on the CPU in float32 and bfloat16 one fused
// pass (the inputs alone saved), within twice the error of ATen's autograd of the plain formula in the same dtype,
// both against float64; either input alone may need the gradient.
TEST(SiluGate, FusedGradientsWithinThePlainError) {
  at::manual_seed(8);
  for (const int64_t n : {1, 15, 70000})
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      const at::Tensor g64 = at::randn({n}, at::kDouble) * 8, u64 = at::randn({n}, at::kDouble);
      const at::Tensor dy64 = at::randn({n}, at::kDouble);
      g64.narrow(0, 0, 1).fill_(n > 1 ? 90.0 : -90.0);
      auto gradients = [&](at::ScalarType t, bool fused) {
        const at::Tensor g = g64.to(t).detach().requires_grad_(), u = u64.to(t).detach().requires_grad_();
        const at::Tensor y = fused ? ops::silu_gate(g, u) : at::silu(g) * u;
        y.backward(dy64.to(t));
        return std::make_pair(g.grad().to(at::kDouble), u.grad().to(at::kDouble));
      };
      const auto exact = gradients(at::kDouble, false), fused = gradients(dtype, true), plain = gradients(dtype, false);
      const std::string what = std::string(c10::toString(dtype)) + " n " + std::to_string(n);
      for (const auto& [f, p, e, name] : {std::make_tuple(fused.first, plain.first, exact.first, "d gate"),
                                          std::make_tuple(fused.second, plain.second, exact.second, "d up")}) {
        ASSERT_TRUE(f.isfinite().all().item<bool>()) << what << " " << name;
        EXPECT_LE((f - e).abs().max().item<double>(), 2 * (p - e).abs().max().item<double>() + 1e-6) << what << " " << name;
      }
    }
  const at::Tensor g = at::randn({6}), u = at::randn({6}).set_requires_grad(true);
  const at::Tensor y = ops::silu_gate(g, u);
  EXPECT_NE(y.grad_fn()->name().find("SiluGateFunction"), std::string::npos) << y.grad_fn()->name();
  y.sum().backward();
  EXPECT_TRUE(at::allclose(u.grad(), at::silu(g), 1e-6, 1e-7));
}

// The input gradient of RMSNorm with a frozen weight (every norm of a student forward): on the CPU in float32 and
// bfloat16 one fused pass per row, within twice the error of ATen's autograd of the formula in the same dtype (both
// against float64), for rows with vector tails and many parallel tasks.
TEST(RmsNormOp, FusedInputGradientWithinThePlainError) {
  at::manual_seed(9);
  for (const int64_t cols : {1, 7, 576, 1000})
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      const at::Tensor x64 = at::randn({2, 300, cols}, at::kDouble) * 30, w64 = at::randn({cols}, at::kDouble);
      const at::Tensor dy64 = at::randn({2, 300, cols}, at::kDouble);
      auto input_gradient = [&](at::ScalarType t, bool fused) {
        const at::Tensor x = x64.to(t).detach().requires_grad_(), w = w64.to(t);
        const at::Tensor y = fused ? ops::rms_norm(x, w, 1e-5) : ops::rms_norm_reference(x, w, 1e-5);
        if (fused) EXPECT_NE(y.grad_fn()->name().find("RmsNormFunction"), std::string::npos) << y.grad_fn()->name();
        y.backward(dy64.to(t));
        return x.grad().to(at::kDouble);
      };
      const at::Tensor exact = input_gradient(at::kDouble, false);
      const at::Tensor fused = input_gradient(dtype, true), plain = input_gradient(dtype, false);
      const std::string what = std::string(c10::toString(dtype)) + " cols " + std::to_string(cols);
      const double fused_err = (fused - exact).abs().max().item<double>();
      const double plain_err = (plain - exact).abs().max().item<double>();
      EXPECT_LE(fused_err, 2 * plain_err + 1e-9) << what;
    }
}
