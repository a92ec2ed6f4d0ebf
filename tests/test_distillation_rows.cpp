// ops/distillation_rows.h: the fused CPU kernel against the same contract in ATen operations (the path every other
// device runs), float32 and bfloat16 outputs, outputs written over the logits themselves, row lengths that leave
// a tail after whole 16-lane chunks, a row stride wider than the row, thread counts, and the exact zero of a
// student equal to its teacher.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>

#include <string>

#include "ops/distillation_rows.h"

using namespace kvbound;

namespace {

struct Block {
  at::Tensor teacher, student;  // [n, V] views of wider buffers: row stride V + 5
};

Block random_block(int64_t n, int64_t V, double scale) {
  const at::Tensor t = at::randn({n, V + 5}) * scale;
  return {t.narrow(1, 0, V), (t + at::randn({n, V + 5}) * (scale / 2)).narrow(1, 0, V)};
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

struct Outputs {
  at::Tensor kl, lse, diff, probs;
};

// The formulas in float64 on the same logits.
Outputs exact(const Block& in) {
  const at::Tensor t = in.teacher.to(at::kDouble), s = in.student.to(at::kDouble);
  const at::Tensor lse_t = at::logsumexp(t, 1, true), lse_s = at::logsumexp(s, 1, true);
  const at::Tensor p_t = (t - lse_t).exp(), p_s = (s - lse_s).exp();
  return {(p_t * (t - s)).sum(1) - lse_t.squeeze(1) + lse_s.squeeze(1), lse_s.squeeze(1), p_s - p_t, p_s};
}

// The fused kernel's error against float64 stays within twice the ATen path's (the plain float32 formula) plus a
// hair: the criterion of tests/test_retention_ops.cpp, as FlashAttention bounds its kernels.
void expect_within_twice_aten(const at::Tensor& kernel, const at::Tensor& aten, const at::Tensor& exact,
                              const std::string& what) {
  const double kernel_error = max_abs_diff(kernel, exact), aten_error = max_abs_diff(aten, exact);
  EXPECT_LE(kernel_error, 2 * aten_error + 1e-7 * exact.abs().max().item<double>()) << what << ": aten's error "
                                                                                     << aten_error;
}

// Both implementations on copies of one block; outputs of `dtype` in buffers of their own, or in place.
void expect_kernel_matches_aten(int64_t n, int64_t V, double scale, at::ScalarType dtype, bool in_place,
                                bool with_probs) {
  const Block in = random_block(n, V, scale);
  auto run = [&](bool fused) {
    at::Tensor t = in.teacher.clone(), s = in.student.clone();
    at::Tensor diff = in_place ? s : at::empty({n, V}, at::TensorOptions().dtype(dtype));
    at::Tensor probs = !with_probs ? at::Tensor() : in_place ? t : at::empty({n, V}, at::TensorOptions().dtype(dtype));
    const ops::DistillationRows r =
        fused ? ops::distillation_rows(t, s, diff, probs) : ops::distillation_rows_aten(t, s, diff, probs);
    return Outputs{r.kl, r.lse_student, diff, probs};
  };
  const Outputs kernel = run(true), aten = run(false), formula = exact(in);
  const std::string what = "n " + std::to_string(n) + " V " + std::to_string(V) + " scale " + std::to_string(scale) +
                           (dtype == at::kBFloat16 ? " bf16" : " f32") + (in_place ? " in place" : "");
  if (V > 1) EXPECT_GT(formula.kl.min().item<double>(), 1e-3) << what;  // a real gap between the rows
  expect_within_twice_aten(kernel.kl, aten.kl, formula.kl, what + " kl");
  expect_within_twice_aten(kernel.lse, aten.lse, formula.lse, what + " lse");
  expect_within_twice_aten(kernel.diff, aten.diff, formula.diff, what + " p_s - p_t");
  if (with_probs) expect_within_twice_aten(kernel.probs, aten.probs, formula.probs, what + " p_s");
}

}  // namespace

TEST(DistillationRows, CpuKernelMatchesAten) {
  at::manual_seed(11);
  for (const int64_t V : {1, 16, 37, 1000})
    for (const bool in_place : {false, true})
      for (const bool with_probs : {false, true})
        expect_kernel_matches_aten(7, V, 2.0, at::kFloat, in_place, with_probs);
  expect_kernel_matches_aten(3, 49152, 8.0, at::kFloat, true, true);  // SmolLM2's vocabulary, wide logits
  for (const int64_t V : {37, 1000}) expect_kernel_matches_aten(5, V, 2.0, at::kBFloat16, false, true);
}

TEST(DistillationRows, EqualRowsGiveZeroExactly) {
  at::manual_seed(12);
  const at::Tensor z = at::randn({4, 101}) * 5;
  at::Tensor t = z.clone(), s = z.clone();
  const ops::DistillationRows r = ops::distillation_rows(t, s, s, t);
  EXPECT_EQ(r.kl.abs().max().item<float>(), 0.0f);
  EXPECT_EQ(s.abs().max().item<float>(), 0.0f);  // p_s − p_t
  EXPECT_GT(t.min().item<float>(), 0.0f);         // p_s
}

TEST(DistillationRows, ThreadCountChangesNoBit) {
  at::manual_seed(13);
  const Block in = random_block(9, 333, 3.0);
  auto run = [&](int threads) {
    const int before = at::get_num_threads();
    at::set_num_threads(threads);
    at::Tensor t = in.teacher.clone(), s = in.student.clone();
    const ops::DistillationRows r = ops::distillation_rows(t, s, s, at::Tensor());
    at::set_num_threads(before);
    return std::make_pair(r.kl, s);
  };
  const auto one = run(1), two = run(2);
  EXPECT_TRUE(one.first.equal(two.first));
  EXPECT_TRUE(one.second.equal(two.second));
}

TEST(DistillationRows, RejectsBadInputs) {
  const at::Tensor z = at::randn({2, 8});
  EXPECT_THROW(ops::distillation_rows(z.to(at::kDouble), z, z, at::Tensor()), c10::Error);
  EXPECT_THROW(ops::distillation_rows(z, z.t(), z, at::Tensor()), c10::Error);
  EXPECT_THROW(ops::distillation_rows(z, z.clone(), at::Tensor(), z.clone()), c10::Error);
  EXPECT_THROW(ops::distillation_rows(z, z.clone(), z.clone(), z.to(at::kBFloat16)), c10::Error);
}
