// kvbound::rms_norm: the dispatcher op on CPU is the transformers formula; the CUDA kernel's error
// against a float64 reference stays within a small multiple of the plain same-precision ATen error.
#include <ATen/Context.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/rsqrt.h>
#include <gtest/gtest.h>

#include "ops/cuda_module.h"
#include "ops/rms_norm.h"

using namespace kvbound;

TEST(RmsNormOp, CpuMatchesTheFormula) {
  const at::Tensor x = at::randn({3, 5, 64});
  const at::Tensor w = at::randn({64});
  const at::Tensor expected = w * (x / (x.pow(2).mean({-1}, true) + 1e-5).sqrt());
  EXPECT_LE((ops::rms_norm(x, w, 1e-5) - expected).abs().max().item<double>(), 1e-5);
  EXPECT_TRUE(at::equal(ops::rms_norm(x, w, 1e-5), ops::rms_norm_reference(x, w, 1e-5)));
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
  std::string why;
  if (!load_cuda_kernels(&why)) GTEST_SKIP() << why;
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device on this machine";
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
