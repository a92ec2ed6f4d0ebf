// TRIM-KV ops (ops/retention_attention.h, ops/retention_sum.h): the blocked CPU kernels against the naive
// ATen references (values and gradients, fp32 and fp64, GQA, T not a multiple of the block), central
// differences in fp64, the closed forms they reduce to, and the memory bound measured with a counting CPU
// allocator. The CUDA kernels against the same references (skipped without a device).
#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/log_sigmoid.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/zeros.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "cuda_available.h"
#include "ops/retention_attention.h"
#include "ops/retention_sum.h"
#include "tests/counting_allocator.h"

using namespace kvbound;

namespace {

struct AttentionInputs {
  at::Tensor q, k, v, log_beta;
  std::vector<at::Tensor> all() const { return {q, k, v, log_beta}; }
};

// log β = logsigmoid(z), z ~ N(2, 2²): mostly β near 1, some strongly decaying tokens.
at::Tensor random_log_beta(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::log_sigmoid(at::randn(sizes, at::kDouble) * 2 + 2).to(dtype);
}

AttentionInputs random_inputs(int64_t B, int64_t Hq, int64_t Hkv, int64_t T, int64_t D, at::ScalarType dtype) {
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  AttentionInputs in{at::randn({B, Hq, T, D}, opts).to(dtype), at::randn({B, Hkv, T, D}, opts).to(dtype),
                     at::randn({B, Hkv, T, D}, opts).to(dtype), random_log_beta({B, Hkv, T}, dtype)};
  for (const at::Tensor& x : in.all()) x.requires_grad_(true);
  return in;
}

AttentionInputs detached_copy(const AttentionInputs& in, at::ScalarType dtype, at::Device device) {
  auto copy = [&](const at::Tensor& x) {
    return x.detach().to(device, dtype, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true);
  };
  return {copy(in.q), copy(in.k), copy(in.v), copy(in.log_beta)};
}

// Output and the gradients of Σ out·weight with respect to q, k, v, log_beta.
struct ValueAndGrads {
  at::Tensor out;
  std::vector<at::Tensor> grads;
};

template <typename Op>
ValueAndGrads value_and_grads(const AttentionInputs& in, const at::Tensor& weight, Op op) {
  const at::Tensor out = op(in);
  const auto grads = torch::autograd::grad({(out * weight.to(out.device(), out.scalar_type())).sum()}, in.all());
  return {out.detach(), grads};
}

double max_abs(const at::Tensor& x) { return x.numel() == 0 ? 0.0 : x.abs().max().item<double>(); }
double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return max_abs(a.detach().cpu().to(at::kDouble) - b.detach().cpu().to(at::kDouble));
}

// |a − b| ≤ tol·max(1, |b|∞): relative to the reference's scale, absolute near zero.
void expect_close(const at::Tensor& actual, const at::Tensor& expected, double tol, const std::string& what) {
  const double scale = std::max(1.0, max_abs(expected.detach().cpu().to(at::kDouble)));
  EXPECT_LE(max_abs_diff(actual, expected), tol * scale) << what;
}

const char* const kGradNames[] = {"grad q", "grad k", "grad v", "grad log_beta"};

struct Shape {
  int64_t B, Hq, Hkv, T, D;
};

std::string describe(const Shape& s, at::ScalarType dtype) {
  return "B=" + std::to_string(s.B) + " Hq=" + std::to_string(s.Hq) + " Hkv=" + std::to_string(s.Hkv) +
         " T=" + std::to_string(s.T) + " D=" + std::to_string(s.D) + " " + c10::toString(dtype);
}

void expect_blocked_matches_reference(const Shape& s, at::ScalarType dtype, double tol, int64_t query_block,
                                      int64_t key_block) {
  const AttentionInputs in = random_inputs(s.B, s.Hq, s.Hkv, s.T, s.D, dtype);
  const at::Tensor weight = at::randn({s.B, s.Hq, s.T, s.D}, at::kDouble).to(dtype);
  const auto blocked = value_and_grads(in, weight, [&](const AttentionInputs& x) {
    return ops::retention_attention(x.q, x.k, x.v, x.log_beta, query_block, key_block);
  });
  const auto reference = value_and_grads(in, weight, [](const AttentionInputs& x) {
    return ops::retention_attention_reference(x.q, x.k, x.v, x.log_beta);
  });
  const std::string what =
      describe(s, dtype) + " blocks " + std::to_string(query_block) + "/" + std::to_string(key_block);
  EXPECT_EQ(blocked.out.scalar_type(), dtype);
  expect_close(blocked.out, reference.out, tol, what + ": out");
  for (int g = 0; g < 4; ++g) expect_close(blocked.grads[g], reference.grads[g], tol, what + ": " + kGradNames[g]);
}

const std::vector<Shape> kShapes = {
    {2, 4, 2, 1, 16}, {2, 4, 2, 7, 16}, {2, 4, 2, 64, 16}, {2, 4, 2, 130, 16},  // GQA, 2 query heads per KV head
    {1, 2, 2, 1, 32}, {1, 2, 2, 7, 32}, {1, 2, 2, 64, 32}, {1, 2, 2, 130, 32},  // one query head per KV head
};

}  // namespace

TEST(RetentionAttention, BlockedMatchesReferenceFloat) {
  at::manual_seed(1);
  for (const Shape& s : kShapes) expect_blocked_matches_reference(s, at::kFloat, 1e-5, 64, 64);
}

TEST(RetentionAttention, BlockedMatchesReferenceDouble) {
  at::manual_seed(2);
  for (const Shape& s : kShapes) expect_blocked_matches_reference(s, at::kDouble, 1e-12, 64, 64);
}

TEST(RetentionAttention, UnequalBlocksMatchReference) {
  // Query blocks that straddle key blocks leave rows with a fully masked key block, and 1×1 blocks
  // make every row its own online-softmax chain.
  at::manual_seed(3);
  const Shape s{2, 4, 2, 130, 16};
  expect_blocked_matches_reference(s, at::kDouble, 1e-12, 48, 16);
  expect_blocked_matches_reference(s, at::kDouble, 1e-12, 16, 48);
  expect_blocked_matches_reference(s, at::kDouble, 1e-12, 128, 128);
  expect_blocked_matches_reference({1, 2, 1, 9, 8}, at::kDouble, 1e-12, 1, 1);
}

TEST(RetentionAttention, BFloat16OnCpuComputesInFloat) {
  at::manual_seed(4);
  const AttentionInputs in = random_inputs(1, 4, 2, 70, 16, at::kBFloat16);
  const at::Tensor out = ops::retention_attention(in.q, in.k, in.v, in.log_beta);
  const AttentionInputs f = detached_copy(in, at::kFloat, at::kCPU);
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  // The float kernel rounded once to bf16: within half a bf16 ulp (2^-8 relative) of the float result.
  expect_close(out, ops::retention_attention(f.q, f.k, f.v, f.log_beta), 1.0 / 256, "bf16 out");
}

TEST(RetentionAttention, CentralDifferencesInDouble) {
  // Every element of every input: (L(x + ε) − L(x − ε)) / 2ε against the analytic gradient, L = Σ out·w.
  at::manual_seed(5);
  const AttentionInputs in = random_inputs(1, 4, 2, 9, 4, at::kDouble);
  const at::Tensor weight = at::randn({1, 4, 9, 4}, at::kDouble);
  auto loss = [&](const AttentionInputs& x) {
    return (ops::retention_attention(x.q, x.k, x.v, x.log_beta, 4, 3) * weight).sum();
  };
  const auto analytic = torch::autograd::grad({loss(in)}, in.all());
  const double eps = 1e-6;
  const auto inputs = in.all();
  for (int g = 0; g < 4; ++g) {
    double worst = 0;
    for (int64_t e = 0; e < inputs[g].numel(); ++e) {
      auto shifted = [&](double delta) {
        AttentionInputs x = detached_copy(in, at::kDouble, at::kCPU);
        std::vector<at::Tensor> all = x.all();
        at::NoGradGuard no_grad;
        all[g].view({-1})[e] += delta;
        return loss(x).item<double>();
      };
      const double numeric = (shifted(eps) - shifted(-eps)) / (2 * eps);
      const double exact = analytic[g].view({-1})[e].item<double>();
      worst = std::max(worst, std::abs(numeric - exact) / std::max(1.0, std::abs(exact)));
    }
    EXPECT_LT(worst, 1e-6) << kGradNames[g];
  }
}

TEST(RetentionAttention, ZeroLogBetaIsCausalAttention) {
  at::manual_seed(6);
  for (const auto& [Hq, Hkv] : std::vector<std::pair<int64_t, int64_t>>{{4, 2}, {3, 3}}) {
    const AttentionInputs in = random_inputs(2, Hq, Hkv, 130, 32, at::kFloat);
    const at::Tensor zero = at::zeros({2, Hkv, 130});
    const at::Tensor expected = at::scaled_dot_product_attention(in.q, in.k, in.v, {}, 0.0, /*is_causal=*/true,
                                                                 std::nullopt, /*enable_gqa=*/true);
    expect_close(ops::retention_attention(in.q, in.k, in.v, zero), expected, 1e-5, "Hq=" + std::to_string(Hq));
    expect_close(ops::retention_attention_reference(in.q, in.k, in.v, zero), expected, 1e-5, "reference");
  }
}

TEST(RetentionAttention, RejectsMismatchedShapes) {
  const at::Tensor q = at::randn({1, 3, 5, 8}), kv = at::randn({1, 2, 5, 8}), beta = at::zeros({1, 2, 5});
  EXPECT_THROW(ops::retention_attention(q, kv, kv, beta), c10::Error);  // 3 query heads over 2 KV heads
  const at::Tensor q4 = at::randn({1, 4, 5, 8});
  EXPECT_THROW(ops::retention_attention(q4, kv, kv, at::zeros({1, 2, 6})), c10::Error);
  EXPECT_THROW(ops::retention_attention(q4, kv, kv.to(at::kDouble), beta), c10::Error);
  EXPECT_THROW(ops::retention_attention(q4, kv, kv, beta, 0, 64), c10::Error);
}

TEST(RetentionSum, BlockedMatchesReference) {
  at::manual_seed(7);
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    const double tol = dtype == at::kFloat ? 1e-5 : 1e-12;
    for (const int64_t T : {1, 7, 64, 130, 300}) {
      const at::Tensor log_beta = random_log_beta({2, 3, T}, dtype).requires_grad_(true);
      const at::Tensor weight = at::randn({2, 3, T}, at::kDouble).to(dtype);
      const at::Tensor blocked = ops::retention_sum(log_beta, 64);
      const at::Tensor reference = ops::retention_sum_reference(log_beta);
      const std::string what = "T=" + std::to_string(T) + " " + c10::toString(dtype);
      expect_close(blocked, reference, tol, what + ": S");
      const at::Tensor grad = torch::autograd::grad({(blocked * weight).sum()}, {log_beta})[0];
      const at::Tensor grad_reference = torch::autograd::grad({(reference * weight).sum()}, {log_beta})[0];
      expect_close(grad, grad_reference, tol, what + ": grad log_beta");
    }
  }
}

TEST(RetentionSum, GeometricSeriesForConstantBeta) {
  // log β_i = log b for all i: S_t = Σ_{j=0}^{t} b^j = (1 − b^(t+1)) / (1 − b).
  const double b = 0.9;
  const at::Tensor sums = ops::retention_sum(at::full({1, 300}, std::log(b), at::kDouble), 64);
  for (const int64_t t : {0, 1, 63, 64, 299})
    EXPECT_NEAR(sums[0][t].item<double>(), (1 - std::pow(b, t + 1)) / (1 - b), 1e-12) << "t=" << t;
  // Any leading dims: [L, B, Hkv, T].
  EXPECT_EQ(ops::retention_sum(at::zeros({2, 1, 3, 5})).sizes(), (std::vector<int64_t>{2, 1, 3, 5}));
  EXPECT_NEAR(ops::retention_sum(at::zeros({2, 1, 3, 5}))[1][0][2][4].item<double>(), 5.0, 1e-6);  // β = 1: t+1
}

TEST(RetentionSum, CentralDifferencesInDouble) {
  at::manual_seed(8);
  const at::Tensor log_beta = random_log_beta({2, 11}, at::kDouble).requires_grad_(true);
  const at::Tensor weight = at::randn({2, 11}, at::kDouble);
  auto loss = [&](const at::Tensor& x) { return (ops::retention_sum(x, 4) * weight).sum(); };
  const at::Tensor analytic = torch::autograd::grad({loss(log_beta)}, {log_beta})[0];
  const double eps = 1e-6;
  double worst = 0;
  for (int64_t e = 0; e < log_beta.numel(); ++e) {
    auto shifted = [&](double delta) {
      const at::Tensor x = log_beta.detach().clone();
      x.view({-1})[e] += delta;
      return loss(x).item<double>();
    };
    const double numeric = (shifted(eps) - shifted(-eps)) / (2 * eps);
    const double exact = analytic.view({-1})[e].item<double>();
    worst = std::max(worst, std::abs(numeric - exact) / std::max(1.0, std::abs(exact)));
  }
  EXPECT_LT(worst, 1e-6);
}

namespace {

// Peak bytes allocated while running forward + backward of Σ op(inputs)·weight.
template <typename Op>
int64_t peak_bytes_of(const AttentionInputs& in, const at::Tensor& weight, Op op) {
  const test::CountCpuAllocations count;
  torch::autograd::grad({(op(in) * weight).sum()}, in.all());
  return count.peak_bytes();
}

}  // namespace

TEST(RetentionAttention, BlockedPathNeverAllocatesTimesSquared) {
  at::manual_seed(9);
  const int64_t B = 1, Hq = 4, Hkv = 2, D = 16;
  {
    // The instrument sees the reference's [B, Hq, T, T] scores.
    const int64_t T = 512;
    const AttentionInputs in = random_inputs(B, Hq, Hkv, T, D, at::kFloat);
    const int64_t peak = peak_bytes_of(in, at::randn({B, Hq, T, D}), [](const AttentionInputs& x) {
      return ops::retention_attention_reference(x.q, x.k, x.v, x.log_beta);
    });
    EXPECT_GE(peak, B * Hq * T * T * 4);
  }
  const int64_t T = 4096;
  const int64_t scores_bytes = B * Hq * T * T * 4;
  const AttentionInputs in = random_inputs(B, Hq, Hkv, T, D, at::kFloat);
  const int64_t peak = peak_bytes_of(in, at::randn({B, Hq, T, D}), [](const AttentionInputs& x) {
    return ops::retention_attention(x.q, x.k, x.v, x.log_beta, 64, 64);
  });
  EXPECT_LT(peak, scores_bytes / 20) << "peak " << peak << " bytes";

  const at::Tensor log_beta = random_log_beta({B, Hkv, T}, at::kFloat).requires_grad_(true);
  const test::CountCpuAllocations count;
  torch::autograd::grad({(ops::retention_sum(log_beta) * at::randn({B, Hkv, T})).sum()}, {log_beta});
  EXPECT_LT(count.peak_bytes(), B * Hkv * T * T * 4 / 20) << "retention_sum peak " << count.peak_bytes() << " bytes";
}

// Every output element of the backward has one writer with a fixed summation order: two runs agree bit for
// bit (d log β included), on the tensor-core and the SIMT path.
TEST(RetentionAttentionCuda, BackwardIsDeterministic) {
  if (const std::string why = test::why_no_cuda(); !why.empty()) GTEST_SKIP() << why;
  at::manual_seed(11);
  for (const at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    const AttentionInputs in = detached_copy(random_inputs(2, 8, 2, 517, 128, at::kFloat), dtype, at::kCUDA);
    const at::Tensor weight = at::randn({2, 8, 517, 128});
    auto run = [&] {
      return value_and_grads(in, weight, [](const AttentionInputs& x) {
        return ops::retention_attention(x.q, x.k, x.v, x.log_beta);
      });
    };
    const ValueAndGrads first = run(), second = run();
    EXPECT_TRUE(at::equal(first.out, second.out)) << dtype;
    for (int g = 0; g < 4; ++g) EXPECT_TRUE(at::equal(first.grads[g], second.grads[g])) << dtype << ": " << kGradNames[g];
  }
}

TEST(RetentionAttentionCuda, MatchesReference) {
  if (const std::string why = test::why_no_cuda(); !why.empty()) GTEST_SKIP() << why;
  at::manual_seed(10);
  // bf16/fp16 with D = 64 or 128 run the tensor-core kernels (T = 1, one partial tile, exactly one and two
  // full 64-row tiles, several tiles with a partial last one, GQA groups 1–4); fp32 and D = 200 / 24 the SIMT
  // kernels (D = 200: 8 dims per lane, a partial last lane group and more than 48 KiB of shared memory).
  for (const Shape& s : std::vector<Shape>{{2, 4, 2, 1, 64},
                                           {2, 4, 2, 37, 64},
                                           {1, 4, 2, 64, 64},
                                           {1, 4, 4, 128, 128},
                                           {1, 8, 2, 333, 64},
                                           {1, 6, 2, 300, 128},
                                           {1, 2, 2, 129, 128},
                                           {1, 2, 2, 130, 200},
                                           {1, 3, 1, 77, 24}}) {
    const AttentionInputs exact_in = random_inputs(s.B, s.Hq, s.Hkv, s.T, s.D, at::kDouble);
    const at::Tensor weight = at::randn({s.B, s.Hq, s.T, s.D}, at::kDouble);
    const auto exact = value_and_grads(exact_in, weight, [](const AttentionInputs& x) {
      return ops::retention_attention_reference(x.q, x.k, x.v, x.log_beta);
    });
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const AttentionInputs in = detached_copy(exact_in, dtype, at::kCUDA);
      const auto kernel = value_and_grads(
          in, weight, [](const AttentionInputs& x) { return ops::retention_attention(x.q, x.k, x.v, x.log_beta); });
      // FlashAttention's criterion: within twice the error of the plain same-precision formula.
      const auto plain = value_and_grads(in, weight, [](const AttentionInputs& x) {
        return ops::retention_attention_reference(x.q, x.k, x.v, x.log_beta);
      });
      const std::string what = describe(s, dtype);
      EXPECT_EQ(kernel.out.scalar_type(), dtype) << what;
      if (dtype == at::kFloat) {
        expect_close(kernel.out, exact.out, 1e-5, what + ": out");
        for (int g = 0; g < 4; ++g) expect_close(kernel.grads[g], exact.grads[g], 1e-4, what + ": " + kGradNames[g]);
      }
      EXPECT_LE(max_abs_diff(kernel.out, exact.out), 2 * max_abs_diff(plain.out, exact.out) + 1e-5) << what << ": out";
      for (int g = 0; g < 4; ++g)
        EXPECT_LE(max_abs_diff(kernel.grads[g], exact.grads[g]),
                  2 * max_abs_diff(plain.grads[g], exact.grads[g]) + 1e-4)
            << what << ": " << kGradNames[g];
    }
  }
}

TEST(RetentionSumCuda, MatchesReference) {
  if (const std::string why = test::why_no_cuda(); !why.empty()) GTEST_SKIP() << why;
  at::manual_seed(11);
  for (const int64_t T : {1, 7, 256, 257, 1000}) {
    const at::Tensor exact_in = random_log_beta({2, 3, T}, at::kDouble).requires_grad_(true);
    const at::Tensor weight = at::randn({2, 3, T}, at::kDouble);
    const at::Tensor exact = ops::retention_sum_reference(exact_in);
    const at::Tensor exact_grad = torch::autograd::grad({(exact * weight).sum()}, {exact_in})[0];
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const at::Tensor in = exact_in.detach().to(at::kCUDA, dtype).requires_grad_(true);
      const at::Tensor sums = ops::retention_sum(in);
      const at::Tensor grad = torch::autograd::grad({(sums * weight.to(at::kCUDA, dtype)).sum()}, {in})[0];
      const at::Tensor plain = ops::retention_sum_reference(in);
      const at::Tensor plain_grad = torch::autograd::grad({(plain * weight.to(at::kCUDA, dtype)).sum()}, {in})[0];
      const std::string what = "T=" + std::to_string(T) + " " + c10::toString(dtype);
      EXPECT_EQ(sums.scalar_type(), dtype) << what;
      if (dtype == at::kFloat) {
        expect_close(sums, exact, 1e-5, what + ": S");
        expect_close(grad, exact_grad, 1e-5, what + ": grad");
      }
      EXPECT_LE(max_abs_diff(sums, exact), 2 * max_abs_diff(plain, exact) + 1e-5) << what << ": S";
      EXPECT_LE(max_abs_diff(grad, exact_grad), 2 * max_abs_diff(plain_grad, exact_grad) + 1e-5) << what << ": grad";
    }
  }
}
