// The per-row work of the distillation loss (losses/distillation.cpp) on a block of float32 logits: for a
// teacher row z_t and a student row z_s,
//   lse_t, lse_s = logsumexp(z_t), logsumexp(z_s)
//   kl           = Σ_v p_t·(z_t − z_s) − lse_t + lse_s          (p = softmax; the difference taken before the sum)
// and what the loss's gradient multiplies into the head: p_s − p_t and, when asked, p_s − onehot(target).
//
// On CPU one fused pass per row: a row of V logits comes from memory once and is then read from cache, where the
// ATen formula made about twelve passes over every [rows, V] block (max, exp, sum and divide per softmax, two row
// dots, a subtraction), each from memory. Each row's sums run in a fixed order (ops/cpu_vector.h) whatever the
// thread count. Either way a teacher row equal to its student row gives kl = 0 and p_s − p_t = 0 exactly.
#pragma once
#include <ATen/core/Tensor.h>

namespace kvbound::ops {

struct DistillationRows {
  at::Tensor kl, lse_student;  // [n] float32
};

// The rows the loss's gradient multiplies into the head, each written when defined: [n, V] float32 or bfloat16
// (one dtype for both), unit stride along V.
struct GradientRows {
  at::Tensor difference;            // p_s − p_t: the KL's gradient (may be the student logits' own buffer)
  at::Tensor student_minus_target;  // p_s − onehot(target): the ce term's (may be the teacher logits' own buffer)
  at::Tensor targets;               // [n] int64 in [0, V), with student_minus_target
};

// teacher, student: [n, V] float32 logits, unit stride along V (left holding scratch values). Each output row is
// formed in float32 and rounded once to its dtype. Runs on the logits' device.
DistillationRows distillation_rows(const at::Tensor& teacher, const at::Tensor& student, const GradientRows& out = {});

// The same contract in ATen operations, on any device (one [n, V] float32 temporary beside the two logit
// buffers): what distillation_rows runs off the CPU, and what its CPU kernel is tested against.
DistillationRows distillation_rows_aten(const at::Tensor& teacher, const at::Tensor& student,
                                        const GradientRows& out = {});

}  // namespace kvbound::ops
