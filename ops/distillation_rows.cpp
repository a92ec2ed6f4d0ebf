#include "ops/distillation_rows.h"

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/sub.h>

#include <cmath>
#include <cstdint>

#include "ops/cpu_vector.h"

namespace kvbound::ops {
namespace {

constexpr float kLog2e = 1.44269504088896341f;
constexpr int kLanes = 16;

// Pairwise sum of the lanes, as cpu::fixed_order_sum ends.
float add_lanes(float (&lane)[kLanes]) {
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
  return lane[0];
}

KVBOUND_VECTOR_CLONES float row_max(const float* z, int64_t V) {
  float lane[kLanes];
  for (float& l : lane) l = -INFINITY;
  const int64_t full = V - V % kLanes;
  for (int64_t i = 0; i < full; i += kLanes)
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) lane[j] = z[i + j] > lane[j] ? z[i + j] : lane[j];
  for (int64_t i = full; i < V; ++i) lane[i - full] = z[i] > lane[i - full] ? z[i] : lane[i - full];
  float m = lane[0];
  for (int j = 1; j < kLanes; ++j) m = lane[j] > m ? lane[j] : m;
  return m;
}

// e = exp(z − max) over the teacher row, written over it; returns Σ e, and Σ e·(z − z_s) into *cross (read
// before z is overwritten).
KVBOUND_VECTOR_CLONES float exponentiate_teacher(float* z, const float* z_s, int64_t V, float max, float* cross) {
  float sum[kLanes] = {}, dot[kLanes] = {};
  const int64_t full = V - V % kLanes;
  for (int64_t i = 0; i < full; i += kLanes)
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) {
      const float e = cpu::exp2_nonpositive((z[i + j] - max) * kLog2e);
      dot[j] += e * (z[i + j] - z_s[i + j]);
      sum[j] += e;
      z[i + j] = e;
    }
  for (int64_t i = full; i < V; ++i) {
    const float e = cpu::exp2_nonpositive((z[i] - max) * kLog2e);
    dot[i - full] += e * (z[i] - z_s[i]);
    sum[i - full] += e;
    z[i] = e;
  }
  *cross = add_lanes(dot);
  return add_lanes(sum);
}

// e = exp(z − max) over the student row, written over it; returns Σ e.
KVBOUND_VECTOR_CLONES float exponentiate_student(float* z, int64_t V, float max) {
  float sum[kLanes] = {};
  const int64_t full = V - V % kLanes;
  for (int64_t i = 0; i < full; i += kLanes)
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) {
      const float e = cpu::exp2_nonpositive((z[i + j] - max) * kLog2e);
      sum[j] += e;
      z[i + j] = e;
    }
  for (int64_t i = full; i < V; ++i) {
    const float e = cpu::exp2_nonpositive((z[i] - max) * kLog2e);
    sum[i - full] += e;
    z[i] = e;
  }
  return add_lanes(sum);
}

// diff = e_s·inv_s − e_t·inv_t and, when ce is given, ce = e_s·inv_s − onehot(target). In float32 ce may be
// e_t's own row and diff e_s's (each lane reads both before it writes).
KVBOUND_VECTOR_CLONES void gradient_rows_f32(const float* e_t, const float* e_s, int64_t V, float inv_t, float inv_s,
                                             float* diff, float* ce, int64_t target) {
  if (ce == nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < V; ++i) diff[i] = e_s[i] * inv_s - e_t[i] * inv_t;
    return;
  }
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) {
    const float p_s = e_s[i] * inv_s, d = p_s - e_t[i] * inv_t;
    ce[i] = p_s;
    diff[i] = d;
  }
  ce[target] = ce[target] - 1.f;  // p_s[target] as the loop formed it, minus 1
}

KVBOUND_VECTOR_CLONES void gradient_rows_bf16(const float* e_t, const float* e_s, int64_t V, float inv_t, float inv_s,
                                              uint16_t* diff, uint16_t* ce, int64_t target) {
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) diff[i] = cpu::float_to_bf16(e_s[i] * inv_s - e_t[i] * inv_t);
  if (ce == nullptr) return;
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) ce[i] = cpu::float_to_bf16(e_s[i] * inv_s);
  ce[target] = cpu::float_to_bf16(e_s[target] * inv_s - 1.f);  // rounded once: p_s − 1 keeps its precision near 0
}

void check(const at::Tensor& teacher, const at::Tensor& student, const GradientRows& out) {
  TORCH_CHECK(teacher.dim() == 2 && student.sizes() == teacher.sizes() && teacher.scalar_type() == at::kFloat &&
                  student.scalar_type() == at::kFloat && teacher.stride(1) == 1 && student.stride(1) == 1,
              "distillation_rows: teacher and student must be float32 [n, V] logits with unit stride along V; got ",
              teacher.sizes(), " ", teacher.scalar_type(), " and ", student.sizes(), " ", student.scalar_type());
  TORCH_CHECK(student.device() == teacher.device(), "distillation_rows: teacher and student on different devices");
  for (const at::Tensor* rows : {&out.difference, &out.student_minus_target}) {
    if (!rows->defined()) continue;
    TORCH_CHECK(rows->sizes() == teacher.sizes() && rows->stride(1) == 1 &&
                    (rows->scalar_type() == at::kFloat || rows->scalar_type() == at::kBFloat16) &&
                    rows->device() == teacher.device(),
                "distillation_rows: the gradient rows must be float32 or bfloat16 [n, V] on the logits' device, "
                "unit stride along V; got ", rows->sizes(), " ", rows->scalar_type());
  }
  if (!out.student_minus_target.defined()) return;
  TORCH_CHECK(out.difference.defined() && out.difference.scalar_type() == out.student_minus_target.scalar_type(),
              "distillation_rows: student_minus_target is written beside a difference of its dtype");
  const int64_t n = teacher.size(0);
  TORCH_CHECK(out.targets.defined() && out.targets.dim() == 1 && out.targets.size(0) == n &&
                  out.targets.scalar_type() == at::kLong && out.targets.device() == teacher.device(),
              "distillation_rows: student_minus_target needs targets, [", n, "] int64 on the logits' device");
}

// The CPU kernel indexes each row at its target, so it checks the range itself (two host reads, cheap on the CPU);
// the ATen path's scatter_add checks its indices on every device, without a host sync per block on a GPU.
void check_targets_in_vocabulary(const at::Tensor& targets, int64_t V) {
  TORCH_CHECK(targets.numel() == 0 || (targets.min().item<int64_t>() >= 0 && targets.max().item<int64_t>() < V),
              "distillation_rows: targets must be token ids in [0, ", V, ")");
}

DistillationRows rows_cpu(const at::Tensor& teacher, const at::Tensor& student, const GradientRows& out) {
  const int64_t n = teacher.size(0), V = teacher.size(1);
  DistillationRows terms{at::empty({n}, teacher.options()), at::empty({n}, teacher.options())};
  float* t = teacher.mutable_data_ptr<float>();
  float* s = student.mutable_data_ptr<float>();
  float* kl = terms.kl.mutable_data_ptr<float>();
  float* lse = terms.lse_student.mutable_data_ptr<float>();
  const bool gradients = out.difference.defined(), ce = out.student_minus_target.defined();
  if (ce) check_targets_in_vocabulary(out.targets, V);
  const bool bf16 = gradients && out.difference.scalar_type() == at::kBFloat16;
  void* diff = gradients ? out.difference.mutable_data_ptr() : nullptr;
  void* ce_rows = ce ? out.student_minus_target.mutable_data_ptr() : nullptr;
  const at::Tensor targets = ce ? out.targets.contiguous() : at::Tensor();
  const int64_t* target = ce ? targets.const_data_ptr<int64_t>() : nullptr;
  const int64_t diff_ld = gradients ? out.difference.stride(0) : 0, ce_ld = ce ? out.student_minus_target.stride(0) : 0;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* z_t = t + r * teacher.stride(0);
      float* z_s = s + r * student.stride(0);
      const float max_t = row_max(z_t, V), max_s = row_max(z_s, V);
      float cross = 0.f;
      const float sum_t = exponentiate_teacher(z_t, z_s, V, max_t, &cross);
      const float sum_s = exponentiate_student(z_s, V, max_s);
      const float lse_t = max_t + std::log(sum_t), lse_s = max_s + std::log(sum_s);
      kl[r] = cross / sum_t - lse_t + lse_s;
      lse[r] = lse_s;
      if (!gradients) continue;
      const int64_t target_r = ce ? target[r] : 0;
      if (bf16)
        gradient_rows_bf16(z_t, z_s, V, 1.f / sum_t, 1.f / sum_s, static_cast<uint16_t*>(diff) + r * diff_ld,
                           ce ? static_cast<uint16_t*>(ce_rows) + r * ce_ld : nullptr, target_r);
      else
        gradient_rows_f32(z_t, z_s, V, 1.f / sum_t, 1.f / sum_s, static_cast<float*>(diff) + r * diff_ld,
                          ce ? static_cast<float*>(ce_rows) + r * ce_ld : nullptr, target_r);
    }
  });
  return terms;
}

// Σ_v a[r, v]·b[r, v] per row of two [n, V] blocks, without an [n, V] product tensor.
at::Tensor row_dot(const at::Tensor& a, const at::Tensor& b) {
  return at::bmm(a.unsqueeze(1), b.unsqueeze(2)).view({a.size(0)});
}


// Replaces each row of `logits` by its softmax in place; returns the rows' logsumexp.
at::Tensor softmax_in_place(const at::Tensor& logits) {
  const at::Tensor max = logits.amax(1, /*keepdim=*/true);
  at::Tensor probs = logits;
  at::sub_out(probs, logits, max).exp_();
  const at::Tensor sum = probs.sum(1, /*keepdim=*/true);
  probs.div_(sum);
  return (max + sum.log()).squeeze(1);
}

DistillationRows rows_aten(const at::Tensor& teacher, const at::Tensor& student, const GradientRows& out) {
  at::Tensor scratch = teacher - student;  // z_t − z_s, then p_s − p_t
  const at::Tensor lse_t = softmax_in_place(teacher);  // teacher := p_t
  const at::Tensor kl_cross = row_dot(teacher, scratch);
  const at::Tensor lse_s = softmax_in_place(student);  // student := p_s
  const DistillationRows terms{kl_cross - lse_t + lse_s, lse_s};
  if (!out.difference.defined()) return terms;
  at::sub_out(scratch, student, teacher);
  // Written in this order: student_minus_target may be the teacher's buffer and difference the student's.
  if (out.student_minus_target.defined()) {
    student.scatter_add_(1, out.targets.unsqueeze(1), at::full({teacher.size(0), 1}, -1.0, student.options()));
    out.student_minus_target.copy_(student);
  }
  out.difference.copy_(scratch);
  return terms;
}

}  // namespace

DistillationRows distillation_rows(const at::Tensor& teacher, const at::Tensor& student, const GradientRows& out) {
  check(teacher, student, out);
  return teacher.is_cpu() ? rows_cpu(teacher, student, out) : rows_aten(teacher, student, out);
}

DistillationRows distillation_rows_aten(const at::Tensor& teacher, const at::Tensor& student, const GradientRows& out) {
  check(teacher, student, out);
  return rows_aten(teacher, student, out);
}

}  // namespace kvbound::ops
