// ops/distillation_rows.h: the fused CPU kernel against the same contract in ATen operations (the path every other
// device runs), both against float64: float32 and bfloat16 gradient rows, rows written over the logits
// themselves, row lengths that leave a tail after whole 16-lane chunks, a row stride wider than the row, the
// ce rows' p_s − 1 at each target, the exact zero of a student equal to its teacher, and bad inputs.
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/one_hot.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <string>

#include "ops/distillation_rows.h"

using namespace kvbound;

namespace {

// A copy of `values` [n, V] in a buffer whose rows are V + 5 wide: the kernel must follow the row stride.
at::Tensor strided_copy(const at::Tensor& values) {
  at::Tensor wide = at::empty({values.size(0), values.size(1) + 5}, values.options());
  at::Tensor view = wide.narrow(1, 0, values.size(1));
  view.copy_(values);
  return view;
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

struct Outputs {
  at::Tensor kl, lse, diff, ce;
};

// The formulas in float64 on the same logits.
Outputs exact(const at::Tensor& teacher, const at::Tensor& student, const at::Tensor& targets) {
  const at::Tensor t = teacher.to(at::kDouble), s = student.to(at::kDouble);
  const at::Tensor lse_t = at::logsumexp(t, 1, true), lse_s = at::logsumexp(s, 1, true);
  const at::Tensor p_t = (t - lse_t).exp(), p_s = (s - lse_s).exp();
  return {(p_t * (t - s)).sum(1) - lse_t.squeeze(1) + lse_s.squeeze(1), lse_s.squeeze(1), p_s - p_t,
          p_s - at::one_hot(targets, t.size(1)).to(at::kDouble)};
}

// The fused kernel's error against float64 stays within twice the ATen path's (the plain float32 formula) plus a
// few float32 roundings of the values it is formed from (`magnitude`: 1 for probabilities, the logsumexp for the
// KL and lse): the criterion of tests/test_retention_ops.cpp, as FlashAttention bounds its kernels. The floor is
// needed because the two round differently (exp2 of (z − max)·log₂e here, ATen's expf there), each within an ulp.
void expect_within_twice_aten(const at::Tensor& kernel, const at::Tensor& aten, const at::Tensor& exact,
                              double magnitude, const std::string& what) {
  const double kernel_error = max_abs_diff(kernel, exact), aten_error = max_abs_diff(aten, exact);
  EXPECT_LE(kernel_error, 2 * aten_error + 16 * 0x1p-24 * magnitude) << what << ": aten's error " << aten_error;
}

// Both implementations on strided copies of one block; gradient rows of `dtype` in buffers of their own, or over
// the logits (float32).
void expect_kernel_matches_aten(int64_t n, int64_t V, double scale, at::ScalarType dtype, bool in_place, bool ce) {
  const at::Tensor teacher = at::randn({n, V}) * scale, student = teacher + at::randn({n, V}) * (scale / 2);
  const at::Tensor targets = at::randint(V, {n});
  auto run = [&](bool fused) {
    const at::Tensor t = strided_copy(teacher), s = strided_copy(student);
    ops::GradientRows rows;
    rows.difference = in_place ? s : strided_copy(at::empty({n, V}, at::TensorOptions().dtype(dtype)));
    if (ce) {
      rows.student_minus_target = in_place ? t : strided_copy(at::empty({n, V}, at::TensorOptions().dtype(dtype)));
      rows.targets = targets;
    }
    const ops::DistillationRows r = fused ? ops::distillation_rows(t, s, rows) : ops::distillation_rows_aten(t, s, rows);
    return Outputs{r.kl, r.lse_student, rows.difference.clone(), ce ? rows.student_minus_target.clone() : at::Tensor()};
  };
  const Outputs kernel = run(true), aten = run(false), formula = exact(teacher, student, targets);
  const std::string what = "n " + std::to_string(n) + " V " + std::to_string(V) + " scale " + std::to_string(scale) +
                           (dtype == at::kBFloat16 ? " bf16" : " f32") + (in_place ? " in place" : "");
  if (V > 1) EXPECT_GT(formula.kl.min().item<double>(), 1e-3) << what;  // a real gap between the rows
  const double lse = formula.lse.abs().max().item<double>();
  expect_within_twice_aten(kernel.kl, aten.kl, formula.kl, lse, what + " kl");
  expect_within_twice_aten(kernel.lse, aten.lse, formula.lse, lse, what + " lse");
  expect_within_twice_aten(kernel.diff, aten.diff, formula.diff, 1, what + " p_s - p_t");
  if (ce) expect_within_twice_aten(kernel.ce, aten.ce, formula.ce, 1, what + " p_s - onehot");
}

}  // namespace

TEST(DistillationRows, CpuKernelMatchesAten) {
  at::manual_seed(11);
  for (const int64_t V : {1, 16, 37, 1000})
    for (const bool in_place : {false, true})
      for (const bool ce : {false, true}) expect_kernel_matches_aten(7, V, 2.0, at::kFloat, in_place, ce);
  expect_kernel_matches_aten(3, 49152, 8.0, at::kFloat, true, true);  // SmolLM2's vocabulary, wide logits
  for (const int64_t V : {37, 1000}) expect_kernel_matches_aten(5, V, 2.0, at::kBFloat16, false, true);
}

// A confident student: p_s at the target near 1, so p_s − 1 is small; formed in float32 and rounded once to
// bfloat16 it keeps a bf16 rounding of itself (rounding p_s to bfloat16 first would make it 0 or an error of 2^-9).
TEST(DistillationRows, ConfidentTargetsKeepTheirGradientInBFloat16) {
  at::manual_seed(14);
  const int64_t n = 4, V = 300;
  const at::Tensor targets = at::randint(V, {n});
  const at::Tensor student = at::randn({n, V}) + at::one_hot(targets, V).to(at::kFloat) * 16;
  const at::Tensor teacher = student + at::randn({n, V}) * 0.5;
  ops::GradientRows rows;
  rows.difference = at::empty({n, V}, at::kBFloat16);
  rows.student_minus_target = at::empty({n, V}, at::kBFloat16);
  rows.targets = targets;
  ops::distillation_rows(teacher.clone(), student.clone(), rows);
  const at::Tensor expected = exact(teacher, student, targets).ce.gather(1, targets.unsqueeze(1));
  const at::Tensor got = rows.student_minus_target.to(at::kDouble).gather(1, targets.unsqueeze(1));
  EXPECT_LT(expected.abs().max().item<double>(), 1e-3);
  // A bfloat16 rounding of the value plus a few float32 roundings of p_s (~1) it was formed from.
  EXPECT_LE(((got - expected).abs() - expected.abs() / 256).max().item<double>(), 4 * 0x1p-24);
}

TEST(DistillationRows, EqualRowsGiveZeroExactly) {
  at::manual_seed(12);
  const at::Tensor z = at::randn({4, 101}) * 5;
  const at::Tensor t = z.clone(), s = z.clone();
  ops::GradientRows rows;
  rows.difference = s;
  const ops::DistillationRows r = ops::distillation_rows(t, s, rows);
  EXPECT_EQ(r.kl.abs().max().item<float>(), 0.0f);
  EXPECT_EQ(s.abs().max().item<float>(), 0.0f);  // p_s − p_t
}

TEST(DistillationRows, RejectsBadInputs) {
  const at::Tensor z = at::randn({2, 8});
  auto rows_of = [](const at::Tensor& difference, const at::Tensor& ce, const at::Tensor& targets) {
    ops::GradientRows rows;
    rows.difference = difference;
    rows.student_minus_target = ce;
    rows.targets = targets;
    return rows;
  };
  const at::Tensor none;
  EXPECT_THROW(ops::distillation_rows(z.to(at::kDouble), z), c10::Error);                // not float32
  EXPECT_THROW(ops::distillation_rows(at::randn({8, 2}).t(), z.clone()), c10::Error);   // stride 2 along V
  EXPECT_THROW(ops::distillation_rows(z.clone(), z.clone(), rows_of(none, z.clone(), at::zeros({2}, at::kLong))),
               c10::Error);  // ce rows without a difference
  EXPECT_THROW(ops::distillation_rows(z.clone(), z.clone(), rows_of(z.clone(), z.to(at::kBFloat16), at::zeros({2}, at::kLong))),
               c10::Error);  // mixed dtypes
  EXPECT_THROW(ops::distillation_rows(z.clone(), z.clone(), rows_of(z.clone(), z.clone(), none)), c10::Error);
  EXPECT_THROW(ops::distillation_rows(z.clone(), z.clone(), rows_of(z.clone(), z.clone(), at::full({2}, 8, at::kLong))),
               c10::Error);  // a target outside the vocabulary
}
